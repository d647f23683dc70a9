"""``spot-dlm bench`` on a real family's checkpoint (a stand-in): its remote code, its own block length."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest

from spot_dlm.cli import main
from spot_dlm.standins import build_standin

pytestmark = pytest.mark.usefixtures("remote_code_cache")
TINY = ["--methods", "standard,stale", "--budgets", "2", "--temperatures", "0", "--n-prompts", "2"]


@pytest.fixture(scope="module")
def sdar(tmp_path_factory) -> Path:
    return build_standin("sdar", tmp_path_factory.mktemp("sdar") / "sdar", hidden_size=32, block_size=4)


def test_bench_on_a_family_stand_in_decodes_with_the_trained_block_length(sdar: Path, tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a block length other than the trained one would warn
        code = main(
            ["bench", "--model", str(sdar), "--trust-remote-code", *TINY, "--gen-length", "8", "--json", str(out)]
        )
    assert code == 0
    report = json.loads(out.read_text())
    assert report["config"]["block_length"] is None and report["config"]["trust_remote_code"] is True
    assert [row["method"] for row in report["results"]] == ["standard", "stale"]
    assert all(row["exact_match_vs_standard"] == 1.0 and row["n_prompts"] == 2 for row in report["results"])
    assert "--trust-remote-code" in report["reproduce"] and "--block-length" not in report["reproduce"]


def test_bench_refuses_a_family_stand_in_without_trust_remote_code(sdar: Path, tmp_path: Path, capsys) -> None:
    assert main(["bench", "--model", str(sdar), *TINY, "--gen-length", "8"]) == 2
    assert "--trust-remote-code" in capsys.readouterr().err
