"""Which tests the fast tier leaves out (read by tests/conftest.py, checked by tests/test_structure.py)."""

from __future__ import annotations

# The fast tier (`bash scripts/test.sh --fast`) runs every test that needs no model, no server process,
# no Ray and no CLI run end to end; these are the rest, marked `full_only` here so the test files stay
# free of tier bookkeeping. A test marked smoke_model/slow_model/bench/vllm is outside the tier anyway.
# Measured (2026-12-03, 6 other jobs on the same 2 cores): the tier is 523 of the 1,349 test-seconds
# outside smoke_model; the biggest items left out are Ray (92 s), the CLI folder (≈ 400 s) and
# mypy.stubtest (61 s).
FULL_ONLY_FOLDERS = ("cli", "vllm", "benchmarks")
# Also outside the tier by their marks: cli/test_conversation_run.py's two runs of a conversation matrix
# on the embedded model (issue 25: 149–171 s and 102–107 s on 2 shared cores; 39 s and 38 s on 2 idle
# cores): both `smoke_model`, so CI runs them.
FULL_ONLY_MODULES = {
    "run/test_ray_engine.py",  # Ray
    "run/test_shards.py",  # three CLI runs + merge
    "run/test_serving_path.py",  # gateways in front of a real llama.cpp server
    "run/test_endpoints.py",  # replicas killed mid-run
    "run/test_parity.py",  # real /tokenize routes
    "run/test_runner.py",  # SIGKILL of a child run, then resume
    "run/test_controls.py",  # the embedded model
    "run/test_backend_llamacpp.py",  # the embedded model
    "layout/test_stub.py",  # mypy.stubtest of the extension (a minute)
}
FULL_ONLY_TESTS = {
    # CLI runs end to end (measured 2026-12-03 under load: 19.5 s, 18.3 s), and a verdict compared across
    # fresh interpreter processes (12.1 s): together ≈ 20 s of the tier's wall time on 2 cores.
    "layout/test_model_files.py::test_cli_builds_and_checks_from_a_hub_reference",
    "judge/test_base_score.py::test_run_builds_the_short_lengths_beside_the_grid_and_never_gates_them",
    "judge/test_stats.py::test_verdict_identical_across_processes",
    "layout/test_spacing.py::test_run_gates_each_spacing_as_its_own_slice",  # a CLI run
    "judge/test_conflict.py::test_a_conflict_suite_runs_through_the_cli",  # CLI runs
    "judge/test_sparse_size.py::test_sparse_broken_loss_at_many_cases_holds_alpha",  # 4,000 slices (20 s)
}
