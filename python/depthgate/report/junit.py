"""junit.xml: one testcase per slice, a safety suite and a run suite, so CI dashboards show the gate like
a test run; analysis sections add to the tree (``Section.junit``) before it is serialised once."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from collections.abc import Sequence

from depthgate.judge.gate import GatePlan, GateResult, SliceResult, SliceStatus
from depthgate.judge.health import RunHealth
from depthgate.judge.tables import position_sort_key
from depthgate.report.document import Section
from depthgate.report.formatting import depth_label, machine_signed, plain, q_value, signed, slice_key
from depthgate.report.verdict import health_reasons


def _worst_lines(result: GateResult) -> list[str]:
    """The worst position per length, as the console says it (commands/cli.py, from verdict.json)."""
    return [
        f"worst position at {w.length} tokens: depth {w.slice_worst_position} (lowest Δ lower bound "
        f"{machine_signed(w.slice_worst_lower)}; position range baseline {plain(w.range_baseline)} → "
        f"candidate {plain(w.range_candidate)})"
        for w in result.worst_by_length
        if w.slice_worst_position is not None
    ]


def _property(parent: ET.Element, name: str, value: object) -> None:
    ET.SubElement(parent, "property", name=name, value=str(value))


def render_junit(
    result: GateResult, health: RunHealth | None = None, sections: Sequence[Section] = ()
) -> bytes:
    """JUnit XML of :func:`junit_tree`, with every section's additions (``Section.junit``)."""
    root = junit_tree(result, health)
    for section in sections:
        if section.junit is not None:
            section.junit(root)
    ET.indent(root)
    data: bytes = ET.tostring(root, encoding="utf-8", xml_declaration=True)
    return data + b"\n"


def _slice_numbers(s: SliceResult, plan: GatePlan) -> str:
    return (
        f"Δ {signed(s.delta, 3)} (baseline {plain(s.acc_baseline, 3)} → candidate "
        f"{plain(s.acc_candidate, 3)}), lower bound {signed(s.lower, 3)} vs −M = −{plan.margin:g}, "
        f"q_NI ({plan.fdr_method}) {q_value(s.q_ni)}, "
        f"q_REG ({plan.regression_method}) {q_value(s.q_reg)}, "
        f"{s.n_cases} cases × {s.seeds} seeds, {s.n_missing} missing"
    )


def _slices_suite(root: ET.Element, result: GateResult) -> tuple[int, int]:
    """Suite ``depthgate.slices``: one testcase per slice; returns (failures, skipped)."""
    plan = result.plan
    suite = ET.SubElement(root, "testsuite", name="depthgate.slices")
    suite_properties = ET.SubElement(suite, "properties")
    worst_at = {
        w.length: w.slice_worst_position for w in result.worst_by_length if w.slice_worst_position is not None
    }
    for w in result.worst_by_length:
        if w.slice_worst_position is not None:
            _property(
                suite_properties,
                f"worst_position.{w.length}",
                f"{w.slice_worst_position} (lower bound {machine_signed(w.slice_worst_lower)})",
            )
    failures = skipped = 0
    for s in sorted(result.slice_results, key=lambda r: (r.length, position_sort_key(r.position))):
        case = ET.SubElement(
            suite,
            "testcase",
            classname=f"depthgate.length_{s.length}",
            name=(
                f"{slice_key(s.length, s.position)} "
                f"(length {s.length} tokens, depth {depth_label(s.position)})"
            ),
            time="0",
        )
        properties = ET.SubElement(case, "properties")
        _property(properties, "length", s.length)
        _property(properties, "position", s.position)
        _property(properties, "lower_bound", machine_signed(s.lower))
        _property(properties, "worst_position", "true" if worst_at.get(s.length) == s.position else "false")
        _property(properties, "worst_position_at_length", worst_at.get(s.length, "–"))
        numbers = _slice_numbers(s, plan)
        if s.status.value.startswith("FAIL"):
            failures += 1
            failure = ET.SubElement(
                case, "failure", message=f"{s.status.value}: {numbers}", type=s.status.value
            )
            failure.text = s.reason
        elif s.status is SliceStatus.INCONCLUSIVE:
            skipped += 1
            ET.SubElement(case, "skipped", message=f"INCONCLUSIVE: {s.reason}; {numbers}")
        else:
            ET.SubElement(case, "system-out").text = f"PASS: {numbers}; {s.reason}"
    if not len(suite_properties):
        suite.remove(suite_properties)
    ET.SubElement(suite, "system-out").text = "\n".join(_worst_lines(result)) or "no worst position"
    suite.set("tests", str(len(result.slice_results)))
    suite.set("failures", str(failures))
    suite.set("errors", "0")
    suite.set("skipped", str(skipped))
    suite.set("time", "0")
    return failures, skipped


def _run_suites(root: ET.Element, result: GateResult, health: RunHealth | None) -> tuple[int, int]:
    """Suites ``depthgate.safety`` and ``depthgate.run``; returns (failures, errors)."""
    safety = ET.SubElement(root, "testsuite", name="depthgate.safety", tests="1", errors="0", skipped="0")
    case = ET.SubElement(safety, "testcase", classname="depthgate.safety", name="no forbidden claim given")
    hits = result.safety
    if result.safety_flag:
        ET.SubElement(
            case,
            "failure",
            type="SAFETY",
            message=(
                f"SAFETY: {hits.hits_candidate}/{hits.runs_candidate} candidate and "
                f"{hits.hits_baseline}/{hits.runs_baseline} baseline runs gave a forbidden claim"
            ),
        ).text = "Blocks the release pending human review (independent of the statistics)."
    safety.set("failures", "1" if result.safety_flag else "0")
    safety.set("time", "0")
    run_suite = ET.SubElement(root, "testsuite", name="depthgate.run", tests="2", skipped="0", time="0")
    lost = ET.SubElement(
        run_suite, "testcase", classname="depthgate.run", name="no run lost to infrastructure"
    )
    driven = ET.SubElement(
        run_suite, "testcase", classname="depthgate.run", name="no slice fails by the serving path"
    )
    reasons = {r.split(":", 1)[0]: r for r in health_reasons(health)}
    n_errors = n_run_failures = 0
    if "INFRA" in reasons:
        n_errors = 1
        ET.SubElement(lost, "error", type="INFRA", message=reasons["INFRA"])
    if "SYSTEM" in reasons:
        n_run_failures = 1
        ET.SubElement(driven, "failure", type="FAIL_SYSTEM", message=reasons["SYSTEM"])
    run_suite.set("errors", str(n_errors))
    run_suite.set("failures", str(n_run_failures))
    return (1 if result.safety_flag else 0) + n_run_failures, n_errors


def junit_tree(result: GateResult, health: RunHealth | None = None) -> ET.Element:
    """JUnit XML: suite ``depthgate.slices`` with one testcase per slice, suite ``depthgate.safety``,
    suite ``depthgate.run`` (an error when runs were lost; a failure naming system-driven slices).

    The position section: suite ``depthgate.slices`` has a property ``worst_position.<length>`` per
    length (the depth with the lowest Δ lower bound) and the console's worst-position lines in its
    ``system-out``; every slice testcase has the properties ``length``, ``position``, ``lower_bound``,
    ``worst_position`` ("true" for the worst depth of its length) and ``worst_position_at_length``.
    The position-science section adds the effective length
    (:func:`depthgate.report.position.add_junit_effective_length`)."""
    root = ET.Element("testsuites", name="depthgate")
    failures, skipped = _slices_suite(root, result)
    run_failures, errors = _run_suites(root, result, health)
    root.set("tests", str(len(result.slice_results) + 3))
    root.set("failures", str(failures + run_failures))
    root.set("errors", str(errors))
    root.set("skipped", str(skipped))
    return root
