//! The one place where core errors become Python exceptions. The exception tree itself is declared
//! once, in `python/depthgate/exceptions.py`, with the file/field/fix attributes users rely on.

use depthgate_core::CoreError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

/// Newtype so `?` converts core errors (orphan rule: we cannot impl From<CoreError> for PyErr).
pub struct PyCoreError(pub CoreError);

impl From<CoreError> for PyCoreError {
    fn from(e: CoreError) -> Self {
        PyCoreError(e)
    }
}

impl From<PyCoreError> for PyErr {
    fn from(err: PyCoreError) -> PyErr {
        Python::attach(|py| match build(py, &err.0) {
            Ok(e) => e,
            Err(e) => e,
        })
    }
}

fn build(py: Python<'_>, err: &CoreError) -> PyResult<PyErr> {
    let module = py.import("depthgate.exceptions")?;
    let kwargs = PyDict::new(py);
    let (class, message) = match err {
        CoreError::TokenizerLoad { path, detail } => {
            kwargs.set_item("file", path)?;
            kwargs.set_item(
                "fix",
                "pass a valid HF tokenizer.json (tokenizers >= 0.20 format)",
            )?;
            (
                "TokenizerLoadError",
                format!("cannot load tokenizer: {detail}"),
            )
        }
        CoreError::Spec { field, detail, fix } => {
            kwargs.set_item("field", field)?;
            kwargs.set_item("fix", fix)?;
            ("SpecError", detail.clone())
        }
        CoreError::Encode { what, detail } => (
            "VerificationError",
            format!("tokenizer failed on {what}: {detail}"),
        ),
    };
    let instance = module.getattr(class)?.call((message,), Some(&kwargs))?;
    Ok(PyErr::from_value(instance))
}
