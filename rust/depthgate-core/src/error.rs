//! Typed errors of the core. The bindings translate each variant once into the Python exception
//! tree (`depthgate.exceptions`); messages name the input and the fix.

use thiserror::Error;

#[derive(Debug, Error)]
pub enum CoreError {
    /// The tokenizer file is missing, unreadable or not a valid `tokenizer.json`.
    #[error("{path}: cannot load tokenizer: {detail} (fix: pass a valid HF tokenizer.json)")]
    TokenizerLoad { path: String, detail: String },

    /// The layout spec (JSON from the Python side) is malformed or contradicts itself.
    #[error("layout spec: field {field:?}: {detail} (fix: {fix})")]
    Spec {
        field: String,
        detail: String,
        fix: String,
    },

    /// The tokenizer itself failed on an input (should not happen for valid UTF-8).
    #[error("tokenizer failed while encoding {what}: {detail}")]
    Encode { what: String, detail: String },
}

pub type Result<T> = std::result::Result<T, CoreError>;

impl CoreError {
    pub(crate) fn spec(
        field: impl Into<String>,
        detail: impl Into<String>,
        fix: impl Into<String>,
    ) -> Self {
        CoreError::Spec {
            field: field.into(),
            detail: detail.into(),
            fix: fix.into(),
        }
    }
}
