"""``depthgate merge DIR_1 … DIR_N --out DIR``: join the shard folders of one run, then gate the whole.

A run too large for one machine is split with ``depthgate run MATRIX --shard i/N --out DIR_i`` (the
HELM / OpenCompass / NeMo-Skills pattern on Slurm job arrays and Kubernetes Indexed Jobs,
docs/scale.md): every shard freezes the same manifest and builds the same layouts, and runs only the
pairs of its part (``depthgate.run.jobs.shard_of``, by content). Merging refuses, by name:

* folders whose frozen manifests differ (another matrix, plan, case set, system or version);
* a missing shard (``shard 2/3 missing``) or a doubled one (``shard 2/3 twice: A, B``);
* layouts that differ between shards (another build);
* overlaps: a job recorded in two shards, or in a shard it does not belong to;
* gaps: a planned job with no final record in any shard (rerun that shard: it resumes).

The controls and the full-length canaries are split the same way (by content) and joined beside the
matrix's records, each in its own folder, with the same overlap check.

The merged folder is an ordinary run folder: ``depthgate gate DIR`` gives the verdict an unsharded run
would give (same slices, bounds and digests).
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import polars as pl

from depthgate.commands.belonging import check_records_belong
from depthgate.commands.outputs import check_output, undo_on_error
from depthgate.commands.pipeline import (
    ARMS,
    CANARIES_DIR,
    CONTROLS_DIR,
    CONTROLS_FILE,
    MANIFEST,
    SHARD_FILE,
    SUITE_FILE,
)
from depthgate.commands.planned import planned_jobs, shard_jobs
from depthgate.exceptions import InputError, PlanChangedError
from depthgate.run.canary import CANARIES_FILE
from depthgate.run.jobs import shard_of
from depthgate.run.records import (
    FINAL_STATUSES,
    RECORD_KEY,
    RECORDS_DIR,
    RECORDS_FILE,
    read_records,
)
from depthgate.spec.files import ReadFailures, read_json, read_parquet, require_file

__all__ = ["MergeSummary", "merge_runs"]

#: The side folders joined beside the matrix's records: (records folder, the per-arm layouts file).
_SIDE = ((CONTROLS_DIR, CONTROLS_FILE), (CANARIES_DIR, CANARIES_FILE))

# Manifest fields that may differ between shards of one run (each shard froze its own copy). The
# determinism block describes the machine a shard ran on (threads per engine); both arms of every pair
# ran in the same shard, so shards on machines of different sizes still pair like with like.
_PER_SHARD_FIELDS = frozenset({"created_at", "determinism"})


@dataclass(frozen=True)
class MergeSummary:
    """What :func:`merge_runs` joined."""

    out_dir: Path
    shards: int
    records: int
    control_records: int
    canary_records: int = 0
    #: A sequential run's round: (look the shards sent, looks planned); None for any other plan.
    look: tuple[int, int] | None = None

    def line(self) -> str:
        head = (
            f"{self.out_dir}: {self.shards} shards merged, {self.records} records, "
            f"{self.control_records} control records, {self.canary_records} canary records"
        )
        if self.look is None:
            return f"{head}; next: depthgate gate {self.out_dir}"
        return (
            f"{head}, sequential look {self.look[0]} of {self.look[1]}; next round: depthgate run MATRIX "
            f"--shard i/N --out DIR_i --after {self.out_dir} on every shard, then merge into a new folder "
            f"(a round sends nothing once every slice is decided); after the last round: depthgate gate "
            f"{self.out_dir}"
        )


def _read_json(path: Path, what: str) -> dict[str, Any]:
    message, fix = (
        f"no {path.name}: not a shard folder of `depthgate run --shard i/N`",
        f"pass the --out folders of every shard ({what})",
    )
    require_file(path, InputError, message, fix=fix, file=str(path.parent))
    failures = ReadFailures(
        InputError,
        missing=(f"no {path.name}", "rerun that shard"),
        unreadable=(f"cannot read {path.name} ({{strerror}})", "rerun that shard"),
        not_json=(f"{path.name} is not valid JSON ({{msg}} at line {{lineno}})", "rerun that shard"),
    )
    data = read_json(path, failures)
    if not isinstance(data, dict):
        raise InputError(f"{path.name} is not a JSON object", file=str(path), fix="rerun that shard")
    return data


def _shard_spec(folder: Path) -> dict[str, int]:
    """A shard folder's ``shard.json`` as ``{index, count}`` integers with 1 <= index <= count."""
    path = folder / SHARD_FILE
    spec = _read_json(path, "shard.json")
    index, count = spec.get("index"), spec.get("count")
    ints = all(isinstance(v, int) and not isinstance(v, bool) for v in (index, count))
    if not ints or not 1 <= index <= count:  # type: ignore[operator]
        raise InputError(
            f"shard.json says index {index!r} of count {count!r}, not a shard i/N with 1 <= i <= N",
            file=str(path),
            field="index",
            fix="restore the shard.json written by `depthgate run --shard i/N`, or rerun that shard",
        )
    return {"index": int(index), "count": int(count)}  # type: ignore[arg-type]


def _check_shards(dirs: Sequence[Path]) -> int:
    specs = [_shard_spec(d) for d in dirs]
    counts = {int(s.get("count", 0)) for s in specs}
    if len(counts) != 1:
        raise InputError(
            "the folders split the run differently ("
            + ", ".join(f"{spec.get('index')}/{spec.get('count')}" for spec in specs)
            + ")",
            field="--shard",
            fix="merge the folders of one split: --shard 1/N … N/N",
        )
    count = counts.pop()
    seen: dict[int, Path] = {}
    for spec, folder in zip(specs, dirs, strict=True):
        index = int(spec.get("index", 0))
        if index in seen:
            runs = [_read_json(d / MANIFEST, "manifest.json").get("run_id") for d in (seen[index], folder)]
            if runs[0] != runs[1]:  # not one shard twice: the same shard of two different runs
                raise PlanChangedError(
                    f"{seen[index]} and {folder} hold different runs ({runs[0]} and {runs[1]}), each its "
                    f"shard {index}/{count}",
                    file=str(folder / MANIFEST),
                    field="run_id",
                    fix="merge only the shards of one run (same matrix, plan, suite, systems and versions)",
                )
            raise InputError(
                f"shard {index}/{count} twice: {seen[index]} and {folder}",
                field="--shard",
                fix="pass each shard folder once",
            )
        seen[index] = folder
    missing = [i for i in range(1, count + 1) if i not in seen]
    if missing:
        raise InputError(
            f"shard {', '.join(f'{i}/{count}' for i in missing)} missing",
            field="--shard",
            fix="run the missing shard (depthgate run MATRIX --shard i/N --out DIR_i) and pass its folder",
        )
    return count


def _check_manifests(dirs: Sequence[Path]) -> dict[str, Any]:
    manifests = [_read_json(d / MANIFEST, "manifest.json") for d in dirs]
    first = {k: v for k, v in manifests[0].items() if k not in _PER_SHARD_FIELDS}
    for folder, manifest in zip(dirs[1:], manifests[1:], strict=True):
        other = {k: v for k, v in manifest.items() if k not in _PER_SHARD_FIELDS}
        if other != first:
            fields = sorted(k for k in set(first) | set(other) if first.get(k) != other.get(k))
            raise PlanChangedError(
                f"the frozen manifest differs from {dirs[0]}'s in {', '.join(fields)}",
                file=str(folder / MANIFEST),
                field=fields[0],
                fix="merge only the shards of one run (same matrix, plan, suite, systems and versions)",
            )
    return manifests[0]


def _layout_ids(folder: Path, name: str) -> list[str]:
    path = folder / name
    if not path.is_file():
        raise InputError(f"no {name}", file=str(folder), fix="rerun that shard: it builds its layouts first")
    frame = read_parquet(path, error=InputError, what=name, fix="rerun that shard", columns=["layout_id"])
    return sorted(frame["layout_id"].to_list())


def _check_layouts(dirs: Sequence[Path]) -> None:
    for arm in ARMS:
        for name in (f"{arm}/layouts.parquet", *(f"{arm}/{file}" for _, file in _SIDE)):
            if not name.endswith("/layouts.parquet") and not (dirs[0] / name).is_file():
                continue
            reference = _layout_ids(dirs[0], name)
            for folder in dirs[1:]:
                if _layout_ids(folder, name) != reference:
                    raise PlanChangedError(
                        f"{name} differs from {dirs[0]}'s (another build)",
                        file=str(folder / name),
                        fix="rebuild every shard from the same matrix and inputs",
                    )


def _final(records: pl.DataFrame) -> pl.DataFrame:
    return records.filter(pl.col("status").is_in(list(FINAL_STATUSES)))


def _check_overlaps(parts: Sequence[tuple[int, Path, pl.DataFrame]], count: int) -> None:
    owner: dict[tuple[Any, ...], Path] = {}
    for index, folder, records in parts:
        for row in _final(records).select(*RECORD_KEY, "case_id", "target_tokens", "position").iter_rows():
            key = tuple(row[:3])
            if key in owner:
                raise InputError(
                    f"job {key} is recorded in two shards: {owner[key]} and {folder}",
                    file=str(folder),
                    fix="merge each shard once; a job belongs to exactly one shard",
                )
            owner[key] = folder
            pair = (str(row[3]), int(row[4]), str(row[5]), int(row[2]))
            if shard_of(pair, count) != index - 1:
                raise InputError(
                    f"job {key} belongs to shard {shard_of(pair, count) + 1}/{count}, not {index}/{count}",
                    file=str(folder),
                    fix="the folder was not written by `depthgate run --shard` for its shard",
                )


def _sequential_round(dirs: Sequence[Path], manifest: dict[str, Any]) -> dict[str, Any] | None:
    """The round the shards of a ``stop_rule = "sequential"`` run sent (their ``shard-look.json``, the
    same in every shard: :mod:`depthgate.commands.sequential_shards`); None for any other plan."""
    if (manifest.get("plan") or {}).get("stop_rule") != "sequential":
        return None
    from depthgate.commands.sequential_shards import SHARD_LOOK_FILE, read_shard_look

    specs = [read_shard_look(d) for d in dirs]
    for folder, spec in zip(dirs[1:], specs[1:], strict=True):
        if spec != specs[0]:
            raise InputError(
                f"{SHARD_LOOK_FILE} says look {spec.get('look')} from other decisions than {dirs[0]}'s (look "
                f"{specs[0].get('look')}): the shards ran different rounds of the sequential run",
                file=str(folder / SHARD_LOOK_FILE),
                field="--after",
                fix="run every shard of a round with the same --after folder (none in the first round), "
                "then merge them",
            )
    return specs[0]


def _check_gaps(
    dirs: Sequence[Path],
    parts: Sequence[tuple[int, Path, pl.DataFrame]],
    count: int,
    seeds: list[int],
    sequential: dict[str, Any] | None,
) -> None:
    planned = planned_jobs(dirs[0], seeds)
    if sequential is not None:  # only what the round's looks scheduled (the rest is not sent by design)
        from depthgate.commands.sequential_shards import scheduled_jobs

        planned = scheduled_jobs(planned, sequential)
    for index, folder, records in parts:
        want = shard_jobs(planned, (index, count)).select("arm", "layout_id", "seed")
        have = _final(records).select("arm", "layout_id", pl.col("seed").cast(pl.Int64))
        gap = want.join(have, on=["arm", "layout_id", "seed"], how="anti")
        if gap.height:
            raise InputError(
                f"shard {index}/{count} has {gap.height} of {want.height} planned jobs without a final "
                "record",
                file=str(folder),
                fix=f"rerun that shard (depthgate run MATRIX --shard {index}/{count} --out {folder}): "
                "it resumes",
            )


def merge_runs(shard_dirs: Sequence[str | Path], out_dir: str | Path) -> MergeSummary:
    """Check the shard folders of one run and join them into ``out_dir`` (a new folder)."""
    dirs = [Path(d) for d in shard_dirs]
    if not dirs:
        raise InputError("no shard folders given", field="DIR", fix="pass every shard's --out folder")
    out = check_output(out_dir, "empty_dir")
    count = _check_shards(dirs)
    manifest = _check_manifests(dirs)
    _check_layouts(dirs)
    indices = [_shard_spec(d)["index"] for d in dirs]
    parts = [(i, d, read_records(d)) for i, d in zip(indices, dirs, strict=True)]
    arm_layouts = {arm: _layout_ids(dirs[0], f"{arm}/layouts.parquet") for arm in ARMS}
    for _, folder, records in parts:
        check_records_belong(
            records,
            run_id=str(manifest.get("run_id")),
            manifest_digest=manifest.get("manifest_digest"),
            layout_ids=arm_layouts,
            folder=folder,
            fix="merge only folders written by `depthgate run --shard` for this run; rerun that shard into "
            "a new folder",
        )
    _check_overlaps(parts, count)
    sequential = _sequential_round(dirs, manifest)
    _check_gaps(dirs, parts, count, [int(s) for s in manifest["seeds"]], sequential)
    side_parts = {
        side_dir: [(i, d, read_records(d / side_dir)) for i, d in zip(indices, dirs, strict=True)]
        for side_dir, _ in _SIDE
    }
    for side in side_parts.values():
        _check_overlaps(side, count)

    with undo_on_error(out):
        out.mkdir(parents=True, exist_ok=True)
        first = dirs[0]
        shutil.copy2(first / MANIFEST, out / MANIFEST)
        if (first / SUITE_FILE).is_file():
            shutil.copy2(first / SUITE_FILE, out / SUITE_FILE)
        for arm in ARMS:
            (out / arm).mkdir(exist_ok=True)
            for name in ("layouts.parquet", *(file for _, file in _SIDE)):
                if (first / arm / name).is_file():
                    shutil.copy2(first / arm / name, out / arm / name)
        records = pl.concat([p[2] for p in parts], how="vertical")
        _write_records(out, records)
        joined = {name: pl.concat([p[2] for p in side], how="vertical") for name, side in side_parts.items()}
        for side_dir, side_records in joined.items():
            if side_records.height:
                _write_records(out / side_dir, side_records)
        if sequential is not None:  # which round this merge is: `gate` says so before the last one
            from depthgate.commands.sequential_shards import write_round

            write_round(out, sequential, count)
    return MergeSummary(
        out_dir=out,
        shards=count,
        records=records.height,
        control_records=joined[CONTROLS_DIR].height,
        canary_records=joined[CANARIES_DIR].height,
        look=None if sequential is None else (int(sequential["look"]), int(sequential["of"])),
    )


def _write_records(folder: Path, records: pl.DataFrame) -> None:
    (folder / RECORDS_DIR).mkdir(parents=True, exist_ok=True)
    tmp = folder / (RECORDS_FILE + ".tmp")
    records.sort(list(RECORD_KEY)).write_parquet(tmp)
    tmp.replace(folder / RECORDS_FILE)
