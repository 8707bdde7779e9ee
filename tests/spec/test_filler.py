"""Filler: determinism, the unit contract the layout engine relies on, and topical safety."""

from __future__ import annotations

import itertools
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from depthgate.exceptions import SpecError
from depthgate.spec.filler import SplitMix64, filler_pool, filler_units
from depthgate.spec.suites import NAMES_EN, NAMES_ZH, REGIONS
from depthgate.spec.text_checks import find_special_token, unit_contract_violation

languages = st.sampled_from(["en", "zh"])
seeds = st.integers(min_value=0, max_value=2**32)

# Words that would let filler support or contradict a generated case.
BANNED_EN = re.compile(
    r"region|hotel|travel|invoice|supplier|payment|incident|reported to|sign-off|sign off|expense|"
    r"approv|USD|per night|policy version|exception",
    re.IGNORECASE,
)
BANNED_ZH = re.compile(r"区域|酒店|差旅|发票|供应商|付清|安全事件|签字|审批|美元|例外|政策")


def _assert_topically_safe(unit: str, language: str) -> None:
    banned = BANNED_ZH if language == "zh" else BANNED_EN
    assert not banned.search(unit), unit
    for english, chinese, _slug in REGIONS:
        region = chinese if language == "zh" else english
        assert not re.search(rf"(?<![A-Za-z]){re.escape(region)}(?![A-Za-z])", unit), (region, unit)
    for name in NAMES_ZH if language == "zh" else NAMES_EN:
        assert name not in unit
    assert find_special_token(unit) is None


def test_splitmix64_reference_vector() -> None:
    # SplitMix64 from state 0 (Steele, Lea & Flood; the reference C implementation by Vigna)
    rng = SplitMix64()
    rng.state = 0
    assert [rng.next_u64() for _ in range(2)] == [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4]


def test_golden_first_units() -> None:
    # Pinned: a change here changes every layout digest built on the default filler.
    assert filler_units(0, "en", 2) == [
        "\n\nSection 1. Onboarding.",
        "\nQuality assurance staff must inspect cleaning rotas every Friday afternoon.",
    ]
    assert filler_units(0, "zh", 2) == ["\n\n第1节：车辆管理。", "\n远程办公的同事遵循相同的流程。"]


@settings(max_examples=25, deadline=None)
@given(seed=seeds, language=languages, short=st.integers(0, 60), extra=st.integers(0, 140))
def test_units_are_deterministic_and_prefix_stable(seed: int, language: str, short: int, extra: int) -> None:
    longer = filler_units(seed, language, short + extra)
    assert len(longer) == short + extra
    assert filler_units(seed, language, short) == longer[:short]
    assert filler_units(seed, language, short + extra) == longer


@settings(max_examples=25, deadline=None)
@given(seed=seeds, language=languages)
def test_unit_contract(seed: int, language: str) -> None:
    units = filler_units(seed, language, 200)
    sentences_since_heading = 0
    section = 0
    for index, unit in enumerate(units):
        assert unit_contract_violation(unit) is None, unit
        assert "\n" not in unit.lstrip("\n"), unit
        assert "  " not in unit and "\t" not in unit and "\r" not in unit
        end = unit[-1]
        if unit.startswith("\n\n"):
            section += 1
            if index > 0:
                assert 5 <= sentences_since_heading <= 9  # "a heading about every 7 sentences"
            sentences_since_heading = 0
            heading = f"第{section}节：" if language == "zh" else f"Section {section}. "
            assert unit[2:].startswith(heading), unit
        elif unit.startswith("\n"):
            assert units[index - 1].startswith("\n\n"), "a '\\n' sentence follows a heading"
            sentences_since_heading += 1
        else:
            assert unit.startswith(" ")
            assert index > 0 and not units[index - 1].startswith("\n\n"), "a heading is followed by '\\n'"
            sentences_since_heading += 1
        assert end in ("。" if language == "zh" else "."), unit
        if not unit.startswith("\n\n"):
            assert not re.search(r"[0-9]", unit), "only headings carry numbers"
        _assert_topically_safe(unit, language)
    assert units[0].startswith("\n\n")


def test_units_differ_by_seed_and_language() -> None:
    assert filler_units(1, "en", 50) != filler_units(2, "en", 50)
    assert filler_units(1, "en", 50) != filler_units(1, "zh", 50)


def test_generic_share_and_variety() -> None:
    units = filler_units(7, "en", 3000)
    sentences = [u for u in units if not u.startswith("\n\n")]
    generic = [u for u in sentences if " staff " not in u]
    assert 0.10 <= len(generic) / len(sentences) <= 0.20
    templated = [u for u in sentences if " staff " in u]
    assert len(set(templated)) / len(templated) > 0.95
    for a, b in itertools.pairwise(sentences):
        assert a.strip() != b.strip()


@settings(max_examples=15, deadline=None)
@given(seed=seeds, language=languages, size=st.integers(1, 120), extra=st.integers(0, 60))
def test_pool_contract(seed: int, language: str, size: int, extra: int) -> None:
    pool = filler_pool(seed, language, size + extra)
    assert len(pool) == size + extra
    assert len(set(pool)) == len(pool)
    assert filler_pool(seed, language, size) == pool[:size]
    for unit in pool:
        assert unit.startswith(" ") and not unit.startswith("  ")
        assert unit_contract_violation(unit) is None
        assert "\n" not in unit
        assert not re.search(r"[0-9]", unit)
        _assert_topically_safe(unit, language)


def test_pool_lengths_are_spread() -> None:
    words = sorted(len(unit.split()) for unit in filler_pool(3, "en", 500))
    assert words[0] <= 3 and words[-1] >= 30
    # every band of the range is represented, so gaps of any size can be closed
    for low, high in [(2, 4), (5, 8), (9, 14), (15, 24), (25, 40)]:
        assert any(low <= n <= high for n in words), (low, high)
    chars = sorted(len(unit) for unit in filler_pool(3, "zh", 500))
    assert chars[0] <= 8 and chars[-1] >= 45


def test_large_pool_falls_back_when_short_sentences_run_out() -> None:
    pool = filler_pool(0, "en", 2000)  # more than the 240 distinct short sentences
    assert len(set(pool)) == 2000


@pytest.mark.parametrize(
    ("call", "field"),
    [
        (lambda: filler_units(0, "fr", 3), "language"),
        (lambda: filler_units(0, "en", 3, domain="finance"), "domain"),
        (lambda: filler_units(0, "en", -1), "count"),
        (lambda: filler_units(-1, "en", 1), "seed"),
        (lambda: filler_pool(0, "de", 3), "language"),
        (lambda: filler_pool(0, "en", -2), "size"),
    ],
)
def test_bad_arguments_name_field_and_fix(call: object, field: str) -> None:
    with pytest.raises(SpecError) as info:
        call()  # type: ignore[operator]
    assert info.value.field == field
    assert info.value.fix
    assert "fix:" in str(info.value)
