"""What SPOT would do at real scale, on paper: measured acceptance combined with a measured pass-cost curve.

A benchmark report gives, per budget, how many passes SPOT needed where standard decoding needed ``P`` (acceptance
is a property of the target's distributions and the drafter, measured on the target the bench ran), and how long
the drafter took per round on the bench's device. A ``verify-cost`` report gives how long one pass over ``n`` nodes
takes for a target of a given shape on a given device. Their product is a projection, not a measurement:

    projected tokens/s ratio (budget b) = P * t(1) / (P_b * t(b) + P_b * d_b)

with ``t(n)`` the pass cost at ``n`` nodes (interpolated between measured node counts) and ``d_b`` the drafter's time
per round (measured by the bench, or given: a GPU drafter costs other than a CPU one). Both runs decode the same
tokens, so the ratio of times is the ratio of tokens per second.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ProjectedRow:
    temperature: float
    method: str
    budget: int
    passes_ratio: float  # standard passes / SPOT passes (measured)
    pass_cost_ratio: float  # t(budget) / t(1) (measured on the cost report's device)
    drafter_ms: float  # drafter time per round
    tokens_per_second_ratio: float  # projected


def pass_cost_ms(curve: dict[int, float], nodes: int) -> float:
    """The pass cost at ``nodes`` from a measured curve {nodes: ms}: linear between measured counts, the last
    measured slope beyond them."""
    counts = sorted(curve)
    if nodes in curve:
        return curve[nodes]
    if nodes < counts[0]:
        return curve[counts[0]]
    lower = max((c for c in counts if c < nodes), default=counts[0])
    upper = min((c for c in counts if c > nodes), default=None)
    if upper is None:  # beyond the curve: extend its last segment
        if len(counts) == 1:
            return curve[lower]
        a, b = counts[-2], counts[-1]
        return curve[b] + (nodes - b) * (curve[b] - curve[a]) / (b - a)
    share = (nodes - lower) / (upper - lower)
    return curve[lower] + share * (curve[upper] - curve[lower])


def cost_curve(verify_report: dict, shape: str | None) -> tuple[str, dict[int, float]]:
    """The {nodes: ms per pass} curve of one shape in a verify-cost report (the only one, or the named one)."""
    shapes = sorted({row["shape"] for row in verify_report["results"]})
    if shape is None:
        if len(shapes) != 1:
            raise ValueError(f"the cost report holds several shapes ({', '.join(shapes)}): name one with --shape")
        shape = shapes[0]
    if shape not in shapes:
        raise ValueError(f"shape {shape!r} is not in the cost report (it holds {', '.join(shapes)})")
    curve = {int(r["nodes"]): float(r["ms_per_pass"]) for r in verify_report["results"] if r["shape"] == shape}
    if 1 not in curve:
        raise ValueError(f"the cost report has no one-node pass for {shape}: standard decoding's cost is unknown")
    return shape, curve


def project(
    bench_report: dict, verify_report: dict, shape: str | None = None, drafter_ms: dict[int, float] | None = None
) -> tuple[str, list[ProjectedRow]]:
    """Projected tokens/s ratios for every speculative row of a benchmark report (see the module docstring);
    ``drafter_ms`` ({budget: ms per round}) replaces the bench's measured drafter time."""
    shape, curve = cost_curve(verify_report, shape)
    standard = {
        (r["task"], r["temperature"]): r for r in bench_report["results"] if r["method"] == "standard"
    }  # the reference of each speculative row
    rows = []
    for r in bench_report["results"]:
        reference = standard.get((r["task"], r["temperature"]))
        if r["budget"] is None or reference is None or not r["target_passes"]:
            continue
        budget = int(r["budget"])
        per_round = (drafter_ms or {}).get(budget, 1000.0 * r["draft_seconds"] / r["target_passes"])
        spot_ms = r["target_passes"] * (pass_cost_ms(curve, budget) + per_round)
        standard_ms = reference["target_passes"] * curve[1]
        rows.append(
            ProjectedRow(
                temperature=float(r["temperature"]),
                method=r["method"],
                budget=budget,
                passes_ratio=reference["target_passes"] / r["target_passes"],
                pass_cost_ratio=pass_cost_ms(curve, budget) / curve[1],
                drafter_ms=per_round,
                tokens_per_second_ratio=standard_ms / spot_ms,
            )
        )
    if not rows:
        raise ValueError("the benchmark report has no speculative row with a standard row beside it")
    return shape, rows


def format_projection(shape: str, rows: list[ProjectedRow], bench_machine: str, cost_machine: str) -> str:
    """The projection as text, labelled as such, with its inputs and the best budget per temperature."""
    lines = [
        f"PROJECTION (not a measurement) for a target of shape {shape}:",
        f"  acceptance and drafter time measured on: {bench_machine}",
        f"  pass cost measured on: {cost_machine}",
        f"{'T':>4} {'method':>10} {'budget':>6} {'passes x':>9} {'pass cost x':>12} {'drafter ms':>11} {'tok/s x':>8}",
    ]
    for row in rows:
        lines.append(
            f"{row.temperature:>4g} {row.method:>10} {row.budget:>6} {row.passes_ratio:>9.2f} "
            f"{row.pass_cost_ratio:>12.2f} {row.drafter_ms:>11.2f} {row.tokens_per_second_ratio:>8.2f}"
        )
    for temperature in sorted({row.temperature for row in rows}):
        best = max((r for r in rows if r.temperature == temperature), key=lambda r: r.tokens_per_second_ratio)
        lines.append(
            f"best budget at T={temperature:g}: {best.budget} ({best.method}, projected "
            f"{best.tokens_per_second_ratio:.2f}x standard's tokens/s)"
        )
    return "\n".join(lines)
