"""One position-label type (issue #23 item 3): depthgate.spec.positions.PositionLabel parses, formats and
orders every label ("0.5", "@1200", "0.5~far", "@1200~near", "1~300tok"); the strings it gives are the
ones the matrix, the layouts and the gate always used."""

from __future__ import annotations

import pytest

from depthgate.layout.layouts import parse_positions
from depthgate.spec.matrix import Matrix
from depthgate.spec.positions import PositionLabel, position_sort_key, split_position_label

LABELS = ["0", "0.25", "0.5", "1", "@0", "@1200", "0.5~near", "0.5~far", "@1200~near", "1~300tok", "0~64tok"]


@pytest.mark.parametrize("label", LABELS)
def test_a_label_round_trips(label: str) -> None:
    parsed = PositionLabel.parse(label)
    assert str(parsed) == label
    assert (parsed.base, parsed.spacing) == split_position_label(label)
    assert parsed.adjacent == ("~" not in label)
    assert parsed.offset == (int(parsed.base[1:]) if parsed.base.startswith("@") else None)


def test_labels_are_ordered_depths_then_offsets_then_spacings() -> None:
    shuffled = ["@1200~near", "1", "0.5~far", "@0", "0.25", "1~300tok", "0.5~near", "@1200", "0"]
    # adjacent depths (kind 0), adjacent offsets (1), then per spacing 3 * (1 + rank) + kind: near (rank 1)
    # depth 6, near offset 7, far (rank 2) depth 9, a 300-token gap (rank 3 + 300) depth 912
    assert sorted(shuffled, key=position_sort_key) == [
        "0",
        "0.25",
        "1",
        "@0",
        "@1200",
        "0.5~near",
        "@1200~near",
        "0.5~far",
        "1~300tok",
    ]


def test_the_gate_orders_labels_as_the_label_type_does() -> None:
    from depthgate.judge.tables import position_sort_key as gate_key

    for label in [*LABELS, "junk", "junk~far", "@x", "-1", "1e-3", "@turn:3", "@turn:10~far", "@turn:x"]:
        assert position_sort_key(label) == gate_key(label), label


def test_matrix_and_layout_labels_are_the_ones_they_always_were() -> None:
    arm = {"name": "a", "backend": "llamacpp", "model": "gemma3-270m", "tokenizer": "gguf:"}
    matrix = Matrix.model_validate(
        {
            "name": "m",
            "suite": "builtin",
            "lengths": [1024],
            "positions": [0.0, 0.5, 1, "@100"],
            "spacings": ["adjacent", "near", 300],
            "baseline": arm,
            "candidate": {**arm, "name": "b"},
        }
    )
    expected = ["0.0", "0.5", "1.0", "@100"]
    expected += [f"{p}~near" for p in ["0.0", "0.5", "1.0", "@100"]]
    expected += [f"{p}~300tok" for p in ["0.0", "0.5", "1.0", "@100"]]
    assert matrix.position_values() == expected
    # the layout builder names the same places with its own depth format ("0", not "0.0")
    assert [p.label for p in parse_positions(matrix.position_values())] == [
        "0",
        "0.5",
        "1",
        "@100",
        "0~near",
        "0.5~near",
        "1~near",
        "@100~near",
        "0~300tok",
        "0.5~300tok",
        "1~300tok",
        "@100~300tok",
    ]


@pytest.mark.parametrize(("label", "turn"), [("@turn:1", 1), ("@turn:3", 3), ("@turn:12~far", 12)])
def test_a_turn_label_names_its_turn(label: str, turn: int) -> None:
    """``@turn:K`` (issue 25): the one label type parses it as a turn, not an offset, and round-trips it."""
    parsed = PositionLabel.parse(label)
    assert str(parsed) == label and parsed.turn == turn
    assert parsed.offset is None and not parsed.is_offset
    assert [p.turn for p in parse_positions([label])] == [turn]


@pytest.mark.parametrize("label", ["@turn:0", "@turn:", "@turn:x", "@turn:-1", "@turn:01"])
def test_a_malformed_turn_is_no_turn(label: str) -> None:
    assert PositionLabel.parse(label).turn is None
    with pytest.raises(ValueError, match="is not a position"):
        Matrix.model_validate({"positions": [label]})


def test_turn_labels_sort_after_offsets_by_turn_number() -> None:
    shuffled = ["@turn:10", "@turn:2", "@5", "0.5", "@turn:1~near", "0.5~near"]
    assert sorted(shuffled, key=position_sort_key) == [
        "0.5",
        "@5",
        "@turn:2",
        "@turn:10",
        "0.5~near",
        "@turn:1~near",
    ]
