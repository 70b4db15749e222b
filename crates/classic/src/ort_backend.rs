//! ONNX Runtime backend, loaded at run time.
//!
//! ONNX Runtime is the reference runtime for ONNX graphs. Rampart does not link it: the shared
//! library is opened (`dlopen`) the first time a model asks for it, so a build stays
//! self-contained and a machine without the library serves on tract. The library is, in order:
//! [`LoadOptions::onnxruntime_library`], `ORT_DYLIB_PATH`, the library that
//! `scripts/fetch-onnxruntime.sh` extracted from the pinned wheel into the model cache
//! (`onnxruntime/<version>/`), or the `libonnxruntime.so*` inside a Python `onnxruntime` package
//! in the model cache's `venv` (`$RAMPART_MODEL_CACHE`, then `~/.cache/rampart/models`).
//!
//! ONNX Runtime allows one environment per process, so the first library that loads stays for
//! the life of the process; a failed attempt leaves nothing behind and the next model may retry.
//! `ort` 2.0 takes `&mut self` to run a session, so every runner owns a session built from the
//! same model bytes and the batcher's instances run in parallel.

use std::borrow::Cow;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};

use ort::environment::Environment;
use ort::session::builder::GraphOptimizationLevel;
use ort::session::{Session as OrtSession, SessionInputValue};
use ort::value::{DynValue, TensorElementType, ValueType};
use repo::manifest::TensorSpec;

use crate::backend::{Backend, Session};
use crate::error::ClassicError;
use crate::model::LoadOptions;
use crate::tensor::{Data, Tensor};

/// The loaded library and the process's one ONNX Runtime environment.
struct Runtime {
    library: PathBuf,
    version: String,
    environment: Environment,
}

/// Set once, when a library loaded and its environment was built.
static RUNTIME: OnceLock<Runtime> = OnceLock::new();
/// Serializes load attempts; holds the library `ort` keeps open once `dlopen` and the version
/// check succeeded (even if building the environment then failed: `ort` cannot unload it).
static OPENED: Mutex<Option<PathBuf>> = Mutex::new(None);

/// The library file a load should use, and where that choice came from (for messages).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LibraryChoice {
    pub path: PathBuf,
    pub origin: &'static str,
}

/// Finds the ONNX Runtime library: `explicit`, else `ORT_DYLIB_PATH`, else the library
/// `scripts/fetch-onnxruntime.sh` extracted into the model cache, else a Python `onnxruntime`
/// package in the model cache's venv.
pub fn locate_library(explicit: Option<&Path>) -> Result<LibraryChoice, ClassicError> {
    if let Some(path) = explicit {
        return Ok(LibraryChoice {
            path: path.to_path_buf(),
            origin: "the configured onnxruntime_library",
        });
    }
    if let Some(path) = std::env::var_os("ORT_DYLIB_PATH").filter(|p| !p.is_empty()) {
        return Ok(LibraryChoice {
            path: PathBuf::from(path),
            origin: "ORT_DYLIB_PATH",
        });
    }
    for cache in cache_folders() {
        if let Some(path) = fetched_library(&cache.join("onnxruntime")) {
            return Ok(LibraryChoice {
                path,
                origin: "the library scripts/fetch-onnxruntime.sh put in the model cache",
            });
        }
    }
    let venvs: Vec<PathBuf> = cache_folders().iter().map(|c| c.join("venv")).collect();
    for venv in &venvs {
        if let Some(path) = library_in_venv(venv) {
            return Ok(LibraryChoice {
                path,
                origin: "the onnxruntime Python package in the model cache",
            });
        }
    }
    Err(ClassicError::Load(format!(
        "the ONNX Runtime library was not found: set onnxruntime_library or ORT_DYLIB_PATH to \
         libonnxruntime.so, or `pip install onnxruntime` into a venv at {}",
        venvs
            .iter()
            .map(|v| v.display().to_string())
            .collect::<Vec<_>>()
            .join(" or ")
    )))
}

/// `$RAMPART_MODEL_CACHE`, then `~/.cache/rampart/models`.
fn cache_folders() -> Vec<PathBuf> {
    let mut out = Vec::new();
    if let Some(cache) = std::env::var_os("RAMPART_MODEL_CACHE").filter(|c| !c.is_empty()) {
        out.push(PathBuf::from(cache));
    }
    if let Some(home) = std::env::var_os("HOME").filter(|h| !h.is_empty()) {
        let default = PathBuf::from(home).join(".cache/rampart/models");
        if !out.contains(&default) {
            out.push(default);
        }
    }
    out
}

/// `onnxruntime/<version>/libonnxruntime.so.<version>` (scripts/fetch-onnxruntime.sh); with
/// several versions, the highest.
fn fetched_library(folder: &Path) -> Option<PathBuf> {
    let mut versions: Vec<(Vec<u64>, PathBuf)> = std::fs::read_dir(folder)
        .ok()?
        .flatten()
        .filter_map(|entry| {
            let name = entry.file_name().into_string().ok()?;
            let key: Vec<u64> = name
                .split('.')
                .map(|p| p.parse().ok())
                .collect::<Option<_>>()?;
            let library = entry.path().join(format!("libonnxruntime.so.{name}"));
            library.is_file().then_some((key, library))
        })
        .collect();
    versions.sort();
    versions.pop().map(|(_, library)| library)
}

/// `venv/lib/python3*/site-packages/onnxruntime/capi/libonnxruntime.so*`; with several Python
/// versions, the newest.
fn library_in_venv(venv: &Path) -> Option<PathBuf> {
    let mut pythons: Vec<(u32, PathBuf)> = std::fs::read_dir(venv.join("lib"))
        .ok()?
        .flatten()
        .filter_map(|entry| {
            let name = entry.file_name().into_string().ok()?;
            let minor = name.strip_prefix("python3.")?.parse().ok()?;
            Some((minor, entry.path()))
        })
        .collect();
    pythons.sort();
    pythons.iter().rev().find_map(|(_, python)| {
        let capi = python.join("site-packages/onnxruntime/capi");
        let mut found: Vec<PathBuf> = std::fs::read_dir(&capi)
            .ok()?
            .flatten()
            .map(|e| e.path())
            .filter(|p| {
                p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(is_runtime_library)
            })
            .collect();
        // `libonnxruntime.so` and `libonnxruntime.so.1.32.0` are the same library; take the
        // shortest name.
        found.sort_by_key(|p| p.as_os_str().len());
        found.into_iter().next()
    })
}

/// The runtime itself, not its execution-provider plug-ins (`libonnxruntime_providers_*.so`).
fn is_runtime_library(name: &str) -> bool {
    name == "libonnxruntime.so"
        || name.starts_with("libonnxruntime.so.")
        || (name.starts_with("libonnxruntime.") && name.ends_with(".dylib"))
}

/// Opens the library (once per process) and returns the runtime.
fn runtime(choice: &LibraryChoice) -> Result<&'static Runtime, ClassicError> {
    if let Some(rt) = RUNTIME.get() {
        return same_library(rt, choice);
    }
    // A panic while holding this lock was caught below; the state it guards is still valid.
    let mut opened = OPENED.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(rt) = RUNTIME.get() {
        return same_library(rt, choice);
    }
    if let Some(earlier) = opened.as_ref() {
        if !same_file(earlier, &choice.path) {
            return Err(ClassicError::Load(format!(
                "ONNX Runtime from {} cannot be loaded: this process already opened {}",
                choice.path.display(),
                earlier.display()
            )));
        }
    }
    let path = choice.path.clone();
    let attempt = catch_unwind(AssertUnwindSafe(|| {
        // `init_from` returns errors for a missing file, a library without `OrtGetApiBase` and a
        // library older than the API `ort` asks for; the catch is for the asserts and expects
        // `ort` still has on the way.
        let builder = ort::init_from(&path).map_err(|e| {
            format!(
                "cannot open ONNX Runtime ({}; set onnxruntime_library or ORT_DYLIB_PATH to \
                 another libonnxruntime.so): {e}",
                choice.origin
            )
        })?;
        *opened = Some(path.clone());
        let environment = builder
            .with_name("rampart")
            .build()
            .map_err(|e| format!("ONNX Runtime from {} did not start: {e}", path.display()))?;
        Ok::<_, String>((environment, library_version(&path)))
    }));
    match attempt {
        Ok(Ok((environment, version))) => {
            tracing::info!(library = %path.display(), %version, origin = choice.origin, "loaded ONNX Runtime");
            let _ = RUNTIME.set(Runtime {
                library: path,
                version,
                environment,
            });
            Ok(RUNTIME.get().expect("RUNTIME was set just above"))
        }
        Ok(Err(message)) => Err(ClassicError::Load(message)),
        Err(panic) => Err(ClassicError::Load(format!(
            "loading ONNX Runtime from {} ({}) failed: {}",
            path.display(),
            choice.origin,
            panic_message(&*panic)
        ))),
    }
}

/// The library's version (`1.32.0`): `OrtGetApiBase()->GetVersionString()`, which `ort` reads
/// but does not expose; else `ort::info()`, the build string.
fn library_version(path: &Path) -> String {
    // SAFETY: `ort` has just opened `path` and found `OrtGetApiBase` in it, so this second open
    // only takes another reference to the same library. `OrtGetApiBase` and `GetVersionString`
    // take no arguments; the string is static in the library and copied before `library` closes.
    let version = unsafe {
        libloading::Library::new(path).ok().and_then(|library| {
            let api_base = library
                .get::<unsafe extern "C" fn() -> *const ort::sys::OrtApiBase>(b"OrtGetApiBase")
                .ok()?;
            let base = api_base();
            if base.is_null() {
                return None;
            }
            let version = ((*base).GetVersionString)();
            (!version.is_null()).then(|| {
                std::ffi::CStr::from_ptr(version)
                    .to_string_lossy()
                    .into_owned()
            })
        })
    };
    version.unwrap_or_else(|| ort::info().to_string())
}

fn same_library(
    rt: &'static Runtime,
    choice: &LibraryChoice,
) -> Result<&'static Runtime, ClassicError> {
    if same_file(&rt.library, &choice.path) {
        Ok(rt)
    } else {
        Err(ClassicError::Load(format!(
            "ONNX Runtime from {} ({}) cannot be loaded: this process already runs ONNX Runtime {} from {}",
            choice.path.display(),
            choice.origin,
            rt.version,
            rt.library.display()
        )))
    }
}

fn same_file(a: &Path, b: &Path) -> bool {
    a == b
        || matches!(
            (std::fs::canonicalize(a), std::fs::canonicalize(b)),
            (Ok(x), Ok(y)) if x == y
        )
}

fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "a panic without a message".into())
}

/// The ONNX Runtime library version this process runs, when one is loaded.
pub fn loaded_version() -> Option<(String, PathBuf)> {
    RUNTIME
        .get()
        .map(|rt| (rt.version.clone(), rt.library.clone()))
}

/// A graph on ONNX Runtime.
pub struct OrtBackend {
    runtime: &'static Runtime,
    /// The graph's bytes: every runner's session is built from them.
    model: Vec<u8>,
    path: PathBuf,
    intra_threads: usize,
    outputs: Vec<String>,
    /// The session built at load (to report a bad graph then); the first runner takes it.
    first: Mutex<Option<OrtSession>>,
}

/// Loads `path` on ONNX Runtime.
pub fn load(
    path: &Path,
    _inputs: &[TensorSpec],
    outputs: &[TensorSpec],
    options: &LoadOptions,
) -> Result<Arc<dyn Backend>, ClassicError> {
    let choice = locate_library(options.onnxruntime_library.as_deref())?;
    let runtime = runtime(&choice)?;
    let model = std::fs::read(path)
        .map_err(|e| ClassicError::Load(format!("cannot read {}: {e}", path.display())))?;
    let mut backend = OrtBackend {
        runtime,
        model,
        path: path.to_path_buf(),
        // Rampart runs several instances of a model side by side; one thread each unless told.
        intra_threads: options.threads.max(1),
        outputs: Vec::new(),
        first: Mutex::new(None),
    };
    let session = backend
        .build()
        .map_err(|e| ClassicError::Load(e.to_string()))?;
    // Outputs come back in graph order under the manifest's names (the graph's own names when
    // the manifest records fewer).
    backend.outputs = session
        .outputs()
        .iter()
        .enumerate()
        .map(|(i, o)| {
            outputs
                .get(i)
                .map_or_else(|| o.name().to_string(), |s| s.name.clone())
        })
        .collect();
    *backend.first.get_mut().unwrap_or_else(|p| p.into_inner()) = Some(session);
    Ok(Arc::new(backend))
}

/// ONNX Runtime would not make a session of the model.
#[derive(Debug, thiserror::Error)]
#[error("ONNX Runtime {version} cannot load {}: {source}", .path.display())]
struct SessionBuildError {
    version: String,
    path: PathBuf,
    #[source]
    source: ort::Error,
}

impl OrtBackend {
    fn build(&self) -> Result<OrtSession, SessionBuildError> {
        let fail = |source: ort::Error| SessionBuildError {
            version: self.runtime.version.clone(),
            path: self.path.clone(),
            source,
        };
        OrtSession::builder(&self.runtime.environment)
            .map_err(fail)?
            .with_optimization_level(GraphOptimizationLevel::All)
            .map_err(|e| fail(e.into()))?
            .with_intra_threads(self.intra_threads)
            .map_err(|e| fail(e.into()))?
            .with_inter_threads(1)
            .map_err(|e| fail(e.into()))?
            .commit_from_memory(&self.model)
            .map_err(fail)
    }
}

impl Backend for OrtBackend {
    fn name(&self) -> &'static str {
        "onnxruntime"
    }

    fn session(&self) -> Result<Box<dyn Session>, ClassicError> {
        let first = self.first.lock().unwrap_or_else(|p| p.into_inner()).take();
        let session = match first {
            Some(s) => s,
            None => self
                .build()
                .map_err(|e| ClassicError::Backend(e.to_string()))?,
        };
        Ok(Box::new(OrtRunner {
            session,
            outputs: self.outputs.clone(),
        }))
    }
}

struct OrtRunner {
    session: OrtSession,
    outputs: Vec<String>,
}

fn to_ort(t: Tensor) -> Result<(Cow<'static, str>, SessionInputValue<'static>), ClassicError> {
    let name = t.name;
    let shape: Vec<i64> = t.shape.iter().map(|&d| d as i64).collect();
    macro_rules! value {
        ($v:expr) => {
            ort::value::Tensor::from_array((shape, $v)).map(|t| t.upcast())
        };
    }
    let value = match t.data {
        Data::Bool(v) => value!(v),
        Data::U8(v) => value!(v),
        Data::U16(v) => value!(v),
        Data::U32(v) => value!(v),
        Data::U64(v) => value!(v),
        Data::I8(v) => value!(v),
        Data::I16(v) => value!(v),
        Data::I32(v) => value!(v),
        Data::I64(v) => value!(v),
        Data::F16(v) => value!(v),
        Data::F32(v) => value!(v),
        Data::F64(v) => value!(v),
        Data::Bytes(_) => {
            return Err(ClassicError::BadInput(format!(
                "input {name:?}: BYTES (string) tensors cannot feed a graph on the ONNX Runtime backend"
            )))
        }
    }
    .map_err(|e| ClassicError::BadInput(format!("input {name:?}: {e}")))?;
    Ok((
        Cow::Owned(name),
        SessionInputValue::from(DynValue::from(value)),
    ))
}

fn from_ort(name: &str, value: &DynValue) -> Result<Tensor, ClassicError> {
    let fail = |e: ort::Error| ClassicError::Backend(format!("output {name:?}: {e}"));
    let ValueType::Tensor { ty, .. } = value.dtype() else {
        return Err(ClassicError::Backend(format!(
            "output {name:?} is a {}, not a tensor",
            value.dtype()
        )));
    };
    macro_rules! take {
        ($t:ty, $v:ident) => {{
            let (shape, data) = value.try_extract_tensor::<$t>().map_err(fail)?;
            (shape.to_vec(), Data::$v(data.to_vec()))
        }};
    }
    let (shape, data) = match ty {
        TensorElementType::Float32 => take!(f32, F32),
        TensorElementType::Float64 => take!(f64, F64),
        TensorElementType::Float16 => take!(half::f16, F16),
        TensorElementType::Int64 => take!(i64, I64),
        TensorElementType::Int32 => take!(i32, I32),
        TensorElementType::Int16 => take!(i16, I16),
        TensorElementType::Int8 => take!(i8, I8),
        TensorElementType::Uint64 => take!(u64, U64),
        TensorElementType::Uint32 => take!(u32, U32),
        TensorElementType::Uint16 => take!(u16, U16),
        TensorElementType::Uint8 => take!(u8, U8),
        TensorElementType::Bool => take!(bool, Bool),
        TensorElementType::String => {
            let (shape, strings) = value.try_extract_strings().map_err(fail)?;
            (
                shape.to_vec(),
                Data::Bytes(strings.into_iter().map(String::into_bytes).collect()),
            )
        }
        other => {
            return Err(ClassicError::Backend(format!(
                "output {name:?} has element type {other:?}, which Rampart does not return"
            )))
        }
    };
    let shape = shape
        .iter()
        .map(|&d| usize::try_from(d))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|_| {
            ClassicError::Backend(format!(
                "output {name:?} has a negative dimension: {shape:?}"
            ))
        })?;
    Tensor::new(name, shape, data)
        .map_err(|e| ClassicError::Backend(format!("output {name:?}: {e}")))
}

impl Session for OrtRunner {
    fn run(&mut self, inputs: Vec<Tensor>) -> Result<Vec<Tensor>, ClassicError> {
        let values = inputs
            .into_iter()
            .map(to_ort)
            .collect::<Result<Vec<_>, _>>()?;
        let outputs = self
            .session
            .run(values)
            .map_err(|e| ClassicError::Backend(e.to_string()))?;
        outputs
            .values()
            .enumerate()
            .map(|(i, value)| {
                let name = self
                    .outputs
                    .get(i)
                    .cloned()
                    .unwrap_or_else(|| format!("output_{i}"));
                from_ort(&name, &value)
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fetched_library_is_the_highest_version_present() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(fetched_library(&dir.path().join("none")), None);
        for (version, present) in [("1.9.0", true), ("1.32.0", true), ("1.40.0", false)] {
            let folder = dir.path().join(version);
            std::fs::create_dir_all(&folder).unwrap();
            if present {
                std::fs::write(folder.join(format!("libonnxruntime.so.{version}")), b"").unwrap();
            }
        }
        std::fs::create_dir_all(dir.path().join("latest")).unwrap();
        assert_eq!(
            fetched_library(dir.path()),
            Some(dir.path().join("1.32.0/libonnxruntime.so.1.32.0")),
            "numeric order, a folder without its library skipped"
        );
    }
}
