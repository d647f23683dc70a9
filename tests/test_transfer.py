"""Drafter transfer (``spot_dlm.bench.transfer``): held-out accuracy of any drafter on a target's trajectories, bench
rows per drafter on one target, and the table made from the reports."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from spot_dlm.bench.run import BenchConfig
from spot_dlm.bench.transfer import heldout_accuracy, heldout_prompt_mask, run_transfer, transfer_table
from spot_dlm.cli import main
from spot_dlm.drafters.folder import save_order_model
from spot_dlm.drafters.order_net import OrderModel, OrderModelConfig
from spot_dlm.models.builtin import BuiltinTarget
from spot_dlm.report import results_markdown
from spot_dlm.train.collect import CollectConfig, collect
from spot_dlm.train.drafter import train_drafter

ORDER_ONLY = "spot:order_model=paper:token_survival=off:neighbour_tokens=off"


@pytest.fixture(scope="module")
def target(tiny_codec, model_factory) -> BuiltinTarget:
    """Vocabulary of the conftest tokenizer, context long enough for GSM8K questions."""
    return BuiltinTarget(model_factory(vocab_size=tiny_codec.vocab_size, seed=3, dtype=torch.float32, max_seq_len=512))


@pytest.fixture(scope="module")
def shards(tmp_path_factory, target, tiny_codec) -> Path:
    out = tmp_path_factory.mktemp("transfer") / "trajectories"
    collect(target, tiny_codec, CollectConfig(out_dir=out, n_prompts=20, block_length=8, gen_length=16))
    return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory, shards) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("transfer") / "own"
    metrics = train_drafter(shards, out, minutes=0.02, temperature_feature=True, shape=(32, 1, 4))
    return out, metrics


def test_the_held_out_prompts_are_a_tenth_chosen_by_the_seed() -> None:
    ids = np.repeat(np.arange(30), 3)
    held = heldout_prompt_mask(ids, seed=0)
    assert len(np.unique(ids[held])) == 3 and held.sum() == 9
    assert not np.array_equal(held, heldout_prompt_mask(ids, seed=1))


def test_a_trained_drafter_scores_what_its_training_reported(trained, shards) -> None:
    folder, metrics = trained
    scored = heldout_accuracy(folder, shards)
    assert scored["next_commit_accuracy_by_depth"] == metrics["heldout_next_commit_accuracy_by_depth"]
    assert scored["heldout_examples"] == metrics["heldout_examples"]
    assert scored["parameters"] == metrics["parameters"]
    by_t = metrics["heldout_naive_accuracy_by_temperature_and_depth"]
    assert scored["stale_confidence_accuracy_by_temperature_and_depth"] == by_t


def test_another_drafter_is_scored_on_the_same_examples(tmp_path: Path, trained, shards) -> None:
    torch.manual_seed(1)
    other = tmp_path / "other"
    save_order_model(OrderModel(OrderModelConfig(d_model=32, n_layers=1, n_heads=4, temperature_feature=True)), other)
    scored, own = heldout_accuracy(other, shards), heldout_accuracy(trained[0], shards)
    assert scored["heldout_examples"] == own["heldout_examples"]
    assert scored["next_commit_accuracy_by_depth"] != own["next_commit_accuracy_by_depth"]
    with pytest.raises(FileNotFoundError, match="no trajectory shards"):
        heldout_accuracy(other, tmp_path)


def test_rows_of_each_drafter_and_the_table(tmp_path: Path, target, tiny_codec, trained, shards) -> None:
    bench = BenchConfig(
        methods=("standard", "spot:order_model=paper", ORDER_ONLY),
        budgets=(2, 4),
        temperatures=(0.0,),
        n_prompts=1,
        block_length=8,
        gen_length=16,
    )
    with warnings.catch_warnings():  # the shipped bigram table counts another vocabulary: left out
        warnings.simplefilter("ignore")
        report = run_transfer(
            target, tiny_codec, bench, {"shipped": "builtin", "own": str(trained[0])}, str(shards), "tiny"
        )
    rows = report["results"]
    assert [r["method"] for r in rows].count("standard") == 1
    standard = rows[0]["target_passes"]
    spot = [r for r in rows if r["method"] != "standard"]
    assert len(spot) == 2 * 2 * 2 and all(r["exact_match_vs_standard"] == 1.0 for r in spot)
    assert all(r["passes_ratio_vs_standard"] == standard / r["target_passes"] for r in spot)
    described = {(r["drafter_name"], r["method"]): r["drafter"] for r in spot}
    assert described["shipped", "spot:order_model=paper"] == "shipped: order model 608K + token survival"
    assert described["shipped", ORDER_ONLY] == "shipped: order model 608K"
    assert described["own", "spot:order_model=paper"].startswith("own: order model ")  # no fits in its folder
    drafters = report["transfer"]["drafters"]
    assert drafters["shipped"]["parameters"] == 608129 and not report["transfer"]["vocabulary_shared_with_builtin"]
    own_accuracy = drafters["own"]["heldout_accuracy"]["next_commit_accuracy_by_depth"]
    assert own_accuracy == trained[1]["heldout_next_commit_accuracy_by_depth"]

    path = tmp_path / "tiny_budgets.json"
    path.write_text(json.dumps(report))
    table = transfer_table([path])
    lines = table.splitlines()
    assert lines[0].endswith("| passes x, budget 2 | passes x, budget 4 |")
    assert len(lines) == 2 + 3  # the own folder holds no fit: its two rows ran the same parts, one line
    shipped_t0 = drafters["shipped"]["heldout_accuracy"]["next_commit_accuracy_by_temperature_and_depth"]["0"][1]
    ratio = next(r for r in spot if r["drafter_name"] == "shipped" and r["budget"] == 4)["passes_ratio_vs_standard"]
    assert f"| tiny | 0 | shipped | order model 608K + token survival | 608K | {shipped_t0:.2f} |" in table
    assert f"| {ratio:.2f} |" in table
    section = results_markdown([path])  # docs/results.md: each row's drafter as the report records it
    own_size = f"{drafters['own']['parameters'] / 1e3:.0f}K"
    assert (
        f"| own: order model {own_size} |" in section and "| shipped: order model 608K + token survival |" in section
    )


def test_the_table_refuses_other_reports(tmp_path: Path, capsys) -> None:
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"config": {}, "results": []}))
    with pytest.raises(ValueError, match="not a transfer report"):
        transfer_table([path])
    with pytest.raises(ValueError, match="one or more"):
        transfer_table([])
    assert main(["transfer", "table", str(path)]) == 2
    assert "not a transfer report" in capsys.readouterr().err


def test_the_transfer_page_holds_the_table_of_its_reports() -> None:
    root = Path(__file__).resolve().parents[1]
    reports = sorted((root / "docs" / "results" / "transfer").glob("*.json"))
    assert reports, "docs/results/transfer holds the reports of docs/experiments/transfer.md"
    page = (root / "docs" / "experiments" / "transfer.md").read_text()
    assert transfer_table(reports) in page, "regenerate: spot-dlm transfer table docs/results/transfer/*.json"


def test_the_run_command_writes_a_report_with_its_command(tmp_path: Path, long_checkpoint, trained, capsys) -> None:
    out = tmp_path / "report.json"
    args = ["transfer", "run", "--model", str(long_checkpoint), "--name", "long", "--drafter", f"own={trained[0]}"]
    args += ["--trained-on", "own=another target, 20 prompts", "--methods", "standard,spot:order_model=paper"]
    args += ["--budgets", "2", "--temperatures", "0", "--n-prompts", "1", "--block-length", "8", "--gen-length", "16"]
    assert main([*args, "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert "'own=another target, 20 prompts'" in report["reproduce"][0]
    assert report["transfer"]["drafters"]["own"]["trained_on"] == "another target, 20 prompts"
    assert "| long | 0 | own | order model" in capsys.readouterr().out
    assert main([*args, "--json", str(out)]) == 2
    assert "exists" in capsys.readouterr().err
