//! The DESIGN §10 layout targets at 128K, each beside its baselines from the same run:
//! `cargo run --release -p depthgate-core --example layout_targets [-- --secs S] [-- --length N]`.
//!
//! For GPT-2 and Llama-3 (the tokenizers, frame, needle and filler of `benches/layout.rs`, shared by
//! path) it prints, measured in this process one after the other:
//!
//! * `raw encode`: one `encode` of the depth-0.5 prompt (the floor every verified layout pays in
//!   full mode), timed before and after the depthgate rows to show how the load moved;
//! * `depthgate fast` in three shapes: the benchmark batch (1 case × 5 depths per call), the
//!   product chunk (`layouts.py` sends 8 cases × 5 depths per call, cases 97 filler units apart),
//!   and the product chunk on a freshly loaded tokenizer (cold segment and seam caches: what the
//!   first chunk of a `depthgate build` pays);
//! * `depthgate full` (1 case × 5 depths), as time per layout ÷ one raw encode (target ≤ 1.2);
//! * `RULER-style` and `NoLiMa-style` (`benches/layout.rs`), the published builders.
//!
//! Token-exactness is checked outside the timing: every layout built above is re-encoded in full
//! (`verify_layout`: ids == encode(text), length, spans on the final offsets, span hashes), and the
//! number of violations is printed (must be 0).
#![allow(clippy::print_stdout)]

mod common;

#[path = "../benches/layout.rs"]
#[allow(dead_code, unused_imports)]
mod bench;

use std::time::{Duration, Instant};

use bench::methods::*;
use depthgate_core::spec::BatchSpec;
use depthgate_core::{
    presend_check_batch, Layout, PresendRow, SendContract, Status, TargetTokenizer, Verification,
};

/// Runs per timing at the most.
const MAX_RUNS: u32 = 10_000;

fn time_it<T>(min_time: Duration, f: impl FnMut() -> T) -> (f64, T) {
    common::time_it(min_time, MAX_RUNS, f)
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "?".into())
}

/// The product's chunk: `cases` cases (same frame and needle, ids differing) whose filler offsets
/// are 97 units apart, as `layouts.py` assigns them, with the filler sized for that many cases.
fn chunk_spec(fix: &Fixture, length: usize, cases: usize, mode: Verification) -> BatchSpec {
    let mut spec = depthgate_spec(fix, length, mode);
    let stride = 97;
    let span = stride * cases % 4096 + stride;
    let n = (length / 4 + span + 64).min(fix.filler.len());
    spec.filler = fix.filler[..n].to_vec();
    spec.filler_digest = Some(depthgate_core::layout::filler_digest(
        &spec.filler,
        &spec.pool,
    ));
    let case = spec.cases[0].clone();
    spec.cases = (0..cases)
        .map(|i| {
            let mut c = case.clone();
            c.case_id = format!("{}-{i}", case.case_id);
            c.filler_offset = (i * stride) % 4096;
            c
        })
        .collect();
    spec
}

/// Re-encode every ok layout in full; returns (ok layouts, layouts built in fast mode, violations).
fn verify_all(tok: &TargetTokenizer, layouts: &[Layout]) -> (usize, usize, usize) {
    let mut bad = 0;
    for l in layouts.iter().filter(|l| l.status == Status::Ok) {
        let v = l.reverify(tok).expect("encode");
        if !v.is_empty() {
            eprintln!("{} {}: {v:?}", l.case_id, l.position);
            bad += 1;
        }
    }
    let ok = layouts.iter().filter(|l| l.status == Status::Ok).count();
    let fast = layouts
        .iter()
        .filter(|l| l.status == Status::Ok && l.verification == Verification::Fast)
        .count();
    (ok, fast, bad)
}

/// `--cold-loop N`: N product chunks, each on a freshly loaded tokenizer (for `perf record`); prints
/// the seconds of each chunk (tokenizer load excluded).
fn cold_loop(fix: &Fixture, length: usize, n: usize) {
    let spec = chunk_spec(fix, length, 8, Verification::Fast);
    for family in FAMILIES {
        let mut secs = Vec::new();
        for _ in 0..n {
            let tok = tokenizer(family);
            let t0 = Instant::now();
            std::hint::black_box(depthgate(&tok, &spec));
            secs.push(t0.elapsed().as_secs_f64());
        }
        secs.sort_by(f64::total_cmp);
        println!(
            "{family}: cold product chunk (40 layouts) median {:.1} ms, min {:.1} ms over {n}",
            secs[n / 2] * 1e3,
            secs[0] * 1e3
        );
    }
}

/// `--presend N`: the pre-send checks (DESIGN §10: ≥ 10⁴ layouts/s) on N layouts of 4K tokens
/// (copies of the 5 depths of the benchmark case, one evidence span each), in one batch call and one
/// call per layout, beside a raw encode of one of the prompts and a plain copy of the ids and text
/// (the memory floor).
fn presend(fix: &Fixture, n: usize, min_time: Duration) {
    let length = 4096;
    println!(
        "presend: {n} layouts of {length} tokens, {} CPU(s), load average at start {}",
        std::thread::available_parallelism().map_or(0, usize::from),
        loadavg()
    );
    println!();
    println!("| tokenizer | what | layouts/s | µs / layout | note |");
    println!("|---|---|---:|---:|---|");
    for &family in FAMILIES {
        let tok = tokenizer(family);
        let built = depthgate(&tok, &depthgate_spec(fix, length, Verification::Fast));
        // Distinct copies, so the checks read n prompts from memory, not 5 from the cache.
        let owned: Vec<Layout> = (0..n).map(|i| built[i % built.len()].clone()).collect();
        let layouts: Vec<&Layout> = owned.iter().collect();
        let contract = SendContract::for_tokenizer(&tok, length, Some(8192), 16, "raw", "");
        let rows: Vec<PresendRow<'_>> = layouts.iter().map(|l| l.presend_row("raw", "")).collect();
        let (batch_secs, reports) = time_it(min_time, || presend_check_batch(&rows, &contract));
        let bad = reports.iter().filter(|v| !v.is_empty()).count();
        let (single_secs, _) = time_it(min_time, || {
            layouts
                .iter()
                .map(|l| l.presend_check("raw", "", &contract).ok)
                .filter(|ok| *ok)
                .count()
        });
        let (copy_secs, _) = time_it(min_time, || {
            layouts
                .iter()
                .map(|l| (l.token_ids.clone(), l.text.clone()))
                .map(|(a, b)| a.len() + b.len())
                .sum::<usize>()
        });
        let (raw_secs, _) = time_it(min_time, || raw_encode(&tok, &layouts[0].text));
        let row = |what: &str, secs: f64, note: &str| {
            println!(
                "| {family} | {what} | {:.0} | {:.1} | {note} |",
                n as f64 / secs,
                secs / n as f64 * 1e6
            );
        };
        row(
            "presend_check_batch (one call, rayon)",
            batch_secs,
            &format!("{bad} with violations"),
        );
        row(
            "presend_check, one call per layout, one core",
            single_secs,
            "",
        );
        row(
            "copy of every layout's ids and text (memory floor)",
            copy_secs,
            "",
        );
        println!(
            "| {family} | raw encode of one 4K prompt | {:.0} | {:.1} | what a full re-encode costs |",
            1.0 / raw_secs,
            raw_secs * 1e6
        );
    }
    println!();
    println!("- load average at end {}", loadavg());
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let arg = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .map(|v| v.parse::<f64>().expect("number"))
    };
    let min_time = Duration::from_secs_f64(arg("--secs").unwrap_or(2.0));
    let length = arg("--length").map(|l| l as usize).unwrap_or(131_072);
    let fix = fixture();
    if let Some(n) = arg("--cold-loop") {
        return cold_loop(&fix, length, n as usize);
    }
    if let Some(n) = arg("--presend") {
        return presend(&fix, n as usize, min_time);
    }
    println!(
        "layout_targets: length {length}, {} CPU(s), load average at start {}",
        std::thread::available_parallelism().map_or(0, usize::from),
        loadavg()
    );
    println!();
    println!("| tokenizer | method | per call | layouts/s | time / layout ÷ raw encode | note |");
    println!("|---|---|---:|---:|---:|---|");
    let mut checks = Vec::new();
    let mut verdicts = Vec::new();
    for &family in FAMILIES {
        let tok = tokenizer(family);
        let bench_fast = depthgate_spec(&fix, length, Verification::Fast);
        let bench_full = depthgate_spec(&fix, length, Verification::Full);
        let chunk_fast = chunk_spec(&fix, length, 8, Verification::Fast);
        let per_call = |spec: &BatchSpec| spec.cases.len() * spec.positions.len();
        let mut built: Vec<Layout> = Vec::new();

        // Cold: a fresh tokenizer, the product chunk, once.
        let cold_tok = tokenizer(family);
        let t0 = Instant::now();
        let cold = depthgate(&cold_tok, &chunk_fast);
        let cold_secs = t0.elapsed().as_secs_f64();
        drop(cold_tok);

        let (fast_secs, fast) = time_it(min_time, || depthgate(&tok, &bench_fast));
        let text = fast[DEPTHS.len() / 2].text.clone();
        let (raw_before, _) = time_it(min_time, || raw_encode(&tok, &text));
        let (chunk_secs, chunk) = time_it(min_time, || depthgate(&tok, &chunk_fast));
        let (full_secs, full) = time_it(min_time, || depthgate(&tok, &bench_full));
        let (raw_after, _) = time_it(min_time, || raw_encode(&tok, &text));
        let raw = (raw_before + raw_after) / 2.0;
        let targets = Targets::new(&tok, length);
        let (ruler_secs, _) = time_it(Duration::ZERO, || {
            let mut calls = Calls::default();
            ruler_batch(&tok, &fix.filler, length, DEPTHS, &mut calls)
        });
        let nolima = NolimaCache::new(&tok, &fix.filler);
        let (nolima_secs, _) = time_it(min_time, || nolima.batch(&tok, &targets, DEPTHS));

        let row = |method: &str, n: usize, secs: f64, note: &str| {
            let per_layout = secs / n as f64;
            println!(
                "| {family} | {method} | {n} | {:.1} | {:.3} | {note} |",
                1.0 / per_layout,
                per_layout / raw
            );
            1.0 / per_layout
        };
        println!(
            "| {family} | raw encode of the depth-0.5 prompt (floor) | 1 | {:.2} | 1.000 | {:.1} ms before, {:.1} ms after the depthgate rows |",
            1.0 / raw,
            raw_before * 1e3,
            raw_after * 1e3
        );
        let fast_rate = row(
            "depthgate fast, benchmark batch (1 case × 5 depths)",
            per_call(&bench_fast),
            fast_secs,
            "warm caches",
        );
        let chunk_rate = row(
            "depthgate fast, product chunk (8 cases × 5 depths)",
            per_call(&chunk_fast),
            chunk_secs,
            "warm caches",
        );
        let cold_rate = row(
            "depthgate fast, product chunk, cold tokenizer",
            per_call(&chunk_fast),
            cold_secs,
            "first call: segments and seams encoded",
        );
        let full_ratio = full_secs / per_call(&bench_full) as f64 / raw;
        row(
            "depthgate full (1 case × 5 depths)",
            per_call(&bench_full),
            full_secs,
            "target ≤ 1.2 × raw encode",
        );
        row(
            "RULER-style (1 case × 5 depths)",
            DEPTHS.len(),
            ruler_secs,
            "one timed run",
        );
        row(
            "NoLiMa-style (1 case × 5 depths)",
            DEPTHS.len(),
            nolima_secs,
            "haystack encoded once beforehand, not counted; no verification",
        );
        built.extend(fast);
        built.extend(chunk);
        built.extend(cold);
        built.extend(full);
        checks.push((family, verify_all(&tok, &built)));
        verdicts.push((family, fast_rate, chunk_rate, cold_rate, full_ratio));
    }
    println!();
    for (family, (ok, fast, bad)) in &checks {
        println!(
            "- {family}: {ok} layouts re-encoded in full after timing ({fast} built in fast mode): {bad} violation(s)"
        );
    }
    for (family, bench, chunk, cold, full) in &verdicts {
        let mark = |ok: bool| if ok { "✓" } else { "✗" };
        println!(
            "- {family}: fast ≥ 200 layouts/s at {length}: benchmark batch {bench:.0} {}, product chunk {chunk:.0} {}, cold chunk {cold:.0} {}; full {full:.2} × raw encode {}",
            mark(*bench >= 200.0),
            mark(*chunk >= 200.0),
            mark(*cold >= 200.0),
            mark(*full <= 1.2)
        );
    }
    println!("- load average at end {}", loadavg());
}
