"""Safe by default: inputs and output paths are checked before any work, nothing trained or measured is replaced
without --force, Ctrl-C keeps what finished (exit 130), and decoding is safe from several threads on one target."""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from spot_dlm import cli
from spot_dlm.api import GenerateConfig, generate, load_target
from spot_dlm.drafters.folder import default_drafter_dir, load_order_model
from spot_dlm.drafters.order_net import OrderModel, OrderModelConfig
from spot_dlm.drafters.spot import SpotDrafter
from spot_dlm.models.builtin import BuiltinTarget
from spot_dlm.models.checkpoint import TOKENIZER_FILE, load_model, load_training_state
from spot_dlm.models.tokenizer import TextCodec, train_tokenizer
from spot_dlm.noise import NoiseKey
from spot_dlm.safety import MAX_DRAFT_TOKENS
from spot_dlm.train.collect import CollectConfig, collect
from spot_dlm.train.drafter import train_drafter

SMALL_TARGET = ["--d-model", "32", "--n-layers", "1", "--n-heads", "2", "--batch-size", "2", "--threads", "1"]


def run_cli(capsys, *argv: str) -> tuple[int, str]:
    """Exit code and the last line of stderr (progress bars aside)."""
    code = cli.main(list(argv))
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, err.strip().splitlines()[-1] if err.strip() else ""


def folder_bytes(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def interrupt_on_call(real, call: int):
    """``real``, except that its ``call``-th call raises KeyboardInterrupt (as Ctrl-C would)."""
    calls = [0]

    def wrapped(*args, **kwargs):
        calls[0] += 1
        if calls[0] == call:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    return wrapped


def make_corpus(folder: Path, codec: TextCodec) -> Path:
    """A corpus folder as prepare-data writes it: tokenizer, train and held-out token streams."""
    folder.mkdir(parents=True)
    codec.save(folder / TOKENIZER_FILE)
    rng = np.random.default_rng(0)
    for name, length in (("train_tokens.npy", 4000), ("heldout_tokens.npy", 1000)):
        np.save(folder / name, rng.integers(3, codec.vocab_size, size=length).astype(np.uint16))
    return folder


@pytest.fixture
def corpus(tmp_path: Path, tiny_codec: TextCodec) -> Path:
    return make_corpus(tmp_path / "corpus", tiny_codec)


@pytest.fixture
def trained(tmp_path: Path, checkpoint_dir: Path) -> Path:
    """A copy of a trained checkpoint (the conftest tokenizer's vocabulary)."""
    return Path(shutil.copytree(checkpoint_dir, tmp_path / "trained"))


# ------------------------------------------------------------------------------------------------ train-target


def test_train_target_refuses_a_corpus_of_another_tokenizer(capsys, tmp_path: Path, trained: Path) -> None:
    other = TextCodec(train_tokenizer(["another corpus, another vocabulary: 1 2 3"] * 20, vocab_size=280))
    other_corpus = make_corpus(tmp_path / "other", other)
    before = folder_bytes(trained)
    argv = ["train-target", "--out", str(trained), "--corpus", str(other_corpus), "--minutes", "0.01", *SMALL_TARGET]
    code, line = run_cli(capsys, *argv)
    assert code == 2 and "another tokenizer" in line and "--force" in line
    assert folder_bytes(trained) == before
    assert cli.main([*argv, "--force"]) == 0  # a new model with the new tokenizer replaces it
    assert load_model(trained).config.vocab_size == other.vocab_size
    assert TextCodec.from_file(trained / TOKENIZER_FILE).vocab_size == other.vocab_size
    assert len((trained / "train_log.jsonl").read_text().splitlines()) == 1  # the replaced model's log is gone


def test_train_target_refuses_to_resume_a_block_diffusion_checkpoint_in_phase_ar(
    capsys, corpus: Path, trained: Path
) -> None:
    (trained / "training_state.json").write_text(json.dumps({"runs": 2, "last_phase": "bd"}))
    before = folder_bytes(trained)
    argv = ["train-target", "--out", str(trained), "--corpus", str(corpus), "--minutes", "0.01", *SMALL_TARGET]
    code, line = run_cli(capsys, *argv)
    assert code == 2 and "block-diffusion phase" in line and "--phase bd" in line
    assert folder_bytes(trained) == before


def test_train_target_refuses_an_init_it_would_ignore(capsys, corpus: Path, trained: Path, checkpoint_dir) -> None:
    other = Path(shutil.copytree(checkpoint_dir, trained.parent / "other"))
    argv = ["train-target", "--out", str(trained), "--corpus", str(corpus), "--init", str(other), "--minutes", "0.01"]
    code, line = run_cli(capsys, *argv, *SMALL_TARGET)
    assert code == 2 and "already holds a checkpoint" in line


@pytest.mark.parametrize("minutes", ["nan", "inf"])
def test_train_target_minutes_are_checked_before_any_file_is_made(
    capsys, corpus: Path, tmp_path: Path, minutes: str
) -> None:
    out = tmp_path / "run"
    code, line = run_cli(capsys, "train-target", "--out", str(out), "--corpus", str(corpus), "--minutes", minutes)
    assert code == 2 and "--minutes must be a finite number > 0" in line
    assert not out.exists()


def test_train_target_ctrl_c_saves_a_snapshot(capsys, monkeypatch, corpus: Path, tmp_path: Path) -> None:
    import spot_dlm.train.target as target_module

    monkeypatch.setattr(target_module, "phase_loss", interrupt_on_call(target_module.phase_loss, 3))
    out = tmp_path / "run"
    argv = ["train-target", "--out", str(out), "--corpus", str(corpus), "--minutes", "5", *SMALL_TARGET]
    code, line = run_cli(capsys, *argv)
    assert code == 130 and line.startswith("spot-dlm: interrupted; saved a snapshot of step 2")
    assert load_model(out).config.d_model == 32 and load_training_state(out)["runs"] == 1


# ----------------------------------------------------------------------------------------------- train-drafter


@pytest.fixture(scope="module")
def shards(tmp_path_factory, tiny_codec, model_factory) -> Path:
    """Trajectory shards of two prompts, one per shard."""
    model = model_factory(vocab_size=tiny_codec.vocab_size, seed=3, dtype=torch.float32, max_seq_len=512)
    out = tmp_path_factory.mktemp("safety") / "shards"
    config = CollectConfig(out, n_prompts=2, prompts_per_shard=1, temperatures=(0.0,), block_length=8, gen_length=16)
    collect(BuiltinTarget(model), tiny_codec, config)
    return out


@pytest.fixture
def drafter_folder(shards: Path, tmp_path: Path) -> Path:
    """A trained drafter with the fits made for it beside it."""
    folder = tmp_path / "drafter"
    train_drafter(shards, folder, minutes=0.005, max_depth=4)
    for name in ("bigram.safetensors", "token_survival.json", "token_survival_neighbours.json"):
        (folder / name).write_text("fitted for this drafter")
    (folder / "small").mkdir()
    (folder / "small" / "drafter_config.json").write_text("{}")
    return folder


def test_train_drafter_replaces_a_trained_drafter_only_with_force(capsys, shards, drafter_folder: Path) -> None:
    before = folder_bytes(drafter_folder)
    argv = ["train-drafter", "--shards", str(shards), "--out", str(drafter_folder), "--minutes", "0.005"]
    code, line = run_cli(capsys, *argv, "--depth", "4")
    assert code == 2 and "already holds a trained drafter" in line
    assert folder_bytes(drafter_folder) == before
    assert cli.main([*argv, "--depth", "4", "--init", str(drafter_folder)]) == 0  # continuing it keeps its fits
    assert (drafter_folder / "bigram.safetensors").is_file()
    assert cli.main([*argv, "--depth", "4", "--force"]) == 0
    left = {p.name for p in drafter_folder.iterdir()}
    assert left == {"drafter.safetensors", "drafter_config.json", "drafter_metrics.json", "calibration.json"}
    metrics = json.loads((drafter_folder / "drafter_metrics.json").read_text())
    assert set(metrics["removed"]) == {
        "bigram.safetensors",
        "token_survival.json",
        "token_survival_neighbours.json",
        "calibration.json",
        "small",
    }


def test_train_drafter_bad_input_is_refused_before_anything_is_written(capsys, shards, tmp_path: Path) -> None:
    out = tmp_path / "drafter"
    argv = ["train-drafter", "--shards", str(shards), "--out", str(out), "--depth", "4"]
    code, line = run_cli(capsys, *argv, "--minutes", "0")
    assert code == 2 and "--minutes must be a finite number > 0" in line
    one = tmp_path / "one-prompt"
    one.mkdir()
    shutil.copy(sorted(shards.glob("shard_*.npz"))[0], one)
    code, line = run_cli(capsys, "train-drafter", "--shards", str(one), "--out", str(out), "--minutes", "0.01")
    assert code == 2 and "hold 1 prompt(s); training needs at least 2" in line
    code, line = run_cli(capsys, "train-drafter", "--shards", str(tmp_path / "none"), "--out", str(out))
    assert code == 2 and "no trajectory shards" in line
    sets = default_drafter_dir().parent / "sets_drafter"
    code, line = run_cli(capsys, *argv, "--minutes", "0.01", "--init", str(sets))
    assert code == 2 and "holds a SPOT-Sets model" in line
    assert not out.exists()


def test_train_drafter_ctrl_c_keeps_the_model_trained_so_far(capsys, monkeypatch, shards, tmp_path: Path) -> None:
    import spot_dlm.train.drafter as drafter_module

    monkeypatch.setattr(drafter_module, "objective_loss", interrupt_on_call(drafter_module.objective_loss, 3))
    out = tmp_path / "drafter"
    code, line = run_cli(
        capsys, "train-drafter", "--shards", str(shards), "--out", str(out), "--minutes", "5", "--depth", "4"
    )
    assert code == 130 and line == f"spot-dlm: interrupted; saved the drafter after 2 steps in {out}"
    assert json.loads((out / "drafter_metrics.json").read_text())["interrupted"] is True
    load_order_model(out)


# ---------------------------------------------------------------------------------------------------- collect


def test_collect_ctrl_c_keeps_the_finished_shards(monkeypatch, shards, tiny_codec, model_factory, tmp_path) -> None:
    import spot_dlm.train.collect as collect_module

    monkeypatch.setattr(collect_module, "collect_shard", interrupt_on_call(collect_module.collect_shard, 2))
    model = model_factory(vocab_size=tiny_codec.vocab_size, seed=3, dtype=torch.float32, max_seq_len=512)
    out = tmp_path / "shards"
    config = CollectConfig(out, n_prompts=2, prompts_per_shard=1, temperatures=(0.0,), block_length=8, gen_length=16)
    with pytest.raises(KeyboardInterrupt, match=r"kept 1 finished shard\(s\)"):
        collect(BuiltinTarget(model), tiny_codec, config)
    assert [p.name for p in out.glob("shard_*.npz")] == ["shard_T0_tau0.9_00000.npz"]
    assert json.loads((out / "collect_config.json").read_text())["n_prompts"] == 1  # what the shards hold


# ------------------------------------------------------------------------------------------------------ bench


def bench_argv(model: Path, *extra: str) -> list[str]:
    return [
        "bench",
        "--model",
        str(model),
        "--methods",
        "standard,stale",
        "--budgets",
        "2",
        "--temperatures",
        "0",
        "--n-prompts",
        "3",
        "--block-length",
        "8",
        "--gen-length",
        "16",
        *extra,
    ]


@pytest.fixture
def no_bench_run(monkeypatch):
    """Fails the test if the benchmark starts."""
    import spot_dlm.bench.run as bench_run

    def never(*args, **kwargs):
        raise AssertionError("the benchmark ran before its outputs were checked")

    monkeypatch.setattr(bench_run, "run_bench", never)


def test_bench_outputs_are_checked_before_it_runs(capsys, no_bench_run, long_checkpoint, tmp_path: Path) -> None:
    a_file = tmp_path / "a-file"
    a_file.write_text("not a folder")
    code, line = run_cli(capsys, *bench_argv(long_checkpoint, "--json", str(a_file / "report.json")))
    assert code == 2 and "is a file, not a folder" in line
    code, line = run_cli(capsys, *bench_argv(long_checkpoint, "--plots", str(a_file)))
    assert code == 2 and "is a file, not a folder" in line
    report = tmp_path / "report.json"
    report.write_text('{"results": "measured before"}')
    code, line = run_cli(capsys, *bench_argv(long_checkpoint, "--json", str(report)))
    assert code == 2 and "exists: give --force" in line
    assert report.read_text() == '{"results": "measured before"}'
    plots = tmp_path / "plots"
    plots.mkdir()
    (plots / "acceptance_by_depth.png").write_bytes(b"an earlier plot")
    code, line = run_cli(capsys, *bench_argv(long_checkpoint, "--plots", str(plots)))
    assert code == 2 and "already holds acceptance_by_depth.png" in line
    code, line = run_cli(capsys, *bench_argv(long_checkpoint, "--seed", str(2**64)))
    assert code == 2 and "seed must be an integer in [0, 2**64)" in line
    code, line = run_cli(capsys, *bench_argv(long_checkpoint, "--methods", "standard,bogus"))
    assert code == 2 and "unknown method 'bogus'" in line


def test_bench_ctrl_c_writes_the_rows_finished(capsys, monkeypatch, long_checkpoint: Path, tmp_path: Path) -> None:
    import spot_dlm.bench.run as bench_run

    # two warm-ups, two settings on prompt 0, then Ctrl-C on prompt 1
    monkeypatch.setattr(bench_run, "generate", interrupt_on_call(bench_run.generate, 5))
    report = tmp_path / "report.json"
    code, line = run_cli(capsys, *bench_argv(long_checkpoint, "--json", str(report)))
    assert code == 130
    assert line == f"spot-dlm: interrupted; kept 2 row(s) of the prompts finished, written to {report}"
    saved = json.loads(report.read_text())
    assert saved["interrupted"] is True
    assert [(r["method"], r["n_prompts"]) for r in saved["results"]] == [("standard", 1), ("stale", 1)]


# ------------------------------------------------------------------------------------------- decoding bounds


def test_a_budget_beyond_what_a_pass_can_hold_is_refused(capsys) -> None:
    with pytest.raises(ValueError, match="tokens scored per pass"):
        GenerateConfig(method="spot", budget=100_000)
    GenerateConfig(method="spot", block_length=32, gen_length=64, budget=MAX_DRAFT_TOKENS // 32)
    with pytest.raises(ValueError, match="give a budget of at most 512"):
        GenerateConfig(method="spot", block_length=32, gen_length=64, budget=MAX_DRAFT_TOKENS // 32 + 1)
    code, line = run_cli(capsys, "generate", "--method", "spot", "--budget", "100000", "--prompt", "What is 3 + 4?")
    assert code == 2 and "tokens scored per pass" in line


def test_seeds_beyond_the_noise_keys_64_bits_are_refused() -> None:
    GenerateConfig(seed=2**64 - 1)
    for seed in (2**64, 5 + 2**64, -1):
        with pytest.raises(ValueError, match=r"seed must be an integer in \[0, 2\*\*64\)"):
            GenerateConfig(seed=seed)
        with pytest.raises(ValueError, match="seed"):
            NoiseKey(seed)


def copy_files(source: Path, folder: Path, names: tuple[str, ...]) -> Path:
    folder.mkdir()
    for name in names:
        shutil.copy(source / name, folder / name)
    return folder


def test_a_drafter_folder_must_hold_the_kind_and_parts_the_method_reads(tmp_path: Path) -> None:
    sets_folder = default_drafter_dir().parent / "sets_drafter"
    with pytest.raises(ValueError, match="holds a SPOT-Sets model"):
        GenerateConfig(method="spot", drafter=str(sets_folder))
    with pytest.raises(ValueError, match="holds a SPOT order model"):
        GenerateConfig(method="spot-sets", drafter=str(default_drafter_dir()))
    plain = copy_files(default_drafter_dir(), tmp_path / "plain", ("drafter.safetensors", "drafter_config.json"))
    GenerateConfig(method="spot", drafter=str(plain))
    with pytest.raises(ValueError, match="--token-lm: .* has no token LM"):
        GenerateConfig(method="spot", drafter=str(plain), token_lm=True)
    with pytest.raises(ValueError, match="no small order model"):
        GenerateConfig(method="spot", drafter=str(plain), order_model="small")
    with pytest.raises(FileNotFoundError, match="drafter folder not found"):
        GenerateConfig(method="spot", drafter=str(tmp_path / "nowhere"))
    GenerateConfig(method="spot", token_lm=True, order_model="small")  # the shipped folder has both
    with pytest.raises(ValueError, match="SPOT-Sets model"):
        SpotDrafter(OrderModel(OrderModelConfig(threshold_feature=True)))


# ------------------------------------------------------------------------------------------ threads and writes


def test_spot_decoding_is_safe_from_several_threads_on_one_target() -> None:
    """A server's load: N threads x M requests on one target, every result equal to the sequential one."""
    target, codec = load_target()
    config = GenerateConfig(method="spot", block_length=8, gen_length=16, budget=4, temperature=1.0, seed=3)
    prompts = ["What is 3 + 4?", "Tom has 5 apples and eats 2. How many are left?"]

    def request(index: int) -> list[int]:
        return generate([prompts[index % 2]], config, target, codec, first_request=index)[0].token_ids

    expected = [request(index) for index in range(len(prompts))]
    results: dict[tuple[int, int], list[int]] = {}
    errors: list[Exception] = []

    def serve(worker: int) -> None:
        try:
            for index in range(len(prompts)):
                results[worker, index] = request(index)
        except Exception as err:  # reported by the main thread
            errors.append(err)

    threads = [threading.Thread(target=serve, args=(worker,)) for worker in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    assert {key: value == expected[key[1]] for key, value in results.items()} == {
        (w, i): True for w in range(3) for i in range(len(prompts))
    }


def test_an_interrupted_report_write_leaves_the_old_report_whole(monkeypatch, tmp_path: Path) -> None:
    from spot_dlm.bench.output import write_report

    path = tmp_path / "report.json"
    path.write_text('{"results": "measured before"}')
    real_write_text = Path.write_text

    def interrupted(self: Path, text: str, *args, **kwargs):
        real_write_text(self, text[: len(text) // 2], *args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(Path, "write_text", interrupted)
    with pytest.raises(KeyboardInterrupt):
        write_report({"results": ["a row"] * 100}, path)
    monkeypatch.undo()
    assert path.read_text() == '{"results": "measured before"}'


def test_a_folder_as_prompts_file_is_named_a_folder(tmp_path, capsys) -> None:
    from spot_dlm import cli

    assert cli.main(["generate", "--prompts-file", str(tmp_path)]) == 2
    assert "is a folder" in capsys.readouterr().err
