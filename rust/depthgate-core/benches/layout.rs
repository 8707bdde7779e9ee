//! Layout-builder benchmark (opt-in, not a pass/fail test): `cargo bench -p depthgate-core --bench layout`.
//!
//! For the GPT-2 and Llama-3 tokenizers at 4K, 16K, 64K and 128K tokens it times, on the same
//! tokenizer, frame, needle and filler (`tests/fixtures/filler_en.json`, written by
//! `scripts/make_fixtures.py`):
//!
//! * `depthgate_fast` / `depthgate_full`: [`build_layouts`] on one batch of 1 case × 1 length ×
//!   5 depths (0, .25, .5, .75, 1), with the filler stream sized as the Python front sizes it, so
//!   the segment cache is built and used per batch exactly as in the product;
//! * `raw_encode`: one `tokenizer.encode` of the final prompt of the depth-0.5 layout (the floor);
//! * `ruler_style`: RULER `niah.py`'s published algorithm, re-implemented here (probe, binary
//!   search over the number of filler units with one full tokenization per probe, needle inserted
//!   at the depth by unit index, one full tokenization per final prompt, shrink on overflow);
//! * `nolima_style`: NoLiMa `BookHaystack`'s approach (the haystack encoded once per tokenizer and
//!   cached as tokens; per layout a token window is decoded and the needle inserted at the depth
//!   snapped back to the previous sentence end; no verification).
//!
//! Throughput is per layout (`Throughput::Elements`). The numbers criterion does not give (full
//! encodes per layout, length and offset accuracy, the ratio to one raw encode) come from
//! `cargo run --release -p depthgate-core --example layout_report`, which shares [`methods`].

use criterion::{
    criterion_group, criterion_main, BenchmarkId, Criterion, SamplingMode, Throughput,
};
use std::hint::black_box;
use std::time::Duration;

use depthgate_core::{build_layouts, Verification};

/// The methods under comparison, shared with `examples/layout_report.rs` (included by path).
#[allow(dead_code)]
pub mod methods {
    use std::path::PathBuf;

    use depthgate_core::spec::{BatchSpec, CaseSpec, PositionSpec, UnitKind, UnitSpec};
    use depthgate_core::{Layout, TargetTokenizer, Verification};

    pub const FAMILIES: &[&str] = &["gpt2", "llama3-from-gguf"];
    pub const LENGTHS: &[usize] = &[4096, 16384, 65536, 131072];
    pub const DEPTHS: &[f64] = &[0.0, 0.25, 0.5, 0.75, 1.0];

    /// The frame and needle every method uses (a raw completion prompt, no chat template).
    pub const PREFIX: &str = "Company Operations Handbook (excerpt)";
    pub const SUFFIX: &str = "\n\nQuestion: What is the current maximum hotel rate in region China?\nAnswer: Under the current travel policy, the maximum hotel rate for business travel in region China is";
    pub const NEEDLE: &str = " Travel policy version 4 (2025), which replaces version 3: the maximum hotel rate for business travel in region China is 245 USD per night.";
    /// Special tokens are added as the tokenizer's post-processor says (Llama-3: BOS; GPT-2: none).
    pub const ADD_SPECIAL: bool = true;

    /// RULER's `incremental` for unit-based haystacks (`noise`/`needle`: 25 units).
    pub const RULER_INCREMENTAL: usize = 25;

    pub struct Fixture {
        pub filler: Vec<String>,
        pub pool: Vec<String>,
    }

    fn repo() -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
    }

    /// `tests/fixtures/filler_en.json` (`filler_units(0, "en", 40000)`, `filler_pool(0, "en", 400)`).
    pub fn fixture() -> Fixture {
        let path = repo().join("tests/fixtures/filler_en.json");
        let bytes = std::fs::read(&path).unwrap_or_else(|e| {
            panic!(
                "{}: {e}; run `.venv/bin/python scripts/make_fixtures.py`",
                path.display()
            )
        });
        let json: serde_json::Value = serde_json::from_slice(&bytes).expect("fixture is JSON");
        let list = |key: &str| -> Vec<String> {
            json[key]
                .as_array()
                .unwrap_or_else(|| panic!("fixture has no {key:?} list"))
                .iter()
                .map(|v| v.as_str().expect("fixture units are strings").to_string())
                .collect()
        };
        Fixture {
            filler: list("filler"),
            pool: list("pool"),
        }
    }

    /// `tests/fixtures/tokenizers/<family>/tokenizer.json.gz`, shipped gzipped (see its NOTICE.md).
    pub fn tokenizer(family: &str) -> TargetTokenizer {
        use std::io::Read;
        let path = repo()
            .join("tests/fixtures/tokenizers")
            .join(family)
            .join("tokenizer.json.gz");
        let mut json = Vec::new();
        std::fs::File::open(&path)
            .and_then(|file| flate2::read::GzDecoder::new(file).read_to_end(&mut json))
            .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        TargetTokenizer::from_bytes(&json, &path.display().to_string())
            .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
    }

    /// Filler units the Python front passes for one case (`layouts.py::_filler_for`, 1 case).
    pub fn product_filler_count(length: usize) -> usize {
        let stride = 97;
        let span = stride % 4096 + stride;
        length / 4 + span + 64
    }

    /// One depthgate batch: 1 case × 1 length × 5 depths, filler sized as in the product.
    pub fn depthgate_spec(fix: &Fixture, length: usize, verification: Verification) -> BatchSpec {
        let n = product_filler_count(length).min(fix.filler.len());
        BatchSpec {
            assembler_version: depthgate_core::ASSEMBLER_VERSION.into(),
            template_digest: "raw".into(),
            add_special_tokens: ADD_SPECIAL,
            verification,
            window: None,
            max_output_tokens: 0,
            filler: fix.filler[..n].to_vec(),
            pool: fix.pool.clone(),
            // As the Python front does: the filler digest is computed once per build, not per batch.
            filler_digest: Some(depthgate_core::layout::filler_digest(
                &fix.filler[..n],
                &fix.pool,
            )),
            cases: vec![CaseSpec {
                case_id: "hotel-china".into(),
                case_digest: "bench".into(),
                prefix: PREFIX.into(),
                suffix: SUFFIX.into(),
                moving: vec![UnitSpec {
                    id: "needle".into(),
                    text: NEEDLE.into(),
                    kind: UnitKind::Evidence,
                }],
                anchored: Vec::new(),
                filler_offset: 0,
                turns: Vec::new(),
                asked: None,
            }],
            lengths: vec![length],
            positions: DEPTHS
                .iter()
                .map(|d| PositionSpec {
                    label: d.to_string(),
                    depth: Some(*d),
                    offset: None,
                    turn: None,
                })
                .collect(),
        }
    }

    pub fn depthgate(tok: &TargetTokenizer, spec: &BatchSpec) -> Vec<Layout> {
        depthgate_core::build_layouts(tok, spec).expect("depthgate batch builds")
    }

    /// One raw `encode` (byte offsets, as the full verification uses); returns the token count.
    pub fn raw_encode(tok: &TargetTokenizer, text: &str) -> usize {
        tok.inner()
            .encode(text, ADD_SPECIAL)
            .expect("encode")
            .get_ids()
            .len()
    }

    /// Where the needle should start and how long the prompt should be, in the same terms for the
    /// baselines: the haystack gets everything the frame, needle and special tokens leave of
    /// `length`, and the needle starts `round(depth × haystack)` tokens into it.
    pub struct Targets {
        pub head: usize,
        pub prefix: usize,
        pub haystack: usize,
    }

    impl Targets {
        pub fn new(tok: &TargetTokenizer, length: usize) -> Self {
            let count = |t: &str| tok.encode_ids(t, false).expect("encode").len();
            let (head, tail) = if ADD_SPECIAL {
                (tok.special_head.len(), tok.special_tail.len())
            } else {
                (0, 0)
            };
            let prefix = count(PREFIX);
            let fixed = head + tail + prefix + count(NEEDLE) + count(SUFFIX);
            Targets {
                head,
                prefix,
                haystack: length.saturating_sub(fixed),
            }
        }

        pub fn offset(&self, depth: f64) -> usize {
            self.head + self.prefix + (depth * self.haystack as f64).round() as usize
        }
    }

    /// A baseline layout: its text, and what is known about it without extra work.
    pub struct Built {
        pub depth: f64,
        pub text: String,
        /// Byte offset of the needle in `text`.
        pub needle_byte: usize,
        /// Token count and needle token offset, when the method's own final encode gave them.
        pub total: Option<usize>,
        pub needle_token: Option<usize>,
    }

    /// Counters a baseline batch reports (its own tokenizer calls).
    #[derive(Default, Clone, Copy)]
    pub struct Calls {
        pub full_encodes: usize,
        pub encoded_tokens: usize,
    }

    fn needle_token(offsets: &[(usize, usize)], needle_byte: usize) -> usize {
        // Special tokens carry (0, 0) and count as "before"; offset-trimming files put the token
        // that holds the needle's leading space at the needle's first letter: still this token.
        offsets.partition_point(|&(_, e)| e <= needle_byte)
    }

    /// Encode a finished text once (outside any timing) and read its total and needle offset.
    pub fn measure(tok: &TargetTokenizer, built: &Built) -> (usize, usize) {
        let enc = tok
            .inner()
            .encode(built.text.as_str(), ADD_SPECIAL)
            .expect("encode");
        (
            enc.get_ids().len(),
            needle_token(enc.get_offsets(), built.needle_byte),
        )
    }

    /// RULER `niah.py` (`generate_samples` / `generate_input_output`), re-implemented for sentence
    /// units: estimate tokens per unit from one probe of `incremental` units, binary-search the
    /// unit count in [incremental, 3 × estimate] with one full tokenization per probe (accept
    /// `tokens ≤ length`), then per sample insert the needle at unit index `int(n × depth)`, encode
    /// the final prompt once and shrink by `incremental` on overflow. No chat template.
    pub fn ruler_batch(
        tok: &TargetTokenizer,
        filler: &[String],
        length: usize,
        depths: &[f64],
        calls: &mut Calls,
    ) -> Vec<Built> {
        let render = |n: usize, depth: f64| -> (String, usize) {
            let n = n.min(filler.len());
            let at = ((n as f64) * depth) as usize;
            let cap = PREFIX.len()
                + SUFFIX.len()
                + NEEDLE.len()
                + filler[..n].iter().map(String::len).sum::<usize>();
            let mut text = String::with_capacity(cap);
            text.push_str(PREFIX);
            for unit in &filler[..at] {
                text.push_str(unit);
            }
            let needle_byte = text.len();
            text.push_str(NEEDLE);
            for unit in &filler[at..n] {
                text.push_str(unit);
            }
            text.push_str(SUFFIX);
            (text, needle_byte)
        };
        let tokenize = |text: &str, calls: &mut Calls| {
            let enc = tok.inner().encode(text, ADD_SPECIAL).expect("encode");
            calls.full_encodes += 1;
            calls.encoded_tokens += enc.get_ids().len();
            enc
        };
        // Calibration: one probe, then binary search (RULER probes with its sample depth; 0.5 here).
        let inc = RULER_INCREMENTAL;
        let probe = tokenize(&render(inc, 0.5).0, calls).get_ids().len();
        let per_unit = probe as f64 / inc as f64;
        let estimated_max = ((length as f64 / per_unit) * 3.0) as usize;
        let (mut lo, mut hi) = (inc, estimated_max.max(inc * 2));
        let mut best = inc;
        while lo <= hi {
            let mid = (lo + hi) / 2;
            let total = tokenize(&render(mid, 0.5).0, calls).get_ids().len();
            if total <= length {
                best = mid;
                lo = mid + 1;
            } else {
                hi = mid - 1;
            }
        }
        depths
            .iter()
            .map(|&depth| {
                let mut n = best;
                loop {
                    let (text, needle_byte) = render(n, depth);
                    let enc = tokenize(&text, calls);
                    if enc.get_ids().len() <= length || n <= inc {
                        let total = enc.get_ids().len();
                        let needle_token = needle_token(enc.get_offsets(), needle_byte);
                        return Built {
                            depth,
                            text,
                            needle_byte,
                            total: Some(total),
                            needle_token: Some(needle_token),
                        };
                    }
                    n -= inc;
                }
            })
            .collect()
    }

    /// NoLiMa `BookHaystack`: the whole haystack encoded once per tokenizer and kept as tokens.
    pub struct NolimaCache {
        pub ids: Vec<u32>,
    }

    impl NolimaCache {
        pub fn new(tok: &TargetTokenizer, filler: &[String]) -> Self {
            let book: String = filler.concat();
            NolimaCache {
                ids: tok.encode_ids(&book, false).expect("encode"),
            }
        }

        /// Per layout: a window of the haystack's token budget from the start of the book, decoded
        /// in two parts at token `round(W × depth)`; the needle goes after the last sentence end
        /// (or newline) of the first part. No verification, no re-encode.
        pub fn batch(
            &self,
            tok: &TargetTokenizer,
            targets: &Targets,
            depths: &[f64],
        ) -> Vec<Built> {
            let w = targets.haystack.min(self.ids.len());
            depths
                .iter()
                .map(|&depth| {
                    let k = ((w as f64) * depth).round() as usize;
                    let pre = tok.inner().decode(&self.ids[..k], false).expect("decode");
                    let post = tok.inner().decode(&self.ids[k..w], false).expect("decode");
                    let cut = sentence_end_before(&pre);
                    let mut text = String::with_capacity(
                        PREFIX.len() + pre.len() + NEEDLE.len() + post.len() + SUFFIX.len(),
                    );
                    text.push_str(PREFIX);
                    text.push_str(&pre[..cut]);
                    let needle_byte = text.len();
                    text.push_str(NEEDLE);
                    text.push_str(&pre[cut..]);
                    text.push_str(&post);
                    text.push_str(SUFFIX);
                    Built {
                        depth,
                        text,
                        needle_byte,
                        total: None,
                        needle_token: None,
                    }
                })
                .collect()
        }
    }

    /// Byte index just after the last sentence end ('.' followed by whitespace or the end of the
    /// text) or newline in `text`; 0 when there is none.
    fn sentence_end_before(text: &str) -> usize {
        let b = text.as_bytes();
        (0..b.len())
            .rev()
            .find(|&i| {
                b[i] == b'\n'
                    || (b[i] == b'.' && b.get(i + 1).is_none_or(|c| c.is_ascii_whitespace()))
            })
            .map_or(0, |i| i + 1)
    }
}

use methods::*;

fn bench_layouts(c: &mut Criterion) {
    let fix = fixture();
    for family in FAMILIES {
        let tok = tokenizer(family);
        let nolima = NolimaCache::new(&tok, &fix.filler);
        for &length in LENGTHS {
            let mut group = c.benchmark_group(format!("layout/{family}"));
            // Two cores and ten minutes for everything: ten flat samples (one iteration each for
            // the slow methods, so criterion's "unable to complete 10 samples" notes are expected).
            group
                .sampling_mode(SamplingMode::Flat)
                .sample_size(10)
                .warm_up_time(Duration::from_millis(300))
                .measurement_time(Duration::from_secs(2));
            let layouts = DEPTHS.len() as u64;

            let fast = depthgate_spec(&fix, length, Verification::Fast);
            let full = depthgate_spec(&fix, length, Verification::Full);
            group.throughput(Throughput::Elements(layouts));
            group.bench_with_input(BenchmarkId::new("depthgate_fast", length), &fast, |b, s| {
                b.iter(|| black_box(build_layouts(&tok, s).expect("builds")))
            });
            group.bench_with_input(BenchmarkId::new("depthgate_full", length), &full, |b, s| {
                b.iter(|| black_box(build_layouts(&tok, s).expect("builds")))
            });

            let mid = build_layouts(&tok, &fast).expect("builds");
            let text = mid[DEPTHS.len() / 2].text.clone();
            group.throughput(Throughput::Elements(1));
            group.bench_with_input(BenchmarkId::new("raw_encode", length), &text, |b, t| {
                b.iter(|| black_box(raw_encode(&tok, t)))
            });

            group.throughput(Throughput::Elements(layouts));
            group.bench_with_input(BenchmarkId::new("ruler_style", length), &length, |b, &l| {
                b.iter(|| {
                    let mut calls = Calls::default();
                    black_box(ruler_batch(&tok, &fix.filler, l, DEPTHS, &mut calls))
                })
            });

            let targets = Targets::new(&tok, length);
            group.bench_with_input(
                BenchmarkId::new("nolima_style", length),
                &targets,
                |b, t| b.iter(|| black_box(nolima.batch(&tok, t, DEPTHS))),
            );
            group.finish();
        }
    }
}

criterion_group!(benches, bench_layouts);
criterion_main!(benches);
