"""Tokenizer parity before the first request: the server tokenizes the built prompts itself.

depthgate builds every layout with the arm's tokenizer and proves ``ids == encode(text)`` *for that
tokenizer*. If the server's tokenizer is another one (a stale copy, another revision, a BOS rule the
copy lost), every id sent still reaches the model, and every position is silently wrong; a text arm
is worse, since the server re-tokenizes the text. So before any request the server is asked to
tokenize built prompts with its own tokenizer (vLLM ``/tokenize``, llama.cpp ``/tokenize`` or
llama-cpp-python ``/extras/tokenize``; vLLM offline: the engine's tokenizer): a sample for arms that send
token ids (the ids sent are the ones checked after each request too), **every** prompt for arms that
send text (nothing else checks what the server makes of them). Any difference refuses the run
(:class:`~depthgate.exceptions.TokenizerMismatchError`, exit 22) before anything is sent, naming the
arm, the endpoint, the layout and the first differing position with the ids on both sides.

What is compared:

* **text arms**: the server's ids for the prompt text, special tokens added as the server adds them to
  a text prompt, against the layout's ids, exactly. A BOS the server's tokenizer does not add (measured:
  vLLM 0.32 serving Gemma-3-270M converted from GGUF adds none although its config says
  ``add_bos_token``), or a second BOS when the rendered text already holds one, differ at token 0.
* **token-id arms**: the ids are sent as built, so the server's *text* tokenizer only has to agree on
  the content: its ids without special tokens against depthgate's ``encode(text,
  add_special_tokens=False)`` (a route that always adds them, like llama-cpp-python's, against
  ``encode(text, add_special_tokens=True)``).

Every route the servers have is tried (``/tokenize`` in vLLM's and llama-server's dialects,
``/v1/tokenize``, ``/extras/tokenize``) before the server is said to have none. A call that fails, hangs
or answers garbage (HTTP 5xx, a timeout, HTML, JSON without ``tokens``) is retried
(:data:`ATTEMPTS` tries). What happens when parity still cannot be checked is the arm's
``runtime.tokenizer_parity`` (issue #37, item 1):

* ``"refuse_on_failure"`` (the default): a route that still fails refuses the run (exit 30, nothing
  sent); a server with no tokenize route runs with parity "not checked";
* ``"required"``: that too refuses (exit 22: the served tokenizer cannot be proven);
* ``"best_effort"``: the run goes on with parity "not checked" and the reason.

An endpoint that does not answer at all (connection refused) is left to the run's retries and circuit
breaker, as the probe does, unless parity is ``"required"``. Whatever happened is in the arm's
``tokenizer_parity.json``, on the console, and in verdict.json, summary.md and junit.xml
(:mod:`depthgate.report.parity`); the per-request count and echo checks run either way.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import polars as pl

from depthgate.exceptions import InfraError, TokenizerMismatchError, TransientBackendError
from depthgate.run.backends.base import Backend
from depthgate.spec.limits import summarise_urls

__all__ = [
    "PARITY_FILE",
    "ParityReport",
    "check_parity",
    "refuse_unchecked",
    "sample_rows",
    "summary_lines",
    "verify_arm",
]

PARITY_FILE = "tokenizer_parity.json"
ATTEMPTS = 3
"""Tries per tokenize call before it counts as failed (backoff 0.5 s, then 1 s)."""
BACKOFF_S = 0.5
#: One tokenize call may take this long, whatever the arm's request ``timeout_s`` (300 s by default,
#: sized for generating from a long prompt): a hung route used to hold the run 3 x 300 s before parity
#: could say so. Tokenizing is cheap: Gemma-3's tokenizer encodes 240,001 tokens in 1.24 s on the
#: 2 loaded cores of the test host (2026-12-06), so 30 s leaves > 20x room for the longest prompt.
TOKENIZE_TIMEOUT_S = 30.0
DEFAULT_POLICY = "refuse_on_failure"
SAMPLE_SIZE = 8
"""Prompts checked per endpoint for a token-id arm: one tokenize call each (≈ 10–40 ms for 1–2K tokens on
vLLM CPU, measured 2026-12-03), spread over the layouts' lengths and positions."""


@dataclass(frozen=True)
class ParityReport:
    arm: str
    endpoint: str
    route: str | None
    """The route that answered (``/tokenize`` …), ``None`` when not checked (see ``unreachable``)."""
    checked: int
    scope: str
    """``"sample"`` (token-id arms) or ``"every prompt"`` (text arms)."""
    unreachable: bool = False
    """Not checked because the endpoint did not answer (the run's retries and breaker decide)."""
    status: str = "checked"
    """``checked``, ``no_route`` (every route 404/405, or another dialect), ``failed`` (a route that
    failed, hung or answered garbage on every try) or ``unreachable``."""
    reason: str | None = None
    """Why not checked: the routes tried and their answers, or the last failure."""
    policy: str = DEFAULT_POLICY
    """The arm's ``runtime.tokenizer_parity`` that decided what happened."""

    def outcome(self, *, reason: bool = True) -> str:
        why = f": {self.reason}" if self.reason and reason else ""
        if self.status == "unreachable":
            return f"not checked (unreachable, the run's retries decide{why})"
        if self.status == "no_route":
            return f"not checked (the server has no tokenize route{why})"
        if self.status == "failed":
            done = f"{self.checked} prompt(s) identical, then " if self.checked else ""
            return f"not checked ({done}the tokenize route failed {ATTEMPTS} tries{why})"
        return f"{self.checked} prompt(s) ({self.scope}) tokenized identically by {self.route}"

    def line(self) -> str:
        return f"tokenizer parity: {self.arm} @ {self.endpoint}: {self.outcome()}"


def summary_lines(reports: Sequence[ParityReport]) -> list[str]:
    """One console line per arm and outcome, the endpoints summarised (an arm may list hundreds of
    replicas; ``tokenizer_parity.json`` has every one)."""
    # Grouped by the outcome without its reason (which names each endpoint's own URL); one reason is
    # shown as an example when the endpoints of a group differ only by it.
    groups: dict[tuple[str, str], list[ParityReport]] = {}
    for report in reports:
        groups.setdefault((report.arm, report.outcome(reason=False)), []).append(report)
    lines = []
    for (arm, outcome), members in groups.items():
        endpoints = summarise_urls([m.endpoint for m in members])
        text = members[0].outcome() if len(members) == 1 else outcome
        if len(members) > 1 and members[0].reason:
            text += f" (e.g. {members[0].reason})"
        lines.append(f"tokenizer parity: {arm} @ {endpoints}: {text}")
    return lines


def sample_rows(layouts: pl.DataFrame, k: int = SAMPLE_SIZE) -> pl.DataFrame:
    """Up to ``k`` placed layouts spread over lengths and positions: the first of each (length,
    position) cell in layout-id order, then every other cell's, deterministic for a given build."""
    ok = layouts.filter(pl.col("status") == "ok") if "status" in layouts.columns else layouts
    if ok.height == 0:
        return ok
    ranked = ok.sort("layout_id").with_columns(
        pl.col("layout_id").cum_count().over("target_tokens", "position").alias("_rank")
    )
    return ranked.sort("_rank", "target_tokens", "position", "layout_id").head(k).drop("_rank")


def _targets(backend: Any) -> list[tuple[str, Any]]:
    """(endpoint label, object with ``server_tokenize``) for every endpoint of the arm."""
    replicas = getattr(backend, "replicas", None)
    if replicas is not None:
        return [(str(getattr(r, "base_url", "?")), r) for r in replicas]
    if hasattr(backend, "server_tokenize"):
        label = str(getattr(backend, "base_url", None) or getattr(backend, "name", "engine"))
        return [(label, backend)]
    return []


def _first_difference(ours: Sequence[int], theirs: Sequence[int]) -> int:
    for i, (a, b) in enumerate(zip(ours, theirs, strict=False)):
        if a != b:
            return i
    return min(len(ours), len(theirs))


def _window(ids: Sequence[int], at: int) -> list[int]:
    return [int(t) for t in ids[max(0, at - 3) : at + 4]]


def _rows(frame: pl.DataFrame) -> Iterator[dict[str, Any]]:
    yield from frame.select("layout_id", "text", "token_ids", "add_special_tokens").iter_rows(named=True)


class _Encoder(Protocol):
    def encode(self, text: str, *, add_special_tokens: bool = False) -> Any: ...


def _unreachable(exc: TransientBackendError) -> bool:
    """No server answered at all (connection refused, DNS): the run's retries and breaker decide."""
    return exc.status is None and str(exc.summary).startswith(("unreachable", "all "))


async def _tokenize(target: Any, text: str, specials: bool) -> tuple[list[int], str, bool] | None:
    """``target.server_tokenize`` with :data:`ATTEMPTS` tries for a failure worth retrying (5xx, a
    timeout, a non-JSON or token-less answer); an endpoint that does not answer at all is not retried."""
    limit = min(float(getattr(target, "timeout_s", TOKENIZE_TIMEOUT_S)), TOKENIZE_TIMEOUT_S)
    for attempt in range(1, ATTEMPTS + 1):
        try:
            call = target.server_tokenize(text, add_special_tokens=specials)
            try:
                answer: tuple[list[int], str, bool] | None = await asyncio.wait_for(call, limit)
            except asyncio.TimeoutError:  # not the builtin TimeoutError on Python 3.10
                raise TransientBackendError(
                    f"the tokenize route did not answer within {limit:g} s",
                    summary=f"timeout: tokenize ({limit:g} s)",
                    fix="check the server's load; tokenizing one prompt takes well under a second",
                ) from None
            return answer
        except TransientBackendError as exc:
            if attempt == ATTEMPTS or _unreachable(exc):
                raise
            await asyncio.sleep(BACKOFF_S * 2 ** (attempt - 1))
    raise AssertionError("unreachable")  # pragma: no cover


def _mismatch(
    arm: str,
    label: str,
    route: str,
    row: dict[str, Any],
    ours: list[int],
    theirs: list[int],
    every_prompt: bool,
) -> TokenizerMismatchError:
    at = _first_difference(ours, theirs)
    what = "the prompt as sent" if every_prompt else "the prompt text (without special tokens)"
    return TokenizerMismatchError(
        f"arm {arm!r}: the server at {label} ({route}) tokenizes layout {row['layout_id'][:16]} "
        f"differently from depthgate: {what} first differs at token {at} of {len(ours)} "
        f"(depthgate {_window(ours, at)} vs server {_window(theirs, at)} from position "
        f"{max(0, at - 3)}; the server made {len(theirs)} tokens); nothing was sent",
        field=f"{arm}.tokenizer",
        fix="name the served model's own tokenizer (its folder or hf:ORG/NAME@REV) as the arm's "
        "tokenizer, or serve the model with the tokenizer the layouts were built with"
        + ("; a text arm whose server adds no BOS: send token ids instead" if every_prompt else ""),
    )


async def _check_endpoint(
    arm: str,
    label: str,
    target: Any,
    rows: pl.DataFrame,
    *,
    every_prompt: bool,
    tokenizer: _Encoder,
    policy: str,
) -> ParityReport:
    """One endpoint's :class:`ParityReport` (raises :class:`TokenizerMismatchError` on a difference)."""
    route: str | None = None
    checked = 0
    status, reason = "checked", None
    for row in _rows(rows):
        text = row["text"]
        try:
            # A text arm: what the server does to a text prompt (special tokens added). An id arm:
            # the content only, since the specials are in the ids sent.
            answer = await _tokenize(target, text, every_prompt)
        except TransientBackendError as exc:
            status = "unreachable" if _unreachable(exc) else "failed"
            reason = str(exc.summary)[:300]
            break
        if answer is None:
            status = "no_route"
            reason = "tried " + ", ".join(getattr(target, "tokenize_tried", ()) or ("every route",))
            break
        theirs, route, specials = answer
        if every_prompt:
            ours = [int(t) for t in row["token_ids"]]
        else:
            ours = [int(t) for t in tokenizer.encode(text, add_special_tokens=specials)]
        if theirs != ours:
            raise _mismatch(arm, label, route, row, ours, theirs, every_prompt)
        checked += 1
    scope = "every prompt" if every_prompt else "sample"
    return ParityReport(
        arm=arm,
        endpoint=label,
        route=route if status == "checked" else None,
        checked=checked,
        scope=scope,
        unreachable=status == "unreachable",
        status=status,
        reason=reason,
        policy=policy,
    )


def refuse_unchecked(report: ParityReport) -> None:
    """Refuse the run when ``report``'s arm may not run with it (see the module docstring): exit 22 for
    a server without a tokenize route under ``"required"``, exit 30 for one whose route failed."""
    refuse = (report.status == "failed" and report.policy != "best_effort") or (
        report.status in ("no_route", "unreachable") and report.policy == "required"
    )
    if not refuse:
        return
    where = f"arm {report.arm!r}: tokenizer parity at {report.endpoint}: {report.outcome()}"
    field = f"{report.arm}.runtime.tokenizer_parity"
    if report.status == "no_route":
        raise TokenizerMismatchError(
            f"{where}; tokenizer_parity = 'required', so the served tokenizer cannot be proven and nothing "
            "was sent",
            field=field,
            fix="serve the model from a server with a tokenize route (vLLM, llama-server, "
            "llama-cpp-python), or set tokenizer_parity = 'refuse_on_failure' to run without the check",
        )
    raise InfraError(
        f"{where}; tokenizer_parity = {report.policy!r}, so nothing was sent",
        field=field,
        fix="check the server's tokenize route (its logs; a proxy in front of it) and rerun; to run "
        "without the check, set tokenizer_parity = 'best_effort' in this arm's runtime block",
    )


async def check_parity(
    arm: str,
    backend: Backend,
    rows: pl.DataFrame,
    *,
    every_prompt: bool,
    tokenizer: _Encoder,
    policy: str = DEFAULT_POLICY,
) -> list[ParityReport]:
    """Ask every endpoint of ``backend`` to tokenize ``rows`` (columns ``layout_id``, ``text``,
    ``token_ids``, ``add_special_tokens``) and compare with depthgate's ids (see the module docstring;
    ``every_prompt``: the arm sends text; ``policy``: the arm's ``runtime.tokenizer_parity``). Raises
    :class:`TokenizerMismatchError` on the first difference; what an endpoint that could not be checked
    means is :func:`refuse_unchecked`'s (the caller's) to decide."""
    return [
        await _check_endpoint(
            arm, label, target, rows, every_prompt=every_prompt, tokenizer=tokenizer, policy=policy
        )
        for label, target in _targets(backend)
    ]


def write_reports(reports: Sequence[ParityReport], path: Path) -> None:
    """``RUN/<arm>/tokenizer_parity.json``: what was checked, for the run folder's record."""
    tmp = path.with_name(path.name + ".tmp")
    data = [{**asdict(r), "outcome": r.outcome()} for r in reports]
    tmp.write_text(json.dumps(data, indent=2), encoding="utf-8")
    tmp.replace(path)


def _prompt_rows(layouts: Path, every_prompt: bool) -> pl.DataFrame:
    columns = ["layout_id", "status", "target_tokens", "position", "text", "token_ids", "add_special_tokens"]
    frame = pl.read_parquet(layouts, columns=columns)
    return frame.filter(pl.col("status") == "ok") if every_prompt else sample_rows(frame)


def verify_arm(
    arm: str,
    backend: Backend,
    layouts: Path,
    arm_dir: Path,
    tokenizer: _Encoder,
    policy: str | None = None,
) -> list[ParityReport]:
    """:func:`check_parity` for one arm's built layouts: every prompt when the arm sends text, a sample
    when it sends ids; the reports go to ``arm_dir/tokenizer_parity.json``. HTTP clients opened here are
    closed again (the run opens its own in its event loop). ``policy``: the arm's
    ``runtime.tokenizer_parity`` (None: the default); an endpoint that may not run unchecked refuses the
    run (:func:`refuse_unchecked`), its report written first."""

    every_prompt = not bool(getattr(backend, "accepts_token_ids", True))
    targets = _targets(backend)
    if not targets:
        return []

    async def run() -> list[ParityReport]:
        try:
            rows = _prompt_rows(layouts, every_prompt)
            return await check_parity(
                arm,
                backend,
                rows,
                every_prompt=every_prompt,
                tokenizer=tokenizer,
                policy=policy or DEFAULT_POLICY,
            )
        finally:
            if any(hasattr(t, "base_url") for _, t in targets):
                await backend.aclose()

    reports = asyncio.run(run())
    write_reports(reports, arm_dir / PARITY_FILE)
    for report in reports:
        refuse_unchecked(report)
    return reports
