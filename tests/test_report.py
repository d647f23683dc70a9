"""``spot-dlm report``: benchmark JSON as Markdown; docs/results.md is what the command makes of docs/results/."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from spot_dlm.cli import main
from spot_dlm.report import drafter_description, results_markdown

ROOT = Path(__file__).resolve().parents[1]


def _row(method: str, budget, passes: int, ratio: float) -> dict:
    return {
        "task": "gsm8k",
        "temperature": 0.0,
        "method": method,
        "budget": budget,
        "target_passes": passes,
        "passes_ratio_vs_standard": ratio,
        "tokens_per_second": 10.0 * ratio,
        "throughput_ratio_vs_standard": ratio,
        "draft_seconds": 1.0,
        "wall_seconds": 4.0,
        "exact_match_vs_standard": 1.0,
        "accuracy": None,
    }


def test_a_report_becomes_a_section_named_by_its_question(tmp_path: Path) -> None:
    path = tmp_path / "cpu-speed" / "budget_16.json"
    path.parent.mkdir()
    report = {
        "config": {"device": "cpu", "model": None},
        "machine": "a test machine",
        "reproduce": "spot-dlm bench --budgets 16",
        "results": [_row("standard", None, 100, 1.0), _row("spot", 16, 25, 4.0)],
    }
    path.write_text(json.dumps(report))
    text = results_markdown([path])
    assert "## cpu speed / budget 16" in text and "spot-dlm bench --budgets 16" in text and "a test machine" in text
    assert "| gsm8k | 0 | spot | 16 | order model" in text and "| 25 | 4.00 |" in text and "| 25% |" in text
    assert "the built-in target (5.25M parameters)" in text


def test_drafter_descriptions_follow_the_defaults() -> None:
    assert drafter_description("standard", None, "cpu") == "-"
    assert drafter_description("spot", 2, "cpu") == "stale confidence (no order model)"
    assert drafter_description("spot", 16, "cpu").startswith("order model 107K")
    assert drafter_description("spot", 16, "cuda").startswith("order model 608K")
    assert "token LM 3.67M" in drafter_description("spot:token_lm=on", 64, "cpu")


def test_bad_reports_are_clear_errors(tmp_path: Path, capsys) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert main(["report", str(bad)]) == 2
    (tmp_path / "other.json").write_text("[1, 2]")
    assert main(["report", str(tmp_path / "other.json")]) == 2
    err = capsys.readouterr().err
    assert "not a readable benchmark report" in err and "not a benchmark report" in err
    with pytest.raises(ValueError, match="one or more"):
        results_markdown([])


def test_docs_results_is_what_the_report_command_makes() -> None:
    reports = sorted((ROOT / "docs" / "results").glob("*/*.json"))
    assert reports, "docs/results holds the reports the README's figures come from"
    relative = [path.relative_to(ROOT) for path in reports]
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(ROOT)
        expected = results_markdown(relative)
    assert (ROOT / "docs" / "results.md").read_text() == expected, "regenerate: spot-dlm report docs/results/*/*.json"
