//! The real tokenizer files the tests use, shipped in the repository under `tests/fixtures/tokenizers`
//! (see its NOTICE.md): every `tokenizer.json` is stored as `tokenizer.json.gz`.
//!
//! Used by the integration tests (`mod common;`) and by the core's unit tests (`#[path]`); it names
//! no crate item, so callers build the tokenizer with `TargetTokenizer::from_bytes`.

use std::io::Read;
use std::path::PathBuf;

/// `<repo>/tests/fixtures/tokenizers`.
pub fn fixtures_dir() -> PathBuf {
    // rust/depthgate-core -> the repository root
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tokenizers")
}

/// The decompressed `tokenizer.json` of a family folder, and a label (the stored path) for errors.
/// A missing or unreadable fixture panics with the path and the fix: it never skips.
pub fn tokenizer_json(family: &str) -> (Vec<u8>, String) {
    let path = fixtures_dir().join(family).join("tokenizer.json.gz");
    let fail = |detail: String| -> ! {
        panic!(
            "tokenizer fixture {}: {detail}; restore it from git (`git checkout -- tests/fixtures/tokenizers`) \
             or regenerate it with `python3 scripts/vendor_tokenizer_fixtures.py --shared <shared/tokenizers>`",
            path.display()
        )
    };
    let file = std::fs::File::open(&path).unwrap_or_else(|e| fail(e.to_string()));
    let mut json = Vec::new();
    flate2::read::GzDecoder::new(file)
        .read_to_end(&mut json)
        .unwrap_or_else(|e| fail(format!("not valid gzip ({e})")));
    (json, path.display().to_string())
}
