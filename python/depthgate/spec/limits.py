"""The largest sizes depthgate builds, checked where each size is read (issue #21, item 1).

An absurd size (``lengths = [10**12]``, ``--cases 1000000000``, 10,000 endpoints) used to start the work
and hang with growing memory; every count and length is now refused before any work, exit 20 in well
under a second, naming the field, the limit and the fix. The limits come from what can be built:

* **a length** (tokens of one prompt): every layout is built and verified in memory. The filler
  stream alone is ``length / 4`` text units, and a built layout holds its ids (u32, 4 bytes a token),
  its text (≈ 4–5 bytes a token) and the encoding's offsets (16 bytes a token) while it is verified:
  ≈ 40 bytes a token, ≈ 5 MB for one 128K layout (measured: 466 MB for 50 such layouts built
  together). :data:`MAX_LENGTH` = 2**24 tokens (16.8M, ≈ 0.7 GB for a single layout) is above every
  served window we know (10M) and still buildable on a small CI box; beyond it one layout alone could
  not be held.
* **a window or an output budget**: token counts travel as unsigned 32-bit integers (ids and counts
  in records, the servers' windows), so :data:`MAX_TOKENS` = 2**32 − 1.
* **counts** (cases, seeds, positions, spacings, endpoints) and their product, the layouts one arm
  builds (:data:`MAX_LAYOUTS`): a bound on the work a single command starts; a larger run is split
  into shards (``--shard i/N``) or several suites.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = [
    "MAX_BOOTSTRAP_RESAMPLES",
    "MAX_CASES",
    "MAX_ENDPOINTS",
    "MAX_GENERATED_CASES",
    "MAX_LAYOUTS",
    "MAX_LENGTH",
    "MAX_POSITIONS",
    "MAX_SEEDS",
    "MAX_TIMEOUT_S",
    "MAX_TOKENS",
    "length_problem",
    "summarise_urls",
]

#: Longest prompt, in tokens, a layout may be built at (see the module docstring).
MAX_LENGTH = 1 << 24
#: Largest window or output budget in tokens (u32, as ids and counts travel).
MAX_TOKENS = (1 << 32) - 1
#: Most cases in one suite (imported or a suite file).
MAX_CASES = 100_000
#: Most distinct cases the built-in generator makes from one seed (measured: every language, with and
#: without conflict cases, stops at 4,296 for seeds 0, 1 and 12345; asking for more took 20–30 s to fail).
MAX_GENERATED_CASES = 4_296
#: Most seeds (repeats) per layout.
MAX_SEEDS = 1_000
#: Most positions (depths and offsets, before spacings) in one build.
MAX_POSITIONS = 1_000
#: Most endpoints (replicas) per arm.
MAX_ENDPOINTS = 256
#: Most layouts one arm builds (cases × lengths × positions × spacings).
MAX_LAYOUTS = 1_000_000
#: Most bootstrap resamples (B) a plan may ask for. What B costs in memory: the gate's percentile bootstrap
#: (``depthgate.judge.bounds.percentile``) keeps the B resample means of a slice (8 bytes each) and
#: ``np.quantile`` partitions a copy (8 more), 16 bytes a resample, 1.6 MB a slice at this limit; the
#: report's effective-length interval (``depthgate.judge.science.length``) holds a B × cases matrix of
#: multinomial weights (int64, then float64: 16 bytes a resample and case), 1.6 MB a case here — 1.6 GB
#: for 1,000 cases, within a small CI box. 10**12 asked for 14.6 TiB and died after every request was sent.
#: 100,000 still confirms a regression among ~700 slices at alpha 0.05 under BY (the plan's B rule).
MAX_BOOTSTRAP_RESAMPLES = 100_000
#: Longest HTTP timeout in seconds (a day): sockets take no larger timeout (OverflowError past ≈ 2**63 ns).
MAX_TIMEOUT_S = 86_400.0


def length_problem(length: int) -> str | None:
    """Why ``length`` tokens cannot be built, or None when it can (the lower bound is the caller's)."""
    if length > MAX_LENGTH:
        return (
            f"length {length} is over the limit of {MAX_LENGTH} tokens (one layout must fit in memory "
            "while it is built and verified)"
        )
    return None


def count_problems(count: int, limit: int, noun: str, empty_fix: str, over_fix: str) -> list[tuple[str, str]]:
    """[(problem, fix)] when a list the spec reads (``count`` ``noun``) is empty or over ``limit``, else
    []: one wording for every bounded list (issue #21: sizes are bounded before work starts)."""
    if count == 0:
        return [("must not be empty", empty_fix)]
    if count > limit:
        return [(f"lists {count} {noun}, over the limit of {limit}", over_fix)]
    return []


def summarise_urls(urls: Sequence[str], *, first: int = 3) -> str:
    """A list of endpoints for a message: the first few and how many in all (never the whole list)."""
    shown = ", ".join(urls[:first])
    if len(urls) <= first:
        return shown
    return f"{shown} … ({len(urls)} endpoints)"
