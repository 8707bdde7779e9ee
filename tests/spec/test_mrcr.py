"""MRCR-style cases (issue 25 item 3): how a matrix asks for them (``suite = { pattern = "mrcr", needles,
k }``), what each field changes, what is refused by field and fix, and the generated cases themselves
(near-identical needles that differ only in their code, the k-th required, every other code forbidden)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from depthgate.exceptions import SpecError
from depthgate.spec.loading import load_matrix
from depthgate.spec.matrix import Matrix
from depthgate.spec.mrcr import MAX_NEEDLES, mrcr_suite
from depthgate.spec.suites import resolve_suite

ARM = {
    "name": "a",
    "backend": "llamacpp",
    "model": "gemma3-270m",
    "tokenizer": "gguf:",
    "chat_template": "t.jinja",
}


def _matrix(suite: dict[str, Any], **top: Any) -> Matrix:
    return Matrix.model_validate(
        {
            "name": "m",
            "suite": {"kind": "builtin", "cases": 3, **suite},
            "lengths": [1024],
            "positions": [0.0, 1.0],
            "shape": "conversation",
            "turns": 5,
            "baseline": ARM,
            "candidate": {**ARM, "name": "b"},
            **top,
        }
    )


def _code(text: str) -> str:
    match = re.search(r"Reply code (\d{4})\.$", text)
    assert match, text
    return match.group(1)


@pytest.mark.parametrize(("needles", "k"), [(2, 1), (4, 2), (4, 4), (MAX_NEEDLES, 5)])
def test_needles_and_k_shape_every_case(needles: int, k: int) -> None:
    suite = resolve_suite(_matrix({"pattern": "mrcr", "needles": needles, "k": k}).suite)
    assert len(suite.cases) == 3
    for case in suite.cases:
        assert case.evidence_pattern == "mrcr" and len(case.decisive) == needles
        codes = [_code(d.text) for d in case.decisive]
        assert len(set(codes)) == needles
        # near-identical: the needles differ only in their code
        assert len({d.text.replace(c, "#") for d, c in zip(case.decisive, codes, strict=True)}) == 1
        assert [d.supports for d in case.decisive] == [
            ["answer"] if i == k else [] for i in range(1, needles + 1)
        ]
        assert case.required_claims[0].value == codes[k - 1]
        forbidden = {c.value for c in case.forbidden_claims}
        assert forbidden >= set(codes) - {codes[k - 1]} and codes[k - 1] not in forbidden
        assert {_code(d.text) for d in case.distractors} <= forbidden
        ordinal = ["first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth"][k - 1]
        assert f"the {ordinal} reply" in case.query and f"the {ordinal} reply" in case.answer_prefix
        assert f"{needles} times" in case.query


def test_generation_is_deterministic_and_seeded() -> None:
    a = mrcr_suite(3, 0, needles=4, k=2)
    assert a == mrcr_suite(3, 0, needles=4, k=2)
    assert a.digest() != mrcr_suite(3, 1, needles=4, k=2).digest()
    assert resolve_suite(_matrix({"pattern": "mrcr", "needles": 4, "k": 2, "seed": 1}).suite) == mrcr_suite(
        3, 1, needles=4, k=2
    )


@pytest.mark.parametrize(
    ("suite", "top", "message"),
    [
        ({"needles": 4}, {}, r"suite.*needles.*needles is set but pattern is \"default\""),
        ({"k": 2}, {}, r"suite.*k.*k is set but pattern is \"default\""),
        ({"pattern": "mrcr", "needles": 4}, {}, r"pattern \"mrcr\" needs needles and k"),
        ({"pattern": "mrcr", "needles": 1, "k": 1}, {}, r"needles = 1.*2 to 8"),
        ({"pattern": "mrcr", "needles": 9, "k": 1}, {}, r"needles = 9"),
        ({"pattern": "mrcr", "needles": 4, "k": 5}, {}, r"k = 5.*k-th of 4"),
        ({"pattern": "mrcr", "needles": 4, "k": 0}, {}, r"k = 0"),
        ({"pattern": "mrcr", "needles": 4, "k": 2, "language": "zh"}, {}, r"English only"),
        ({"pattern": "mrcr", "needles": 4, "k": 2, "conflict": True}, {}, r"cannot be mixed"),
        ({"pattern": "poems"}, {}, r"pattern"),
        # 3 gaps of 200 tokens cannot fit half of 1024
        ({"pattern": "mrcr", "needles": 4, "k": 2}, {"spacings": [200]}, r"spacings\[0\].*3 gaps of 200"),
    ],
)
def test_bad_mrcr_fields_are_refused_by_name(
    suite: dict[str, Any], top: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match="(?s)" + message):
        _matrix(suite, **top)


def test_mrcr_spacing_that_fits_is_accepted_and_the_default_digest_is_unchanged() -> None:
    assert _matrix({"pattern": "mrcr", "needles": 4, "k": 2}, spacings=["adjacent", 100]).spacings == [
        "adjacent",
        100,
    ]
    plain = _matrix({})
    assert '"pattern"' not in plain.canonical_json() and '"needles"' not in plain.canonical_json()
    mrcr = _matrix({"pattern": "mrcr", "needles": 4, "k": 2})
    assert (
        mrcr.digest() != plain.digest()
        and mrcr.digest() != _matrix({"pattern": "mrcr", "needles": 4, "k": 3}).digest()
    )


def test_a_matrix_file_names_the_file_field_and_fix(tmp_path: Path) -> None:
    root = Path(__file__).resolve().parents[2]
    text = (root / "matrices" / "conversation-embedded.toml").read_text(encoding="utf-8")
    text = text.replace('language = "en" }', 'language = "en", pattern = "mrcr", needles = 4, k = 6 }')
    path = tmp_path / "m.toml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(SpecError, match=r"suite.*k = 6") as info:
        load_matrix(path)
    assert info.value.file == str(path) and "between 1 and 4" in (info.value.fix or "")


def test_the_shipped_mrcr_matrix_asks_for_mrcr_conversations() -> None:
    root = Path(__file__).resolve().parents[2]
    matrix = load_matrix(root / "matrices" / "conversation-mrcr-embedded.toml")
    assert matrix.shape == "conversation" and "@turn:3" in matrix.position_values()
    suite = resolve_suite(matrix.suite)
    assert len(suite.cases) == 8 and {len(c.decisive) for c in suite.cases} == {4}
    assert all("second reply" in c.query for c in suite.cases)


def test_an_assistant_turn_is_refused_for_mrcr_exchanges(tmp_path: Path) -> None:
    """MRCR needles in a conversation are exchanges that start in a user turn: ``@turn:2`` is refused by
    file, field and fix; the same position on a default suite is accepted."""
    root = Path(__file__).resolve().parents[2]
    text = (root / "matrices" / "conversation-mrcr-embedded.toml").read_text(encoding="utf-8")
    path = tmp_path / "m.toml"
    path.write_text(text.replace('"@turn:3"', '"@turn:2"'), encoding="utf-8")
    with pytest.raises(SpecError, match=r"assistant turn") as info:
        load_matrix(path)
    assert info.value.file == str(path) and info.value.field == "positions[1]"
    assert "odd turn" in (info.value.fix or "")
    plain = text.replace('"@turn:3"', '"@turn:2"').replace(', pattern = "mrcr", needles = 4, k = 2', "")
    path.write_text(plain, encoding="utf-8")
    assert "@turn:2" in load_matrix(path).position_values()
