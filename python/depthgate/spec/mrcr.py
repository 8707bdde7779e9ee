"""MRCR-style cases (issue 25 item 3, after OpenAI's multi-round co-reference eval): the same request
made ``needles`` times in the transcript, answered by near-identical replies that differ only in a
reply code; the question asks for the code of the ``k``-th reply.

A matrix asks for them through its built-in suite::

    suite = { kind = "builtin", cases = 4, pattern = "mrcr", needles = 4, k = 2 }

Each case (deterministic in ``seed``, English only):

* **needles**: ``needles`` decisive documents, one per time the request was made, in transcript order:
  ``Request: write {topic}. Reply: {the same text for every needle} Reply code {code}.``
  Only the codes (distinct 4-digit numbers) differ. The needles travel as one moving block, in order, so
  the asked needle is the ``k``-th in the prompt at every position; the matrix's ``spacings`` put filler
  between consecutive needles (``near``, ``far``, ``<N>tok``) as for any multi-evidence case.
* **distractors**: the same kind of request/reply for *other* topics, spread over the context (and so
  over the turns of a conversation) like every case's distractors; their codes are forbidden too.
* **oracle**: the ``k``-th needle's code is the one required claim; every other needle's code and every
  distractor's code is a forbidden claim (severity "wrong"). The answer line passes when it holds the
  required code and **no** forbidden code anywhere (judge/scoring/mrcr.py: stricter than the head rule, so a
  reply that lists several codes never passes).
"""

from __future__ import annotations

from depthgate.exceptions import SpecError
from depthgate.spec.cases import Case, Claim, Distractor, EvidenceDoc, Suite
from depthgate.spec.filler import SplitMix64

__all__ = ["MAX_NEEDLES", "MRCR_DISTRACTORS", "exchange_texts", "mrcr_problems", "mrcr_suite", "ordinal"]

#: The most needles a case may carry (each is a decisive document of the one moving block).
MAX_NEEDLES = 8
#: Request/reply pairs on other topics per case (forbidden codes spread over the context).
MRCR_DISTRACTORS = 3

_TOPICS = (
    ("a poem about tapirs", "Tapirs wade through river mist, noses low."),
    ("a haiku about lighthouses", "One lamp on the rock turns all night."),
    ("a limerick about otters", "An otter kept a pebble to show everyone."),
    ("a riddle about glaciers", "I carve without hands; what am I?"),
    ("a toast for a librarian", "To quiet rooms and loud ideas."),
    ("a slogan for a bicycle shop", "Bring it in wobbling, ride it out humming."),
    ("a lullaby about owls", "Hush now, the owls keep watch."),
    ("a blurb for a copper kettle", "Copper that sings when the water is ready."),
    ("a forecast for a mountain village", "Clear skies, a cold wind after dusk."),
    ("a note to a neighbour", "Thank you for watering the tomatoes."),
)
_ORDINALS = ("first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth")


def ordinal(k: int) -> str:
    """``1`` → ``"first"`` … ``8`` → ``"eighth"``."""
    return _ORDINALS[k - 1]


def mrcr_problems(needles: int, k: int, language: str) -> list[tuple[str, str, str]]:
    """The MRCR fields' rules as (field, problem, fix): shared by the matrix's suite reference
    (:class:`depthgate.spec.matrix.BuiltinSuiteRef`) and :func:`mrcr_suite`."""
    if not 2 <= needles <= MAX_NEEDLES:
        return [
            (
                "needles",
                f"needles = {needles}: an MRCR case repeats its request 2 to {MAX_NEEDLES} times",
                f"give needles between 2 and {MAX_NEEDLES}, e.g. 4",
            )
        ]
    if not 1 <= k <= needles:
        return [
            (
                "k",
                f"k = {k}: the question asks for the k-th of {needles} replies",
                f"give k between 1 and {needles}",
            )
        ]
    if language != "en":
        return [
            (
                "language",
                f"the MRCR pattern is written in English only (language = {language!r})",
                'use language = "en" with pattern = "mrcr"',
            )
        ]
    return []


def _needle(topic: str, reply: str, code: int) -> str:
    return f" Request: write {topic}. Reply: {reply} Reply code {code}."


def exchange_texts(needle: str) -> tuple[str, str]:
    """A needle's request and reply as two messages of a conversation (issue 25 item 3): ``(" Request:
    write {topic}", " Reply: {reply} Reply code {code}")``. The closing periods go: the request ends a
    user turn and the reply an assistant turn, and a period before a turn marker that the tokenizer
    does not treat as special (".<" in byte-level BPE and SentencePiece alike) merges into one token
    across the turn's edge, which would leave neither span exact."""
    request, reply = needle.removesuffix(".").split(". Reply: ", 1)
    return request, f" Reply: {reply}"


def _codes(rng: SplitMix64, count: int) -> list[int]:
    codes: list[int] = []
    while len(codes) < count:
        code = 1000 + rng.below(9000)
        if code not in codes:
            codes.append(code)
    return codes


def _case(index: int, seed: int, needles: int, k: int) -> Case:
    rng = SplitMix64("mrcr", seed, index)
    topic, reply = _TOPICS[(seed + index) % len(_TOPICS)]
    others = [t for t in _TOPICS if t[0] != topic]
    case_id = f"en-s{seed}-{index:04d}-mrcr{needles}k{k}"
    codes = _codes(rng, needles + MRCR_DISTRACTORS)
    needle_codes, distractor_codes = codes[:needles], codes[needles:]
    evidence = [
        EvidenceDoc(
            id=f"{case_id}/n{i + 1}",
            text=_needle(topic, reply, code),
            supports=["answer"] if i + 1 == k else [],
        )
        for i, code in enumerate(needle_codes)
    ]
    distractors = []
    forbidden = [
        Claim(id=f"needle_{i + 1}", text=f"Reply code {code}", value=str(code), severity="wrong")
        for i, code in enumerate(needle_codes)
        if i + 1 != k
    ]
    for j, code in enumerate(distractor_codes):
        other_topic, other_reply = others[(index + 3 * j) % len(others)]
        distractors.append(
            Distractor(id=f"{case_id}/d{j + 1:02d}", text=_needle(other_topic, other_reply, code))
        )
        forbidden.append(
            Claim(id=f"distractor_{j + 1:02d}", text=f"Reply code {code}", value=str(code), severity="wrong")
        )
    nth = ordinal(k)
    return Case(
        id=case_id,
        kind="qa",
        evidence_pattern="mrcr",
        language="en",
        risk="low",
        query=f"The user asked for {topic} {needles} times. What was the reply code of the {nth} reply?",
        answer_prefix=f"The reply code of the {nth} reply to the request for {topic} was",
        evidence=evidence,
        distractors=distractors,
        required_claims=[
            Claim(id="answer", text=f"Reply code {needle_codes[k - 1]}", value=str(needle_codes[k - 1]))
        ],
        forbidden_claims=forbidden,
        family=f"mrcr:{topic}",
    )


def mrcr_suite(n_cases: int, seed: int, *, needles: int, k: int, language: str = "en") -> Suite:
    """``n_cases`` MRCR cases (module docstring), each repeating its request ``needles`` times and asking
    for the ``k``-th reply's code."""
    for field, problem, fix in mrcr_problems(needles, k, language):
        raise SpecError(problem, field=f"suite.{field}", fix=fix)
    cases = [_case(index, seed, needles, k) for index in range(n_cases)]
    return Suite(
        name=f"builtin-mrcr{needles}k{k}-en-s{seed}-n{n_cases}", seed=seed, language="en", cases=cases
    )
