//! Read-only memory maps of model files.

use std::fs::File;
use std::ops::Deref;
use std::path::{Path, PathBuf};

/// A read-only memory map of a whole file. Model weights are served zero-copy from it.
#[derive(Debug)]
pub struct MappedFile {
    path: PathBuf,
    map: Option<memmap2::Mmap>,
}

impl MappedFile {
    /// Maps `path` read-only. An empty file yields an empty slice (mapping zero bytes is an error
    /// on Linux, so it is special-cased).
    pub fn open(path: impl AsRef<Path>) -> std::io::Result<Self> {
        let path = path.as_ref().to_path_buf();
        let file = File::open(&path)?;
        let len = file.metadata()?.len();
        let map = if len == 0 {
            None
        } else {
            // SAFETY: the map is read-only. Model files in the repository are immutable (read-only
            // permissions, digests checked before load); a file truncated underneath a live map is
            // the one hazard left, as with every mmap-based model loader.
            Some(unsafe { memmap2::Mmap::map(&file)? })
        };
        Ok(Self { path, map })
    }

    /// The path this map was opened from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The mapped bytes.
    pub fn bytes(&self) -> &[u8] {
        self.map.as_deref().unwrap_or(&[])
    }
}

impl Deref for MappedFile {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        self.bytes()
    }
}
