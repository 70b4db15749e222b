//! ONNX Runtime backend, loaded at run time.

use std::path::Path;
use std::sync::Arc;

use repo::manifest::TensorSpec;

use crate::backend::Backend;
use crate::error::ClassicError;
use crate::model::LoadOptions;

/// Loads `path` on ONNX Runtime.
pub fn load(
    _path: &Path,
    _inputs: &[TensorSpec],
    _outputs: &[TensorSpec],
    _options: &LoadOptions,
) -> Result<Arc<dyn Backend>, ClassicError> {
    Err(ClassicError::Load(
        "this build does not include the ONNX Runtime backend".into(),
    ))
}
