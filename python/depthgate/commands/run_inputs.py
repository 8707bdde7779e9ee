"""The inputs of ``depthgate run``, loaded and refused before anything is built or sent: the matrix (its
A/A form), its suite, and the plan combinations that cannot run."""

from __future__ import annotations

from pathlib import Path

from depthgate.exceptions import InputError, SpecError
from depthgate.spec.cases import Suite
from depthgate.spec.loading import load_matrix
from depthgate.spec.matrix import Matrix

__all__ = ["matrix_and_suite"]


def matrix_and_suite(
    matrix_path: Path,
    *,
    aa: bool,
    controls: bool,
    shard: tuple[int, int] | None,
    after: Path | None = None,
) -> tuple[Matrix, Suite]:
    """The matrix (its A/A form with ``aa``) and its suite; a plan whose primary metric needs the
    controls is refused when they are skipped, ``--after`` outside a sharded sequential run (issue #26),
    and a sequential plan whose gate plan (built with the suite's cases) refuses it — the bootstrap size
    at the smallest level a look tests (issue #36, F1) — all before anything is built or sent."""
    from depthgate.commands.sequential import refuse_sequential, run_gate_plan
    from depthgate.spec.suites import resolve_suite

    matrix = load_matrix(matrix_path)
    if aa:
        from depthgate.commands.plan import aa_matrix

        matrix = aa_matrix(matrix)
    suite = resolve_suite(matrix.suite, base_dir=matrix_path.parent)
    if matrix.plan.primary_metric == "control_normalised" and not controls:
        raise InputError(
            "the plan's primary metric control_normalised needs the evidence-only controls, and "
            "--no-controls skips them",
            file=str(matrix_path),
            field="plan.primary_metric",
            fix='drop --no-controls, or pre-register primary_metric = "pass"',
        )
    refuse_sequential(matrix.plan, shard=shard, file=str(matrix_path), after=after)
    if matrix.plan.stop_rule == "sequential":
        try:
            run_gate_plan(matrix, suite)
        except SpecError as exc:
            raise InputError(
                exc.message, file=str(matrix_path), field=f"plan.{exc.field}", fix=exc.fix
            ) from None
    return matrix, suite
