//! Progress reporting for long operations (hashing and copying large files).

/// Receives progress of byte-oriented work. The command line draws bars with it; libraries and
/// servers pass [`NoProgress`].
pub trait Progress: Sync {
    /// A new unit of work of `total_bytes` begins (one file).
    fn begin(&self, label: &str, total_bytes: u64);
    /// `bytes` more bytes of the current unit are done.
    fn advance(&self, bytes: u64);
    /// The current unit is finished.
    fn end(&self);
}

/// Reports nothing.
#[derive(Debug, Default, Clone, Copy)]
pub struct NoProgress;

impl Progress for NoProgress {
    fn begin(&self, _label: &str, _total_bytes: u64) {}
    fn advance(&self, _bytes: u64) {}
    fn end(&self) {}
}
