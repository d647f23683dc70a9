"""``spot-dlm make-drafter``: a drafter for a model in one command, resumable, refused for another model."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest

from spot_dlm.cli import main
from spot_dlm.standins import build_standin

pytestmark = pytest.mark.usefixtures("remote_code_cache")
TINY = [
    "--n-prompts",
    "4",
    "--minutes",
    "0.03",
    "--gen-length",
    "16",
    "--survival-prompts",
    "2",
    "--check-prompts",
    "1",
]


def _make(model: str, out: Path, *extra: str) -> int:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return main(["make-drafter", "--model", model, "--out", str(out), *TINY, *extra])


def test_make_drafter_on_a_family_checkpoint_resumes_and_serves_generate(tmp_path: Path, capsys) -> None:
    folder = build_standin("sdar", tmp_path / "sdar", hidden_size=32)
    out = tmp_path / "drafter"
    assert _make(str(folder), out, "--trust-remote-code") == 0
    summary = json.loads((out / "make_drafter.json").read_text())
    assert summary["made_for"]["family"] == "sdar" and summary["check"]["exact"] is True
    assert (out / "drafter.safetensors").is_file() and (out / "calibration.json").is_file()
    trained = (out / "drafter.safetensors").stat().st_mtime_ns
    capsys.readouterr()
    assert _make(str(folder), out, "--trust-remote-code") == 0  # every stage already done: kept
    assert "order model already trained (kept)" in capsys.readouterr().out
    assert (out / "drafter.safetensors").stat().st_mtime_ns == trained
    args = ["generate", "--model", str(folder), "--trust-remote-code", "--prompt", "what is 3 + 4?", "--json"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert main([*args, "--gen-length", "16", "--method", "spot", "--drafter", str(out)]) == 0


def test_a_folder_made_for_another_model_is_refused(tmp_path: Path, checkpoint_dir: Path, capsys) -> None:
    out = tmp_path / "drafter"
    out.mkdir()
    record = {"made_for": {"model": "sdar", "vocab_size": 151936, "family": "sdar"}}
    (out / "make_drafter.json").write_text(json.dumps(record))
    assert _make(str(checkpoint_dir), out, "--block-length", "16") == 2
    assert "made for another model" in capsys.readouterr().err


def test_make_drafter_on_a_built_in_architecture_checkpoint(tmp_path: Path, checkpoint_dir: Path) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("what is 3 + 4?\nadd 5 and 6\nhalf of 10\ntwice 7\n")
    out = tmp_path / "drafter"
    assert _make(str(checkpoint_dir), out, "--block-length", "8", "--prompts", str(prompts)) == 0
    summary = json.loads((out / "make_drafter.json").read_text())
    assert summary["made_for"]["family"] == "builtin"
    assert summary["check"]["questions"] == 0 or summary["check"]["exact"] is True
    assert summary["held_out_next_commit_accuracy_by_depth"]
