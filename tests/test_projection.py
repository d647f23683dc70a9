"""``spot-dlm project``: measured acceptance x a measured pass-cost curve, labelled as a projection."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from spot_dlm.bench.projection import cost_curve, pass_cost_ms, project
from spot_dlm.bench.verify_cost import VerifyCostConfig, measure_verify_cost
from spot_dlm.cli import main


def _bench_row(method: str, budget, passes: int, draft_seconds: float = 0.0, temperature: float = 0.0) -> dict:
    return {
        "task": "gsm8k",
        "temperature": temperature,
        "method": method,
        "budget": budget,
        "target_passes": passes,
        "draft_seconds": draft_seconds,
    }


BENCH = {
    "config": {"device": "cpu"},
    "machine": "bench machine",
    "results": [_bench_row("standard", None, 100), _bench_row("spot", 2, 50, 0.1), _bench_row("spot", 8, 25, 0.5)],
}
COST = {
    "machine": "cost machine",
    "results": [
        {"shape": "big", "nodes": n, "ms_per_pass": ms} for n, ms in ((1, 10.0), (2, 10.0), (4, 12.0), (16, 30.0))
    ],
}


def test_pass_cost_interpolates_and_extends_the_curve() -> None:
    curve = {1: 10.0, 4: 16.0, 8: 20.0}
    assert pass_cost_ms(curve, 4) == 16.0 and pass_cost_ms(curve, 2) == 12.0 and pass_cost_ms(curve, 16) == 28.0


def test_projection_combines_passes_with_pass_and_drafter_cost() -> None:
    shape, rows = project(BENCH, COST)
    assert shape == "big"
    two, eight = rows
    assert two.passes_ratio == 2.0 and two.drafter_ms == pytest.approx(2.0)  # 0.1 s over 50 rounds
    assert two.tokens_per_second_ratio == pytest.approx(100 * 10.0 / (50 * (10.0 + 2.0)))
    assert eight.pass_cost_ratio == pytest.approx(1.8)  # 18 ms between 12 (4 nodes) and 30 (16 nodes)
    _, given = project(BENCH, COST, drafter_ms={8: 0.0})
    assert given[1].tokens_per_second_ratio == pytest.approx(100 * 10.0 / (25 * 18.0))
    with pytest.raises(ValueError, match="not in the cost report"):
        cost_curve(COST, "huge")


def test_project_runs_on_a_small_shape_measured_on_this_cpu(tmp_path: Path, capsys) -> None:
    config = VerifyCostConfig(shapes=("d64-l2-h2-v256",), nodes=(1, 2, 4), prefix_length=16, block_length=8, repeats=2)
    cost = tmp_path / "cost.json"
    cost.write_text(json.dumps(measure_verify_cost(config, progress=False)))
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps(BENCH))
    assert main(["project", "--bench", str(bench), "--verify-cost", str(cost), "--drafter-ms", "2:0.5,8:1"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("PROJECTION (not a measurement) for a target of shape d64-l2-h2-v256")
    assert "best budget at T=0:" in out and "bench machine" in out
    assert main(["project", "--bench", str(bench), "--verify-cost", str(cost), "--drafter-ms", "two"]) == 2
    assert "budget:ms pairs" in capsys.readouterr().err
