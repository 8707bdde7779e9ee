"""A declarative run matrix (``matrices/*.toml``): suite reference × lengths × positions × spacings ×
repeats, two systems and the analysis plan."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal, TypeAlias

from pydantic import (
    BaseModel,
    BeforeValidator,
    Discriminator,
    Field,
    StrictBool,
    Tag,
    model_validator,
)

from depthgate.spec.base import Frozen, StrictInt, canonical_json, violation
from depthgate.spec.cases import Language
from depthgate.spec.limits import (
    MAX_GENERATED_CASES,
    MAX_LAYOUTS,
    MAX_LENGTH,
    MAX_POSITIONS,
    MAX_SEEDS,
    count_problems,
    length_problem,
)
from depthgate.spec.models import AnalysisPlan
from depthgate.spec.mrcr import mrcr_problems
from depthgate.spec.positions import Position, PositionLabel, Spacing, spacing_gap, spacing_label
from depthgate.spec.system import DecodeParams, System
from depthgate.spec.text_checks import check_id


class BuiltinSuiteRef(Frozen):
    """The built-in generated suite (:func:`depthgate.spec.suites.builtin_suite`)."""

    kind: Literal["builtin"] = "builtin"
    cases: StrictInt = Field(default=8, ge=1, le=MAX_GENERATED_CASES)
    seed: StrictInt = Field(default=0, ge=0, lt=2**63)
    language: Language = "en"
    # With the `conflict` pattern (two unversioned sources disagree); the first 13 cases are the default
    # suite's, conflict cases come after them. Left out of the matrix digest when false.
    conflict: StrictBool = False
    # Issue 25 item 3: pattern = "mrcr" generates MRCR cases instead (depthgate.spec.mrcr): the same
    # request `needles` times, the question asks for the `k`-th reply. Left out of the digest by default.
    pattern: Literal["default", "mrcr"] = "default"
    needles: StrictInt | None = None
    k: StrictInt | None = None

    @model_validator(mode="after")
    def _check_pattern(self) -> BuiltinSuiteRef:
        if self.pattern != "mrcr":
            for name in ("needles", "k"):
                if getattr(self, name) is not None:
                    raise violation(
                        f'{name} is set but pattern is "{self.pattern}"',
                        field=name,
                        fix=f'set pattern = "mrcr", or drop {name}',
                    )
            return self
        if self.needles is None or self.k is None:
            raise violation(
                'pattern "mrcr" needs needles and k',
                field="needles" if self.needles is None else "k",
                fix="give e.g. needles = 4, k = 2 (the question asks for the 2nd of 4 replies)",
            )
        if self.conflict:
            raise violation(
                'conflict cases and pattern "mrcr" cannot be mixed',
                field="conflict",
                fix='drop conflict, or pattern = "mrcr"',
            )
        for name, problem, fix in mrcr_problems(self.needles, self.k, self.language):
            raise violation(problem, field=name, fix=fix)
        return self


class FileSuiteRef(Frozen):
    """A suite file: ``format = "suite"`` (JSON of :class:`Suite`) or ``"incidents"`` (JSONL replay).
    When ``format`` is omitted it follows the extension: ``.jsonl`` is incidents, anything else a suite.
    Relative paths are relative to the matrix file."""

    kind: Literal["file"] = "file"
    path: str = Field(min_length=1)
    format: Literal["suite", "incidents"] | None = None

    @property
    def resolved_format(self) -> Literal["suite", "incidents"]:
        if self.format is not None:
            return self.format
        return "incidents" if self.path.endswith(".jsonl") else "suite"


def _suite_ref_tag(value: Any) -> str:
    if isinstance(value, BaseModel):
        return str(getattr(value, "kind", "builtin"))
    if isinstance(value, Mapping):
        if "kind" in value:
            return str(value["kind"])
        return "file" if "path" in value else "builtin"
    return "builtin"


def _parse_suite_shorthand(value: Any) -> Any:
    """``"builtin"``, ``"builtin:8"``, ``"builtin:8:0:en"`` (cases:seed:language) or a path."""
    if isinstance(value, BaseModel | Mapping):
        return value
    if not isinstance(value, str):
        raise violation(
            f"{value!r} is not a suite reference",
            fix="write a table (kind = 'builtin' with cases, seed, language; or kind = 'file' with path), "
            "'builtin:<cases>:<seed>:<language>' or a path",
        )
    if value == "builtin" or value.startswith("builtin:"):
        parts = value.split(":")[1:]
        if len(parts) > 3 or any(not part for part in parts):
            raise violation(
                f"cannot parse {value!r}",
                fix="write 'builtin:<cases>:<seed>:<language>', e.g. 'builtin:8:0:en', or a table",
            )
        ref: dict[str, Any] = {"kind": "builtin"}
        for key, part in zip(("cases", "seed", "language"), parts, strict=False):
            if key == "language":
                ref[key] = part
            elif part.isdigit():
                ref[key] = int(part)
            else:
                raise violation(
                    f"{key} {part!r} in {value!r} is not a number",
                    fix="write 'builtin:<cases>:<seed>:<language>', e.g. 'builtin:8:0:en'",
                )
        return ref
    return {"kind": "file", "path": value}


SuiteRef: TypeAlias = Annotated[
    Annotated[BuiltinSuiteRef, Tag("builtin")] | Annotated[FileSuiteRef, Tag("file")],
    Discriminator(
        _suite_ref_tag,
        custom_error_type="depthgate_suite_ref",
        custom_error_message="suite must be a builtin reference or a file reference",
        custom_error_context={"fix": "use kind = 'builtin' (cases, seed, language) or kind = 'file' (path)"},
    ),
    BeforeValidator(_parse_suite_shorthand),
]


#: The most canaries per arm, length and kind a matrix may ask for (each is a full-length request).
MAX_CANARIES = 8

#: Canaries per arm, length and kind of a matrix that does not set ``canaries`` and has an arm on a
#: server (issue #37 item 7): a gateway that drops or forges the head or tail of a prompt is caught
#: without the user knowing to ask. Two, so one missed copy by a weak model never reads as a lost end
#: (an arm loses its canaries when it answers fewer than half of them, depthgate.judge.health.canary).
DEFAULT_SERVER_CANARIES = 2

#: The most context turns a conversation may have: every turn's split is proved with its own probe
#: renders (three per turn, depthgate.layout.conversation), so the proof grows with the square of it.
MAX_TURNS = 255


def turns_for_length(length: int, turn_tokens: int) -> int:
    """The turn count of a ``length``-token conversation whose turns aim at ``turn_tokens`` tokens each
    (issue 25 item 1): the odd number nearest ``length / turn_tokens`` (a tie goes up), at least 3.
    The odd number nearest x is ``2 * floor(x / 2) + 1``; integer arithmetic keeps it exact."""
    return max(3, 2 * (length // (2 * turn_tokens)) + 1)


class Matrix(Frozen):
    """A declarative run matrix (``matrices/*.toml``): suite × lengths × positions × repeats, two systems."""

    name: str
    suite: SuiteRef
    lengths: list[StrictInt]
    positions: list[Position]
    # Evidence spacing of multi-evidence cases (issue #13 item 5); the default leaves every layout, id
    # and digest as before (canonical_json leaves it out).
    spacings: list[Spacing] = Field(default_factory=lambda: list[str | int](["adjacent"]))
    repeats: StrictInt = Field(default=1, ge=1, le=MAX_SEEDS)
    # The order requests are sent in: "shuffled" (pairs in a seeded random order) or "haystack" (the
    # pairs of one haystack — case × length × seed — sent together, the haystacks and the pairs inside
    # each shuffled): a server's prefix cache then reuses the shared haystack prefix (docs/nightly.md
    # measures it on vLLM). Left out of the digest when "shuffled", so older run ids stay.
    order: Literal["shuffled", "haystack"] = "shuffled"
    # Full-length canaries (issue #21): per arm, length and kind (head, tail), this many requests whose
    # answer is fixed text at the very start / end of a prompt of the tested length
    # (depthgate.run.canary). Unset, it resolves to DEFAULT_SERVER_CANARIES when an arm runs on a server
    # (issue #37 item 7; _default_canaries) and to 0 when both arms are embedded engines; 0 sends none
    # and leaves digests and run ids as before (canonical_json drops it).
    canaries: StrictInt = Field(default=0, ge=0, le=MAX_CANARIES)
    # Issue 25: "single" (one user turn holds the context) or "conversation": `turns` alternating
    # user/assistant turns over which filler and distractors are spread, the question in the last user
    # turn, each turn's split proved faithful (depthgate.layout.conversation).
    shape: Literal["single", "conversation"] = "single"
    turns: StrictInt | None = None
    # The alternative to `turns`: each length's conversation gets the odd turn count nearest
    # length / turn_tokens (turns_for_length), so a longer prompt has more turns, not longer ones.
    # Left out of the digest when unset (conversation matrices with `turns` keep their run ids).
    turn_tokens: StrictInt | None = None
    decode: DecodeParams = DecodeParams()
    baseline: System
    candidate: System
    plan: AnalysisPlan = AnalysisPlan()

    @model_validator(mode="after")
    def _check_matrix(self) -> Matrix:
        check_id(self.name, field="name")
        if not self.lengths:
            raise violation(
                "must not be empty", field="lengths", fix="list total lengths in tokens, e.g. [1024]"
            )
        for index, length in enumerate(self.lengths):
            if length < 16:
                raise violation(
                    f"length {length} is too small",
                    field=f"lengths[{index}]",
                    fix="give total prompt lengths in tokens (>= 16), e.g. 1024",
                )
            problem = length_problem(length)
            if problem is not None:
                raise violation(
                    problem, field=f"lengths[{index}]", fix=f"give lengths of at most {MAX_LENGTH} tokens"
                )
        if len(set(self.lengths)) != len(self.lengths):
            raise violation("contains a repeated length", field="lengths", fix="list each length once")
        empty, over = (
            "list depths, e.g. [0.0, 0.25, 0.5, 0.75, 1.0]",
            f"list at most {MAX_POSITIONS} positions (split the study into several matrices)",
        )
        for problem, fix in count_problems(len(self.positions), MAX_POSITIONS, "positions", empty, over):
            raise violation(problem, field="positions", fix=fix)
        if len(set(self.positions)) != len(self.positions):
            raise violation("contains a repeated position", field="positions", fix="list each position once")
        longest = max(self.lengths)
        for index, position in enumerate(self.positions):
            offset = PositionLabel.of(position).offset
            if offset is not None and offset >= longest:
                raise violation(
                    f"offset {position} is beyond the longest length {longest}",
                    field=f"positions[{index}]",
                    fix="use an offset smaller than the lengths, or a depth in [0, 1]",
                )
        if self.repeats != len(self.decode.seeds):
            raise violation(
                f"repeats = {self.repeats} but decode.seeds has {len(self.decode.seeds)} seed(s)",
                field="repeats",
                fix=f"list one seed per repeat, e.g. decode.seeds = {list(range(self.repeats))}",
            )
        if self.baseline.name == self.candidate.name:
            raise violation(
                f"baseline and candidate are both named {self.baseline.name!r}",
                field="candidate.name",
                fix="give the two systems different names (an A/A run may otherwise use identical settings)",
            )
        # The slice count is known here: refuse a bootstrap too small to confirm a regression before
        # the plan is frozen and any request is sent.
        self._check_spacings()
        self._check_shape()
        if isinstance(self.suite, BuiltinSuiteRef):
            n_lengths = len(self.built_lengths())
            layouts = self.suite.cases * n_lengths * len(self.position_values())
            if layouts > MAX_LAYOUTS:
                raise violation(
                    f"{self.suite.cases} cases × {n_lengths} lengths × {len(self.position_values())} "
                    f"positions are {layouts} layouts per arm, over the limit of {MAX_LAYOUTS}",
                    field="lengths",
                    fix="build fewer cases, lengths or positions per matrix (split the study into several)",
                )
        # A builtin suite's case count resolves a sequential plan's looks here (issue #36, F1); a file
        # suite's is known when the gate plan is built, still before any request.
        n_cases = self.suite.cases if isinstance(self.suite, BuiltinSuiteRef) else None
        self.plan.raise_violations(
            n_slices=len(self.lengths) * len(self.position_values()), prefix="plan.", n_cases=n_cases
        )
        return self

    @model_validator(mode="after")
    def _default_canaries(self) -> Matrix:
        """An unset ``canaries`` is :data:`DEFAULT_SERVER_CANARIES` when either arm runs on a server
        (its serving path is not embedded): between depthgate and a server sit proxies and gateways
        that may cut or forge the ends of a prompt while its counts agree, which only a canary sees.
        Two embedded engines (llama.cpp in this process, vLLM offline) take the token ids from
        depthgate itself, with nothing in between, and report their own counts: no canaries unless
        asked. The resolved count is set as if written, so a dump of the matrix reads back the same."""
        if "canaries" not in self.model_fields_set and self.has_server_arm():
            object.__setattr__(self, "canaries", DEFAULT_SERVER_CANARIES)
            self.model_fields_set.add("canaries")
        return self

    def has_server_arm(self) -> bool:
        """Either arm reaches its model over HTTP (a serving path that is not embedded)."""
        return any(not system.serving.embedded for system in (self.baseline, self.candidate))

    def _check_shape(self) -> None:
        for name in ("turns", "turn_tokens"):
            if self.shape == "single" and getattr(self, name) is not None:
                raise violation(
                    f'{name} is set but shape is "single"',
                    field=name,
                    fix=f'set shape = "conversation" or drop {name}',
                )
        if self.shape == "conversation":
            self._check_turn_count()
        # "@turn:K" places the evidence in the middle of turn K's content: a conversation's turn only.
        for index, position in enumerate(self.positions):
            turn = PositionLabel.of(position).turn
            if turn is not None and self.shape != "conversation":
                raise violation(
                    f'{position!r} places the evidence by turn, but shape is "single" (one turn)',
                    field=f"positions[{index}]",
                    fix='set shape = "conversation" with turns, or give a depth such as 0.5',
                )
            if turn is not None and turn % 2 == 0 and self._mrcr_exchanges():
                raise violation(
                    f"{position!r} names an assistant turn, but MRCR needles in a conversation are "
                    "exchanges that start in a user turn",
                    field=f"positions[{index}]",
                    fix="use an odd turn (@turn:1, @turn:3 …), or a depth",
                )
            fewest = self.fewest_turns()
            if turn is not None and fewest is not None and turn > fewest:
                has = (
                    f"the conversation has {fewest} turns"
                    if self.turns is not None
                    else f"the {min(self.built_lengths())}-token conversation has {fewest} turns"
                )
                raise violation(
                    f"{position!r} names turn {turn}, but {has}",
                    field=f"positions[{index}]",
                    fix=f"use @turn:1 … @turn:{fewest}, or raise "
                    + ("turns" if self.turns is not None else "the lengths or lower turn_tokens"),
                )
        if self.shape == "conversation" and any(
            s.chat_template is None for s in (self.baseline, self.candidate)
        ):
            raise violation(
                'shape "conversation" is rendered by a chat template; a system has none',
                field="shape",
                fix="give both systems a chat_template",
            )

    def _check_turn_count(self) -> None:
        """A conversation has either ``turns`` (odd) or ``turn_tokens`` (positive), never both."""
        if self.turns is not None and self.turn_tokens is not None:
            raise violation(
                "turns and turn_tokens are both set; they are two ways to give the turn count",
                field="turn_tokens",
                fix="keep one: turns = N (every length) or turn_tokens = N (the turn count follows the "
                "length)",
            )
        if self.turns is None and self.turn_tokens is None:
            raise violation(
                'shape "conversation" needs a turn count: neither turns nor turn_tokens is set',
                field="turns",
                fix="give turns = 3, 5, 9 … or turn_tokens = N (each length gets the odd turn count nearest "
                "length / N)",
            )
        if self.turn_tokens is not None:
            if self.turn_tokens < 1:
                raise violation(
                    f"turn_tokens = {self.turn_tokens} is not a positive number of tokens",
                    field="turn_tokens",
                    fix="give the tokens a turn should hold, e.g. turn_tokens = 256",
                )
            longest = max(self.built_lengths())
            most = turns_for_length(longest, self.turn_tokens)
            if most > MAX_TURNS:
                raise violation(
                    f"turn_tokens = {self.turn_tokens} gives the {longest}-token conversation {most} turns, "
                    f"over the limit of {MAX_TURNS}",
                    field="turn_tokens",
                    fix=f"give turn_tokens = {longest // (MAX_TURNS + 1) + 1} or more",
                )
        elif self.turns is not None and self.turns > MAX_TURNS:
            raise violation(
                f"turns = {self.turns} is over the limit of {MAX_TURNS} (every turn's split is proved with "
                "its own renders, so the proof grows with the square of the turn count)",
                field="turns",
                fix=f"give an odd number of turns up to {MAX_TURNS} (e.g. 3, 5, 9), or turn_tokens = N",
            )
        elif self.turns is not None and (self.turns < 1 or self.turns % 2 == 0):
            raise violation(
                f'shape "conversation" needs an odd number of turns (got {self.turns})',
                field="turns",
                fix="give turns = 3, 5, 9 … (user/assistant alternate; the last turn is the user's question)",
            )

    def _mrcr_exchanges(self) -> bool:
        """MRCR needles laid out as user/assistant exchanges (a conversation of an MRCR suite)."""
        suite = self.suite
        return self.shape == "conversation" and isinstance(suite, BuiltinSuiteRef) and suite.pattern == "mrcr"

    def fewest_turns(self) -> int | None:
        """The smallest turn count of the matrix's conversations (None: single slot or no count)."""
        if self.shape != "conversation":
            return None
        if self.turn_tokens is not None and self.turn_tokens >= 1:
            return turns_for_length(min(self.built_lengths()), self.turn_tokens)
        return self.turns

    def _check_spacings(self) -> None:
        if not self.spacings:
            raise violation(
                "must not be empty", field="spacings", fix='list at least one spacing, e.g. ["adjacent"]'
            )
        labels = [spacing_label(s) for s in self.spacings]
        if len(set(labels)) != len(labels):
            raise violation("contains a repeated spacing", field="spacings", fix="list each spacing once")
        shortest = min(self.lengths)
        # MRCR needles travel as one block: needles - 1 gaps must fit together (spec/mrcr.py).
        needles = self.suite.needles if isinstance(self.suite, BuiltinSuiteRef) else None
        for index, spacing in enumerate(self.spacings):
            gap = spacing_gap(spacing, shortest)
            if needles and (needles - 1) * gap > shortest // 2:
                raise violation(
                    f"{needles - 1} gaps of {gap} tokens between the {needles} MRCR needles cannot fit the "
                    f"length {shortest} (at most half of it, {shortest // 2} tokens)",
                    field=f"spacings[{index}]",
                    fix=f"use a gap of at most {shortest // 2 // (needles - 1)} tokens, fewer needles, or "
                    "longer lengths",
                )
            if gap > shortest // 2:
                raise violation(
                    f"a gap of {gap} tokens cannot fit the length {shortest} (at most half of it, "
                    f"{shortest // 2} tokens)",
                    field=f"spacings[{index}]",
                    fix=f'use a gap of at most {shortest // 2} tokens, "far" (0.4 of the length), or longer '
                    "lengths",
                )
        # An absolute offset puts the start of the evidence block there; the gap must still fit after it
        # at every length (else every such layout would be refused at build, offset_outside_region).
        for p_index, position in enumerate(self.positions):
            offset = PositionLabel.of(position).offset
            if offset is None:
                continue
            for index, spacing in enumerate(self.spacings):
                for length in self.lengths:
                    gap = spacing_gap(spacing, length)
                    if gap and offset + gap >= length:
                        raise violation(
                            f"offset {position} plus the {spacing_label(spacing)} gap of {gap} tokens is "
                            f"beyond the length {length}",
                            field=f"spacings[{index}]",
                            fix=f"move positions[{p_index}] to an offset below {length - gap}, use a "
                            "smaller spacing, or longer lengths",
                        )

    def built_lengths(self) -> list[int]:
        """Every length the run builds and sends: the matrix lengths (the gated grid) and the short
        lengths of NoLiMa's base score (:meth:`AnalysisPlan.short_base_lengths`, never gated)."""
        return sorted(set(self.lengths) | set(self.plan.short_base_lengths()))

    def position_values(self) -> list[str]:
        """The position list the run is built, frozen and gated on: every position at every spacing,
        spacing-major; a non-adjacent spacing joins the position as ``"0.5~far"``. With the default
        spacing this is exactly ``[str(p) for p in positions]``."""
        return [str(PositionLabel.of(p, s)) for s in self.spacings for p in self.positions]

    def canonical_json(self) -> str:
        """As :meth:`Frozen.canonical_json`, without ``spacings``, ``order``, ``canaries`` and the
        suite's ``conflict`` when they are the defaults, so matrices written before those fields keep
        their digest (and run ids)."""
        data = self.model_dump(mode="json")
        if data.get("spacings") == ["adjacent"]:
            del data["spacings"]
        if data.get("order") == "shuffled":
            del data["order"]
        if data.get("canaries") == 0:
            del data["canaries"]
        if data.get("shape") == "single" and data.get("turns") is None:
            del data["shape"], data["turns"]
        if data.get("turn_tokens") is None:
            del data["turn_tokens"]
        if data["suite"].get("conflict") is False:
            del data["suite"]["conflict"]
        if data["suite"].get("pattern") == "default":
            del data["suite"]["pattern"], data["suite"]["needles"], data["suite"]["k"]
        return canonical_json(data)
