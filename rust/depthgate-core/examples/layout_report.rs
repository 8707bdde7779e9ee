//! The layout benchmark's report: `cargo run --release -p depthgate-core --example layout_report`.
//!
//! Runs every method of `benches/layout.rs` (shared by path) once per (tokenizer, length) after a
//! warm-up run (short runs are repeated until about a second has passed and averaged), then
//! prints a Markdown table with what criterion does not give: full-prompt encodes per layout,
//! tokens encoded per layout, mean |total − target| and mean |evidence offset − target offset|,
//! plus the two targets of DESIGN.md §10 (full ≤ 1.2 × one raw encode; fast ≥ 200 layouts/s at
//! 128K). `--profile` adds where a depthgate batch spends its time; `--loop <family> <length>
//! <fast|full> <batches>` only builds depthgate batches, for `perf record`.
#![allow(clippy::print_stdout)]

mod common;

#[path = "../benches/layout.rs"]
#[allow(dead_code, unused_imports)]
mod bench;

use std::time::{Duration, Instant};

use bench::methods::*;
use depthgate_core::{BatchSpec, Layout, Status, TargetTokenizer, Verification};
use rayon::prelude::*;

/// Runs per timing at the most.
const MAX_RUNS: u32 = 50;

fn time_it<T>(min_time: Duration, f: impl FnMut() -> T) -> (f64, T) {
    common::time_it(min_time, MAX_RUNS, f)
}

struct Row {
    method: &'static str,
    family: &'static str,
    length: usize,
    per_second: f64,
    full_encodes: f64,
    /// Tokens passed through the tokenizer per layout, in units of the target length.
    encoded: f64,
    total_err: f64,
    offset_err: f64,
    note: String,
}

fn mean(xs: impl Iterator<Item = f64>) -> f64 {
    let (s, n) = xs.fold((0.0, 0usize), |(s, n), x| (s + x, n + 1));
    if n == 0 {
        f64::NAN
    } else {
        s / n as f64
    }
}

/// Tokens the engine encodes per batch besides the final prompts: every filler and pool unit.
fn segment_tokens(tok: &TargetTokenizer, units: &[String]) -> usize {
    units
        .par_iter()
        .map(|u| tok.encode_ids(u, false).expect("encode").len())
        .sum()
}

fn depthgate_row(
    method: &'static str,
    family: &'static str,
    length: usize,
    secs: f64,
    layouts: &[Layout],
    segment_tokens: usize,
) -> Row {
    let ok: Vec<&Layout> = layouts.iter().filter(|l| l.status == Status::Ok).collect();
    let full = layouts
        .iter()
        .filter(|l| l.status == Status::Ok && l.verification == Verification::Full)
        .count();
    let fallbacks = layouts
        .iter()
        .filter(|l| l.verification_note.is_some())
        .count();
    let n = layouts.len() as f64;
    let mut note = String::new();
    if ok.len() != layouts.len() {
        note = format!("{} refused", layouts.len() - ok.len());
    }
    if fallbacks > 0 && method == "depthgate fast" {
        note = format!("{fallbacks} fell back to full");
    }
    Row {
        method,
        family,
        length,
        per_second: n / secs,
        full_encodes: full as f64 / n,
        encoded: (segment_tokens as f64 / n + full as f64 * length as f64 / n) / length as f64,
        total_err: mean(
            ok.iter()
                .map(|l| (l.total_tokens as f64 - l.target_tokens as f64).abs()),
        ),
        offset_err: mean(ok.iter().map(|l| l.snap_tokens.unsigned_abs() as f64)),
        note,
    }
}

/// `--loop <family> <length> <fast|full> <batches>`: only build depthgate batches, for `perf record`.
fn loop_batches(args: &[String]) {
    let [family, length, mode, n] = args else {
        panic!("usage: --loop <family> <length> <fast|full> <batches>");
    };
    let mode = if mode == "full" {
        Verification::Full
    } else {
        Verification::Fast
    };
    let spec = depthgate_spec(&fixture(), length.parse().expect("length"), mode);
    let tok = tokenizer(family);
    for _ in 0..n.parse::<usize>().expect("batches") {
        std::hint::black_box(depthgate(&tok, &spec));
    }
}

/// Boundaries the engine tries per layout (each one a full encode in full mode), replayed outside
/// the timing from the finished layouts: the haystack is recovered from the text, boundaries are
/// ordered by distance to the requested offset as `layout.rs::place` orders them, and each is
/// accepted as `place` accepts it (exact length, evidence span on token edges, canonical ids).
fn boundary_tries(tok: &TargetTokenizer, spec: &BatchSpec, layouts: &[Layout]) -> f64 {
    let Some(first) = layouts.iter().find(|l| l.status == Status::Ok) else {
        return f64::NAN;
    };
    let body = &first.text[PREFIX.len()..first.text.len() - SUFFIX.len()];
    let hay = body.replacen(NEEDLE, "", 1);
    let mut units: Vec<&str> = Vec::new();
    let mut at = 0;
    for u in &spec.filler {
        if !hay[at..].starts_with(u.as_str()) {
            break;
        }
        units.push(u);
        at += u.len();
    }
    let mut pool: Vec<&String> = spec.pool.iter().collect();
    pool.sort_by_key(|p| std::cmp::Reverse(p.len()));
    while at < hay.len() {
        let p = pool
            .iter()
            .find(|p| hay[at..].starts_with(p.as_str()))
            .expect("haystack = filler units + pool closers");
        units.push(p);
        at += p.len();
    }
    let starts: Vec<usize> = std::iter::once(0)
        .chain(units.iter().scan(0, |acc, u| {
            *acc += u.len();
            Some(*acc)
        }))
        .collect();
    let enc = tok
        .inner()
        .encode(format!("{PREFIX}{hay}").as_str(), ADD_SPECIAL)
        .expect("encode");
    let ends: Vec<usize> = enc.get_offsets().iter().map(|o| o.1).collect();
    let bounds: Vec<i64> = starts
        .iter()
        .map(|s| ends.partition_point(|&e| e <= PREFIX.len() + s) as i64)
        .collect();
    let anchored = tok
        .inner()
        .encode(format!("x{NEEDLE}").as_str(), false)
        .expect("encode");
    let canonical: Vec<u32> = anchored
        .get_ids()
        .iter()
        .zip(anchored.get_offsets())
        .filter(|(_, o)| o.1 > 1)
        .map(|(i, _)| *i)
        .collect();
    let head = if ADD_SPECIAL {
        tok.special_head.len()
    } else {
        0
    };
    let mut tries = 0usize;
    for layout in layouts.iter().filter(|l| l.status == Status::Ok) {
        let requested = layout.requested_offset.expect("requested") as i64;
        let mut order: Vec<usize> = (0..bounds.len()).collect();
        order.sort_by_key(|&k| ((bounds[k] - requested).abs(), k));
        for &k in order.iter().take(8) {
            tries += 1;
            let text = format!(
                "{PREFIX}{}{NEEDLE}{}{SUFFIX}",
                &hay[..starts[k]],
                &hay[starts[k]..]
            );
            let e = tok
                .inner()
                .encode(text.as_str(), ADD_SPECIAL)
                .expect("encode");
            let (nb, ne) = (
                PREFIX.len() + starts[k],
                PREFIX.len() + starts[k] + NEEDLE.len(),
            );
            let o = &e.get_offsets()[head..];
            let ts = head + o.partition_point(|&(_, e)| e <= nb);
            let te = head + o.partition_point(|&(s, _)| s < ne);
            let o = e.get_offsets();
            let clean = ts < te && o[ts].0 >= nb && o[te - 1].1 <= ne;
            if e.get_ids().len() == layout.target_tokens
                && clean
                && e.get_ids()[ts..te] == canonical[..]
            {
                break;
            }
        }
    }
    tries as f64 / layouts.len() as f64
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if let Some(i) = args.iter().position(|a| a == "--loop") {
        return loop_batches(&args[i + 1..]);
    }
    let profile = args.iter().any(|a| a == "--profile");
    let min_time = Duration::from_secs(1);
    let fix = fixture();
    let mut rows: Vec<Row> = Vec::new();
    let mut ratios: Vec<(&str, usize, f64, f64, f64)> = Vec::new();
    let mut fast_128k: Vec<(&str, f64)> = Vec::new();
    let mut profiles: Vec<String> = Vec::new();
    for &family in FAMILIES {
        let tok = tokenizer(family);
        let t0 = Instant::now();
        let nolima = NolimaCache::new(&tok, &fix.filler);
        let nolima_cache_secs = t0.elapsed().as_secs_f64();
        for &length in LENGTHS {
            eprintln!("{family} {length}");
            let layouts = DEPTHS.len() as f64;
            let fast_spec = depthgate_spec(&fix, length, Verification::Fast);
            let full_spec = depthgate_spec(&fix, length, Verification::Full);
            let seg_tokens =
                segment_tokens(&tok, &fast_spec.filler) + segment_tokens(&tok, &fast_spec.pool);

            let (fast_secs, fast) = time_it(min_time, || depthgate(&tok, &fast_spec));
            rows.push(depthgate_row(
                "depthgate fast",
                family,
                length,
                fast_secs,
                &fast,
                seg_tokens,
            ));
            let (full_secs, full) = time_it(min_time, || depthgate(&tok, &full_spec));
            let mut row = depthgate_row(
                "depthgate full",
                family,
                length,
                full_secs,
                &full,
                seg_tokens,
            );
            // Every boundary tried is one full encode in full mode (a splice in fast mode).
            let tries = boundary_tries(&tok, &full_spec, &full);
            let verified_in_full = row.full_encodes;
            row.encoded += verified_in_full * (tries - 1.0);
            row.full_encodes = verified_in_full * tries;
            rows.push(row);
            if let Some(fast_row) = rows.iter_mut().rev().nth(1) {
                if tries > 1.0 {
                    fast_row.note = format!("{tries:.1} boundary splices / layout");
                }
            }

            let text = &fast[DEPTHS.len() / 2].text;
            let (raw_secs, raw_total) = time_it(min_time, || raw_encode(&tok, text));
            rows.push(Row {
                method: "raw encode (floor)",
                family,
                length,
                per_second: 1.0 / raw_secs,
                full_encodes: 1.0,
                encoded: raw_total as f64 / length as f64,
                total_err: (raw_total as f64 - length as f64).abs(),
                offset_err: f64::NAN,
                note: "encodes/s of the depth-0.5 prompt".into(),
            });
            ratios.push((
                family,
                length,
                full_secs / layouts / raw_secs,
                fast_secs / layouts / raw_secs,
                raw_secs,
            ));
            if length == 131072 {
                fast_128k.push((family, layouts / fast_secs));
            }

            let targets = Targets::new(&tok, length);
            let mut calls = Calls::default();
            let (ruler_secs, ruler) = time_it(min_time, || {
                calls = Calls::default();
                ruler_batch(&tok, &fix.filler, length, DEPTHS, &mut calls)
            });
            rows.push(Row {
                method: "RULER-style",
                family,
                length,
                per_second: layouts / ruler_secs,
                full_encodes: calls.full_encodes as f64 / layouts,
                encoded: calls.encoded_tokens as f64 / layouts / length as f64,
                total_err: mean(
                    ruler
                        .iter()
                        .map(|b| (b.total.expect("encoded") as f64 - length as f64).abs()),
                ),
                offset_err: mean(ruler.iter().map(|b| {
                    (b.needle_token.expect("encoded") as f64 - targets.offset(b.depth) as f64).abs()
                })),
                note: format!(
                    "{} probes/batch; totals ≤ target",
                    calls.full_encodes - DEPTHS.len()
                ),
            });

            let (nolima_secs, built) = time_it(min_time, || nolima.batch(&tok, &targets, DEPTHS));
            let measured: Vec<(f64, usize, usize)> = built
                .iter()
                .map(|b| {
                    let (total, at) = measure(&tok, b);
                    (b.depth, total, at)
                })
                .collect();
            rows.push(Row {
                method: "NoLiMa-style",
                family,
                length,
                per_second: layouts / nolima_secs,
                full_encodes: 0.0,
                encoded: 0.0,
                total_err: mean(
                    measured
                        .iter()
                        .map(|&(_, t, _)| (t as f64 - length as f64).abs()),
                ),
                offset_err: mean(
                    measured
                        .iter()
                        .map(|&(d, _, at)| (at as f64 - targets.offset(d) as f64).abs()),
                ),
                note: format!(
                    "cache: 1 encode of {} tokens once ({nolima_cache_secs:.2} s), not counted",
                    nolima.ids.len()
                ),
            });

            if profile {
                profiles.push(profile_batch(&tok, &fix, family, length));
            }
        }
    }

    println!("| method | tokenizer | length | layouts/s | full encodes / layout | tokens encoded / layout (× length) | mean \\|total − target\\| | mean \\|offset − target\\| | note |");
    println!("|---|---|---:|---:|---:|---:|---:|---:|---|");
    for r in &rows {
        let fmt = |x: f64, p: usize| {
            if x.is_nan() {
                "–".to_string()
            } else {
                format!("{x:.p$}")
            }
        };
        println!(
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            r.method,
            r.family,
            r.length,
            fmt(r.per_second, if r.per_second < 10.0 { 2 } else { 1 }),
            fmt(r.full_encodes, 1),
            fmt(r.encoded, 2),
            fmt(r.total_err, 1),
            fmt(r.offset_err, 1),
            r.note
        );
    }
    println!();
    println!("| tokenizer | length | one raw encode (ms) | full-mode time / layout ÷ raw encode (target ≤ 1.2) | fast-mode time / layout ÷ raw encode |");
    println!("|---|---:|---:|---:|---:|");
    for (family, length, full, fast, raw) in &ratios {
        println!(
            "| {family} | {length} | {:.1} | {full:.2} {} | {fast:.2} |",
            raw * 1e3,
            if *full <= 1.2 { "✓" } else { "✗" }
        );
    }
    println!();
    for (family, per_s) in &fast_128k {
        println!(
            "- fast verification at 128K, {family}: {per_s:.1} layouts/s (target ≥ 200) {}",
            if *per_s >= 200.0 { "✓" } else { "✗" }
        );
    }
    if profile {
        println!();
        println!("| tokenizer | length | batch (5 layouts) | filler units passed | segment encode, all units passed | segment encode, units used | rest of the batch (fast) |");
        println!("|---|---:|---:|---:|---:|---:|---:|");
        for p in &profiles {
            println!("{p}");
        }
    }
}

/// Where a fast depthgate batch spends its time: step 1 of the engine (encode every distinct
/// filler/pool unit, in parallel) emulated on the units the product passes and on the units a
/// haystack of this length actually uses, against the whole batch.
fn profile_batch(tok: &TargetTokenizer, fix: &Fixture, family: &str, length: usize) -> String {
    let spec = depthgate_spec(fix, length, Verification::Fast);
    let encode_all = |units: &[String]| {
        units
            .par_iter()
            .map(|u| tok.encode_piece(u, false).expect("encode").ids.len())
            .sum::<usize>()
    };
    let min_time = Duration::from_millis(500);
    let (batch_secs, layouts) = time_it(min_time, || depthgate(tok, &spec));
    // Units the haystack used: filler units up to the last one present in the longest layout.
    let text = &layouts
        .iter()
        .map(|l| &l.text)
        .max_by_key(|t| t.len())
        .expect("layouts");
    let mut used = 0;
    let mut at = 0;
    for (i, unit) in spec.filler.iter().enumerate() {
        match text[at..].find(unit.as_str()) {
            Some(p) => {
                at += p + unit.len();
                used = i + 1;
            }
            None => break,
        }
    }
    let (all_secs, _) = time_it(min_time, || {
        encode_all(&spec.filler) + encode_all(&spec.pool)
    });
    let (used_secs, _) = time_it(min_time, || {
        encode_all(&spec.filler[..used]) + encode_all(&spec.pool)
    });
    format!(
        "| {family} | {length} | {:.1} ms | {} ({} used) | {:.1} ms ({:.0} %) | {:.1} ms | {:.1} ms |",
        batch_secs * 1e3,
        spec.filler.len(),
        used,
        all_secs * 1e3,
        100.0 * all_secs / batch_secs,
        used_secs * 1e3,
        (batch_secs - all_secs) * 1e3,
    )
}
