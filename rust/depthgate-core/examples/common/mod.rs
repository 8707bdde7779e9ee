//! What the two layout examples share (`mod common;`): the timing loop.

use std::time::{Duration, Instant};

/// Mean seconds per run: one warm-up, then runs until `min_time` has passed (at least one run, at
/// most `max_runs`).
pub fn time_it<T>(min_time: Duration, max_runs: u32, mut f: impl FnMut() -> T) -> (f64, T) {
    let mut out = f();
    let start = Instant::now();
    let mut runs = 0u32;
    while runs == 0 || (start.elapsed() < min_time && runs < max_runs) {
        out = f();
        runs += 1;
    }
    (start.elapsed().as_secs_f64() / f64::from(runs), out)
}
