"""Which tests the fast tier leaves out (read by tests/conftest.py, checked by tests/test_structure.py)."""

from __future__ import annotations

# The fast tier (`bash scripts/test.sh --fast`) runs every test that needs no model, no server process,
# no Ray and no CLI run end to end; these are the rest, marked `full_only` here so the test files stay
# free of tier bookkeeping. A test marked smoke_model/slow_model/bench/vllm is outside the tier anyway.
# Measured (2026-12-03, 6 other jobs on the same 2 cores): the tier is 523 of the 1,349 test-seconds
# outside smoke_model; the biggest items left out are Ray (92 s), the CLI folder (≈ 400 s) and
# mypy.stubtest (61 s).
FULL_ONLY_FOLDERS = ("cli", "vllm", "benchmarks")
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
    "layout/test_spacing.py::test_run_gates_each_spacing_as_its_own_slice",  # a CLI run
    "judge/test_conflict.py::test_a_conflict_suite_runs_through_the_cli",  # CLI runs
    "judge/test_sparse_size.py::test_sparse_broken_loss_at_many_cases_holds_alpha",  # 4,000 slices (20 s)
}
