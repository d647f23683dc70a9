"""Several processes under torchrun: the rank helpers, and ``collect`` / ``bench`` run by two CPU processes giving
what one process gives (same shards array for array; same rows and per-prompt tokens and passes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from spot_dlm.cli import main
from spot_dlm.distributed import (
    Group,
    check_rank_device,
    gather_outcomes,
    interleave,
    launched_group,
    local_device,
    process_group,
)
from spot_dlm.models.builtin import BuiltinTarget
from spot_dlm.train.collect import PromptLog, TrajectoryLog, collect_shard, logged_config, merge_prompt_logs

torch.set_num_threads(1)

TIMED = {"wall_seconds", "draft_seconds", "tokens_per_second", "throughput_ratio_vs_standard"}
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]


# ------------------------------------------------------------------------------------------------ helpers


def test_launched_group_reads_torchrun_variables() -> None:
    assert launched_group({}) is None
    assert launched_group({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}) == Group(1, 2, 1)
    assert launched_group({"RANK": "0"}) is None  # set for another reason: not torchrun's
    with pytest.raises(ValueError, match="whole numbers"):
        launched_group({"RANK": "0", "WORLD_SIZE": "two", "LOCAL_RANK": "0"})
    with pytest.raises(ValueError, match="out of range"):
        launched_group({"RANK": "2", "WORLD_SIZE": "2", "LOCAL_RANK": "0"})


def test_shares_cover_every_item_once_and_interleave_restores_the_order() -> None:
    items = list(range(7))
    for world in (1, 2, 3, 8):
        shares = [[items[i] for i in Group(rank, world).share(len(items))] for rank in range(world)]
        assert sorted(x for share in shares for x in share) == items
        assert interleave(shares) == items


def test_interleave_stops_at_the_first_prompt_a_rank_left_unfinished() -> None:
    assert interleave([[0, 2, 4], [1]]) == [0, 1, 2]
    assert interleave([[0], [1, 3, 5]]) == [0, 1]
    assert interleave([[], [1]]) == []


def test_each_rank_owns_the_gpu_of_its_local_rank() -> None:
    check_rank_device(torch.device("cuda:1"), Group(1, 2, 1))
    check_rank_device(torch.device("cuda"), Group(1, 2, 1))
    check_rank_device(torch.device("cpu"), Group(1, 2, 1))
    check_rank_device(torch.device("cuda:1"), Group())  # one process: any GPU
    with pytest.raises(ValueError, match="--device cuda"):
        check_rank_device(torch.device("cuda:1"), Group(0, 2, 0))


def test_a_single_process_has_no_process_group(monkeypatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    with process_group("cpu") as group:
        assert group == Group() and group.is_main
        assert not torch.distributed.is_initialized()
        assert gather_outcomes(lambda: 5) == [5]
    assert local_device("cpu") == torch.device("cpu")


def test_merged_prompt_logs_equal_one_log_of_the_whole_shard(tiny_codec, model_factory) -> None:
    """Prompts logged apart (as ranks log their shares) and merged give the arrays of one sequential log, block ids
    included."""
    target = BuiltinTarget(model_factory(vocab_size=tiny_codec.vocab_size, seed=4, dtype=torch.float32))
    prompts = ["what is 3 + 4?", "the cat sat on mat number 6", "what is 7 + 1?"]
    from spot_dlm.train.collect import CollectConfig

    config = logged_config(CollectConfig(Path("unused"), n_prompts=3, block_length=8, gen_length=16), 1.0, 0.9)
    whole = TrajectoryLog(depth=4, temperature=1.0)
    collect_shard(target, tiny_codec, config, prompts, range(3), whole)
    parts = []
    for prompt_id in (2, 0, 1):  # any order: merged by prompt id
        one = TrajectoryLog(depth=4, temperature=1.0)
        blocks = collect_shard(target, tiny_codec, config, prompts, range(prompt_id, prompt_id + 1), one)
        parts.append(PromptLog(prompt_id, one.arrays(), blocks))
    merged, expected = merge_prompt_logs(parts), whole.arrays()
    assert set(merged) == set(expected)
    for name, array in expected.items():
        assert np.array_equal(merged[name], array), name
    assert len(np.unique(merged["block_id"])) == 3 * 2  # two blocks of 8 per prompt, ids distinct across prompts


# -------------------------------------------------------------------------------------------------- torchrun


def torchrun(*argv: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """``argv`` run by two CPU processes under torchrun (one intra-op thread each, as the 1-process runs)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    return subprocess.run([*TORCHRUN, *argv], capture_output=True, text=True, env=env, timeout=timeout)


def test_collect_under_torchrun_writes_the_shards_of_one_process(tmp_path: Path) -> None:
    args = ["collect", "--n-prompts", "3", "--temperatures", "0,1", "--block-length", "8", "--gen-length", "16"]
    args += ["--depth", "4", "--threads", "1"]
    assert main([*args, "--out", str(tmp_path / "one")]) == 0
    run = torchrun("-m", "spot_dlm", *args, "--out", str(tmp_path / "two"))
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.count("shards in") == 1  # rank 0 alone prints
    one = sorted(p.name for p in (tmp_path / "one").glob("shard_*.npz"))
    assert one == sorted(p.name for p in (tmp_path / "two").glob("shard_*.npz")) and len(one) == 2
    for name in one:
        with np.load(tmp_path / "one" / name) as single, np.load(tmp_path / "two" / name) as split:
            assert set(single) == set(split)
            assert len(np.unique(single["prompt_id"])) == 3
            for key in single:
                assert np.array_equal(single[key], split[key]), (name, key)
    records = [json.loads((tmp_path / run / "collect_config.json").read_text()) for run in ("one", "two")]
    assert [{**record, "out_dir": None} for record in records] == [{**records[0], "out_dir": None}] * 2


def untimed(report: dict) -> dict:
    """The report less what depends on timing, the process count and the date of the run."""
    rows = [{k: v for k, v in row.items() if k not in TIMED} for row in report["results"]]
    rest = {k: v for k, v in report.items() if k not in ("results", "processes", "reproduce")}
    return {**rest, "results": rows, "reproduce": report["reproduce"].split("  (at ")[0]}


def test_bench_under_torchrun_reports_what_one_process_reports(tmp_path: Path, capsys) -> None:
    args = ["bench", "--methods", "standard,spot,oracle,stale-sets", "--budgets", "2", "--temperatures", "0,1"]
    args += ["--n-prompts", "3", "--block-length", "8", "--gen-length", "16", "--threads", "1"]
    assert main([*args, "--json", str(tmp_path / "one.json")]) == 0
    capsys.readouterr()
    run = torchrun("-m", "spot_dlm", *args, "--json", str(tmp_path / "two.json"))
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.count("# reproduce:") == 1  # rank 0 alone prints
    single, split = (json.loads((tmp_path / name).read_text()) for name in ("one.json", "two.json"))
    assert split["processes"] == 2 and "processes" not in single
    assert untimed(split) == untimed(single)
    rows = single["results"]
    assert len(rows) == 2 * 5 and all(row["n_prompts"] == 3 for row in rows)
    assert all(len(set(row["tokens_digest_per_prompt"])) > 1 for row in rows)  # prompts decoded apart


def test_a_failure_on_one_rank_stops_every_rank(tmp_path: Path) -> None:
    """Rank 1 fails inside its share: rank 0, waiting at the gather, gets the failure instead of waiting on."""
    script = tmp_path / "fail.py"
    script.write_text(
        "from spot_dlm.distributed import gather_outcomes, process_group\n"
        "with process_group('cpu') as group:\n"
        "    gather_outcomes(lambda: 1 / 0 if group.rank == 1 else 5)\n"
    )
    run = torchrun(str(script), timeout=120)
    assert run.returncode != 0
    assert "RankFailed: rank 1 failed: ZeroDivisionError: division by zero" in run.stderr


# ------------------------------------------------------------------------------------- larger than one GPU


def test_a_device_map_goes_to_from_pretrained_in_place_of_a_device(tmp_path: Path, monkeypatch, remote_code_cache):
    """``device_map`` (accelerate's placement over several GPUs) reaches the authors' ``from_pretrained`` through
    ``load_target``, and the model it places is not moved to one device after; a built-in model refuses one."""
    import transformers

    from spot_dlm.api import load_target
    from spot_dlm.models.families import detect_family, read_json
    from spot_dlm.standins import build_standin

    folder = build_standin("sdar", tmp_path / "sdar", hidden_size=32)
    config = read_json(folder / "config.json")
    family = detect_family(config)
    auto_class = getattr(transformers, family.auto_class)
    real, asked = auto_class.from_pretrained, []

    def placed(*args, device_map=None, **kwargs):  # accelerate places nothing here: record the map, load as usual
        asked.append(device_map)
        model = real(*args, **kwargs)
        if device_map is not None:
            monkeypatch.setattr(model, "to", lambda *a, **k: pytest.fail("a placed model was moved"))
        return model

    monkeypatch.setattr(auto_class, "from_pretrained", placed)
    target, _ = load_target(folder, hf_options={"trust_remote_code": True, "device_map": "auto"})
    assert asked == ["auto"] and target.device == torch.device("cpu")
    load_target(folder, hf_options={"trust_remote_code": True})
    assert asked == ["auto", None]
    with pytest.raises(ValueError, match="transformers checkpoint"):
        load_target("builtin", hf_options={"device_map": "auto"})


def test_cli_refuses_a_device_map_for_the_built_in_target(capsys) -> None:
    assert main(["generate", "--prompt", "what is 3 + 4?", "--device-map", "auto"]) == 2
    assert "transformers checkpoint" in capsys.readouterr().err
    assert main(["demo", "--device-map", "auto", "--no-plot"]) == 2
