//! The batch spec that crosses from Python (pydantic → JSON) into the core, and the layouts that
//! come back. Owned data only: one call per batch, never per token.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Verification {
    /// Encode every final prompt once, in full. The mode tests trust.
    Full,
    /// Assemble from cached token segments and verify each junction in a bounded window; allowed
    /// only where the tokenizer's structure makes that sound, else the layout falls back to full.
    Fast,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum UnitKind {
    Evidence,
    Distractor,
    Filler,
    Frame,
    /// An MRCR request (issue 25): its span is recorded, but it repeats verbatim by design (the
    /// same request made several times), so it is neither evidence (occurs once) nor a distractor.
    Request,
}

impl UnitKind {
    pub fn as_str(self) -> &'static str {
        match self {
            UnitKind::Evidence => "evidence",
            UnitKind::Distractor => "distractor",
            UnitKind::Filler => "filler",
            UnitKind::Frame => "frame",
            UnitKind::Request => "request",
        }
    }
}

/// A content unit of a case: starts with one whitespace separator, ends with non-whitespace.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct UnitSpec {
    pub id: String,
    pub text: String,
    pub kind: UnitKind,
}

/// A unit that stays at a fixed depth of the haystack at every position (competing evidence,
/// distractors): only the moving block and the filler around it change between positions.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct AnchoredSpec {
    pub id: String,
    pub text: String,
    pub kind: UnitKind,
    pub depth: f64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CaseSpec {
    pub case_id: String,
    pub case_digest: String,
    /// Rendered frame before the context slot (template + instruction), and after it (question,
    /// template tail, generation prompt, answer prefix).
    pub prefix: String,
    pub suffix: String,
    /// The evidence block that moves through the context, in order.
    pub moving: Vec<UnitSpec>,
    #[serde(default)]
    pub anchored: Vec<AnchoredSpec>,
    /// Where this case starts reading the shared filler stream (cases differ, layouts of one case
    /// share it, so a case's haystack is identical at every position).
    #[serde(default)]
    pub filler_offset: usize,
    /// A conversation (issue 25): the rendered frame text between consecutive turns' slots (end
    /// of a turn, the next role's header, its fixed lead), `turns - 1` of them. Empty: one slot.
    #[serde(default)]
    pub turns: Vec<String>,
    /// MRCR exchanges in a conversation (issue 25 item 3): the moving unit whose turn the layout
    /// records as `turn` (the asked needle's reply), instead of the turn the block starts in.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub asked: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PositionSpec {
    pub label: String,
    /// Named depth in [0, 1] of the context region (0: evidence first, 1: evidence last).
    #[serde(default)]
    pub depth: Option<f64>,
    /// Absolute token offset of the evidence start in the final prompt.
    #[serde(default)]
    pub offset: Option<usize>,
    /// A turn of a conversation (1-based, `@turn:K`): the evidence goes to the middle of its slot.
    #[serde(default)]
    pub turn: Option<usize>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct BatchSpec {
    pub assembler_version: String,
    pub template_digest: String,
    pub add_special_tokens: bool,
    pub verification: Verification,
    #[serde(default)]
    pub window: Option<usize>,
    #[serde(default)]
    pub max_output_tokens: usize,
    /// Ordered, seeded filler stream shared by all cases.
    pub filler: Vec<String>,
    /// Short-to-long filler sentences used to close the last gap to an exact token count.
    pub pool: Vec<String>,
    /// sha256 over filler then pool (`digest::sha256_fields`), when the caller already has it.
    #[serde(default)]
    pub filler_digest: Option<String>,
    pub cases: Vec<CaseSpec>,
    pub lengths: Vec<usize>,
    pub positions: Vec<PositionSpec>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Span {
    /// The placed unit's id (`evidence_id` in layouts.parquet; both names are accepted).
    #[serde(alias = "evidence_id")]
    pub unit_id: String,
    pub kind: UnitKind,
    pub token_start: usize,
    pub token_end: usize,
    pub char_start: usize,
    pub char_end: usize,
    pub sha256: String,
}

/// Where one turn's content (its slot, without the template's separators) sits in the final prompt.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct TurnSpan {
    /// 1-based; roles alternate user, assistant, …, and the last turn (the question's) is a user turn.
    pub turn: usize,
    pub token_start: usize,
    pub token_end: usize,
    pub char_start: usize,
    pub char_end: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    Ok,
    Refused,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Layout {
    pub layout_id: String,
    pub case_id: String,
    pub target_tokens: usize,
    pub position: String,
    pub status: Status,
    /// Machine code of a refusal (`length_below_fixed_parts`, `window_too_small`, …).
    pub reason_code: Option<String>,
    /// Human sentence: what failed and the fix.
    pub reason: Option<String>,
    pub total_tokens: usize,
    pub token_ids: Vec<u32>,
    pub text: String,
    pub add_special_tokens: bool,
    pub spans: Vec<Span>,
    pub requested_offset: Option<usize>,
    pub actual_offset: Option<usize>,
    pub snap_tokens: i64,
    pub region_start: usize,
    pub region_end: usize,
    pub verification: Verification,
    /// Why a fast layout fell back to full verification, if it did.
    pub verification_note: Option<String>,
    /// In a conversation: the turn the moving block starts in, and every turn's content span.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub turn: Option<usize>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub turn_spans: Vec<TurnSpan>,
}
