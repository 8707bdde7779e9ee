"""The jobs of a run and their order: one (arm, layout, seed) request each, checked for pairing (both arms
cover the same slices), shuffled deterministically from the run id with the arms interleaved, and
assigned to a shard by content (:func:`shard_of`)."""

from __future__ import annotations

import hashlib
import random
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from depthgate.exceptions import InputError

Key = tuple[str, str, int]


@dataclass(frozen=True)
class Job:
    """One (arm, layout, seed) request. ``layout`` is the caller's row (never copied, never logged)."""

    arm: str
    seed: int
    layout: Mapping[str, Any]

    @property
    def layout_id(self) -> str:
        return str(self.layout["layout_id"])

    @property
    def key(self) -> Key:
        return (self.arm, self.layout_id, self.seed)

    @property
    def slice_key(self) -> tuple[str, int, str]:
        return (str(self.layout["case_id"]), int(self.layout["target_tokens"]), layout_position(self.layout))

    def __repr__(self) -> str:
        return f"Job(arm={self.arm!r}, layout_id={self.layout_id!r}, seed={self.seed})"


def layout_position(layout: Mapping[str, Any]) -> str:
    value = layout["position"]
    return value if isinstance(value, str) else repr(float(value)) if isinstance(value, float) else str(value)


def order_seed(run_id: str) -> int:
    """The 64-bit seed of the job order, derived from the run id (stable across processes)."""
    return int.from_bytes(hashlib.sha256(f"depthgate/order/{run_id}".encode()).digest()[:8], "big")


_REQUIRED = ("layout_id", "case_id", "target_tokens", "position", "status")


class LayoutSource(Protocol):
    """Where a job's token ids and text come from when its row does not carry them
    (:class:`depthgate.run.store.LayoutStore`: read from disk one layout at a time)."""

    def ids(self, layout_id: str) -> Any: ...

    def text(self, layout_id: str) -> str: ...


def local_tokens(layout: Mapping[str, Any]) -> int | None:
    """The prompt's local token count: its ids if the row holds them, else its ``total_tokens``."""
    ids = layout.get("token_ids")
    if ids is not None:
        return len(ids)
    total = layout.get("total_tokens")
    return int(total) if total is not None else None


def check_jobs(
    jobs: Iterable[tuple[str, Mapping[str, Any]]], arms: Sequence[str], *, streamed: bool = False
) -> list[tuple[str, Mapping[str, Any]]]:
    rows = list(jobs)
    seen: dict[tuple[str, str], int] = {}
    slices: dict[str, dict[tuple[str, int, str], str]] = defaultdict(dict)
    for index, (arm, layout) in enumerate(rows):
        if arm not in arms:
            raise InputError(
                f"job {index} is for arm {arm!r}, which has no backend (arms: {list(arms)!r})",
                field=f"jobs[{index}]",
                fix="pass a backend for every arm",
            )
        missing = [k for k in _REQUIRED if k not in layout]
        if "token_ids" not in layout and not streamed:
            missing.append("token_ids")
        if missing:
            raise InputError(
                f"layout row {index} lacks {missing!r}",
                field=f"jobs[{index}]",
                fix="pass layout rows from the layout builder",
            )
        layout_id = str(layout["layout_id"])
        if (arm, layout_id) in seen:
            raise InputError(
                f"layout {layout_id!r} appears twice for arm {arm!r} "
                f"(jobs {seen[arm, layout_id]} and {index})",
                field=f"jobs[{index}]",
                fix="pass each layout once per arm; seeds are added by the runner",
            )
        seen[arm, layout_id] = index
        slice_key = (str(layout["case_id"]), int(layout["target_tokens"]), layout_position(layout))
        if slice_key in slices[arm]:
            raise InputError(
                f"arm {arm!r} has two layouts for case {slice_key[0]!r} at length {slice_key[1]} and "
                f"position {slice_key[2]!r} ({slices[arm][slice_key]!r} and {layout_id!r})",
                field=f"jobs[{index}]",
                fix="pass one layout per (case, length, position) and arm",
            )
        slices[arm][slice_key] = layout_id
    present = [arm for arm in arms if slices.get(arm)]
    for arm in present[1:]:
        first = present[0]
        only_first = set(slices[first]) - set(slices[arm])
        only_other = set(slices[arm]) - set(slices[first])
        if only_first or only_other:
            example = sorted(only_first or only_other)[0]
            raise InputError(
                f"arms {first!r} and {arm!r} are not paired: {len(only_first)} slice(s) only in {first!r}, "
                f"{len(only_other)} only in {arm!r} (e.g. case {example[0]!r}, length {example[1]}, "
                f"position {example[2]!r})",
                field="jobs",
                fix="build every (case, length, position) for both arms; a refused layout is still passed",
            )
    return rows


def shard_of(pair: tuple[str, int, str, int], count: int) -> int:
    """The 0-based shard of a pair (case, length, position, seed) among ``count``: from its content
    only, so both arms of a pair are in the same shard whatever the job order, on every machine."""
    digest = hashlib.sha256("\x1f".join(str(part) for part in pair).encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % count


def interleaved_order(
    jobs: Iterable[tuple[str, Mapping[str, Any]]], seeds: Sequence[int], run_id: str, order: str = "shuffled"
) -> list[Job]:
    """All (arm, layout, seed) jobs in the run's randomized, interleaved, deterministic order.

    Pairs (the arms' jobs of one case × length × position × seed) are shuffled, and the arms inside each
    pair, with :func:`order_seed`; the result depends only on the run id and the set of jobs. With
    ``order = "haystack"`` the pairs of one haystack (case × length × seed) stay together: the haystacks
    are shuffled, then the pairs inside each, then the arms inside each pair — still random (no position
    is always sent first) and interleaved, but a server's prefix cache sees each haystack's requests
    back to back.
    """
    units: dict[tuple[str, int, str, int], list[Job]] = defaultdict(list)
    for arm, layout in jobs:
        for seed in seeds:
            job = Job(arm=arm, seed=int(seed), layout=layout)
            units[(*job.slice_key, job.seed)].append(job)
    rng = random.Random(order_seed(run_id))
    keys = sorted(units)
    rng.shuffle(keys)
    if order == "haystack":
        groups: dict[tuple[str, int, int], list[tuple[str, int, str, int]]] = defaultdict(list)
        for key in keys:  # already shuffled: the pairs inside a haystack keep that random order
            groups[(key[0], key[1], key[3])].append(key)
        haystacks = sorted(groups)
        rng.shuffle(haystacks)
        keys = [key for haystack in haystacks for key in groups[haystack]]
    result: list[Job] = []
    for key in keys:
        unit = sorted(units[key], key=lambda j: (j.arm, j.layout_id))
        rng.shuffle(unit)
        result.extend(unit)
    return result
