"""The A/A noise floor in the reports (:mod:`depthgate.judge.science.noise`): verdict.json ``noise_floor``, a
section of summary.md and of report.html, for a run started with ``depthgate run --aa``. It never changes
the verdict."""

from __future__ import annotations

import html
import sys

from depthgate.exceptions import InputError
from depthgate.judge.science import NoiseFloorResult, noise_floor
from depthgate.report.document import AnalysisContext, Section
from depthgate.report.formatting import markdown_table

__all__ = ["noise_floor_section", "render_noise_markdown"]


def render_noise_markdown(nf: NoiseFloorResult) -> str:
    """The summary.md section."""
    ok = {True: "yes", False: "NO", None: "–"}[nf.plan_margin_ok]
    lines = [
        "",
        "",
        "### Noise floor (A/A: the baseline against itself)",
        "",
        f"Recommended margin {nf.recommended_margin:g}: a simulated A/A release passes there with "
        f"probability {nf.pass_probability:.2f} (target {nf.pass_target:g}; flip rate upper bound "
        f"{nf.flip_rate_upper_clustered:.3f}; binding slice {nf.binding_slice}); the |Δ| noise bound alone "
        f"gives {nf.noise_bound_margin:g}; plan margin "
        f"{nf.plan_margin}; plan margin above the noise floor: {ok}. Flip rate overall "
        f"{nf.flip_rate:.3f} ({nf.flips} of {nf.paired_runs} paired runs); A/A gate verdict {nf.aa_verdict}.",
        "",
        *markdown_table(
            ["slice", "paired runs", "flips", "flip rate", "Δ", "noise bound on |Δ|"],
            [
                [
                    f"{s.length}/{s.position}",
                    str(s.paired_runs),
                    str(s.flips),
                    f"{s.flip_rate:.3f}",
                    f"{s.delta:+.3f}",
                    f"{s.delta_bound:.3f}",
                ]
                for s in nf.slices
            ],
        ),
        "",
    ]
    return "\n".join(lines)


def noise_floor_section(ctx: AnalysisContext) -> Section | None:
    """The noise floor of an A/A run (None for any other run, or, with a note on stderr, when it cannot
    be computed)."""
    if not ctx.aa:
        return None
    plan = ctx.noise_plan
    try:
        result = noise_floor(ctx.scored, alpha=plan.look_alpha, plan=plan)
    except InputError as exc:
        print(f"depthgate: noise floor not computed: {exc}", file=sys.stderr)
        return None
    text = render_noise_markdown(result)
    state = "above" if result.plan_margin_ok else "BELOW"
    return Section(
        key="noise_floor",
        data=result.to_dict(),
        markdown=text,
        html=(
            '<h2 id="noise-floor">Noise floor (A/A)</h2>\n'
            f'<pre class="small">{html.escape(text.strip())}</pre>\n'
        ),
        console=(
            f"noise floor: recommended margin {result.recommended_margin:g} (an A/A release passes there "
            f"with probability {result.pass_probability:.2f}; plan margin {plan.margin:g} is {state} it); "
            f"flip rate {result.flip_rate:.3f}",
        ),
    )
