//! depthgate-core: token-exact long-context layouts, in pure Rust (no Python).
//!
//! One direction of flow: a [`spec::BatchSpec`] (JSON from the Python front) → [`layout::build_layouts`]
//! (rayon inside) → [`spec::Layout`]s whose ids are exactly `encode(text)` under the target
//! tokenizer → [`checks::presend_check`] before sending, [`verify::verify_layout`] to re-check any
//! stored layout from scratch.
//!
//! Modules: `tokenizer` (load, digest, special tokens, per-tokenizer caches) · `soundness` (is
//! fast verification provably exact for a tokenizer) · `layout` (placement, seams, exact length;
//! depends on `tokenizer`, never the reverse) · `verify` (full re-encode check) · `checks`
//! (pre-send) · `digest` · `error`.

pub mod checks;
pub mod digest;
pub mod error;
pub mod layout;
pub mod soundness;
pub mod spec;
pub mod tokenizer;
pub mod verify;

pub use checks::{presend_check, presend_check_batch, CheckReport, PresendRow, SendContract};
pub use error::{CoreError, Result};
pub use layout::build_layouts;
pub use spec::{BatchSpec, Layout, Span, Status, Verification};
pub use tokenizer::TargetTokenizer;
pub use verify::{verify_batch, verify_layout, StoredLayout, Violation};

/// Version of the assembly algorithm; part of every layout id.
pub const ASSEMBLER_VERSION: &str = "depthgate-layout/1";
