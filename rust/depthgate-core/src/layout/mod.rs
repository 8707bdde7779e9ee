//! The layout builder: for each case × length × position, the final prompt whose ids are exactly
//! `encode(text)` under the target tokenizer, of exactly the requested length, with the moving
//! evidence block at the requested token offset (snapped to a unit boundary).
//!
//! How (and why this way):
//! 1. Every distinct text (frame pieces, filler, pool, evidence, distractors) is encoded once, in
//!    parallel, and cached as a token segment. Re-tokenizing a 128K prompt per probe is what makes
//!    RULER-style builders run at 0.23 layouts/s (research/anchors_longctx.md §4.5).
//! 2. A pair of adjacent segments is a *junction*. `encode(A)+encode(B) != encode(A+B)` in general
//!    (tokenizers/README.md): the junction is encoded once in a bounded window around the seam and
//!    cached, giving its exact token delta and, where the seam merges tokens, the replacement ids.
//! 3. Per case × length, one haystack (filler with anchored units at fixed depths) is planned by
//!    arithmetic over segment lengths + junction deltas to the exact budget; gaps are closed with
//!    pool sentences of the right length. The haystack is the same at every position, so only the
//!    moving block changes place (a paired design; also what makes prefix caches comparable).
//! 4. Per position the block is inserted at the unit boundary nearest the requested offset.
//! 5. The final ids come from one full encode of the rendered text (`Verification::Full`) or, when
//!    the tokenizer's pre-tokenizer makes junction-local checks sound, from the verified segments
//!    (`Verification::Fast`). Spans are read from offsets of that final encoding, never guessed.
//!    In fast mode the haystack is spliced once per case × length (prefix, haystack, suffix) and
//!    each position inserts the spliced block into it where both new seams merge nothing: the same
//!    ids and offsets as splicing the whole prompt (tested), for two memcpys (ids and text) instead
//!    of a seam look-up per unit; the final offsets stay a few runs of the spliced pieces, read only
//!    around the spans and the region edges (docs/benchmarks.md).

mod assemble;
mod build;
mod haystack;
mod junction;
mod place;
mod pool;
mod segments;
#[cfg(test)]
mod tests;

// The tokenizer-fixture helper of the integration tests (path relative to this folder).
#[cfg(test)]
#[path = "../../tests/common/mod.rs"]
mod test_fixtures;

use std::collections::HashMap;
use std::sync::{Arc, OnceLock, RwLock};

use ahash::AHashMap;
use rayon::prelude::*;

use crate::checks::{presend_check, CheckReport, PresendRow, SendContract};
use crate::digest::{sha256_fields, sha256_hex};
use crate::error::{CoreError, Result};
use crate::spec::{
    BatchSpec, CaseSpec, Layout, PositionSpec, Span, Status, TurnSpan, UnitKind, Verification,
};
use crate::tokenizer::{Piece, SegmentId, TargetTokenizer};
use crate::verify::{verify_layout, Violation};

use self::assemble::*;
use self::build::*;
use self::haystack::*;
use self::junction::*;
use self::place::*;
use self::pool::*;
use self::segments::*;

pub use self::build::build_layouts;
pub use self::pool::filler_digest;
pub use self::segments::LayoutEngine;

struct Refusal {
    code: &'static str,
    message: String,
}

fn refuse(code: &'static str, message: impl Into<String>) -> Refusal {
    Refusal {
        code,
        message: message.into(),
    }
}

/// A planned unit in a sequence: which segment, and what it is.
#[derive(Clone)]
struct Placed {
    seg: UnitIdx,
    kind: UnitKind,
    id: String,
}
