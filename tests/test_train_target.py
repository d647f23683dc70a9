"""Target training: a short run writes a loadable 16-bit checkpoint with its record, resumes from it, takes a new
shape or bfloat16 autocast, and refuses a device that is not there."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from spot_dlm import cli
from spot_dlm.models.checkpoint import TOKENIZER_FILE, load_model, load_training_state, save_checkpoint
from spot_dlm.models.tokenizer import TextCodec
from spot_dlm.models.transformer import BlockDiffusionLM, ModelConfig, keep_layers
from spot_dlm.train.target import TrainConfig, train_target


@pytest.fixture
def corpus(tmp_path: Path, tiny_codec: TextCodec) -> Path:
    """A corpus folder as prepare-data writes it: tokenizer, train and held-out token streams."""
    folder = tmp_path / "corpus"
    folder.mkdir()
    tiny_codec.save(folder / TOKENIZER_FILE)
    rng = np.random.default_rng(0)
    for name, length in (("train_tokens.npy", 4000), ("heldout_tokens.npy", 1000)):
        np.save(folder / name, rng.integers(3, tiny_codec.vocab_size, size=length).astype(np.uint16))
    return folder


def short_run(corpus: Path, out: Path, **overrides) -> TrainConfig:
    settings = {
        "out_dir": out,
        "corpus_dir": corpus,
        "minutes": 0.02,
        "batch_size": 2,
        "seq_len": 64,
        "eval_batches": 1,
        "threads": 1,
        "d_model": 32,
        "n_layers": 1,
        "n_heads": 2,
        "block_lengths": (8, 16),
        **overrides,
    }
    return TrainConfig(**settings)


@pytest.mark.parametrize("phase,bf16", [("ar", False), ("bd", False), ("bd", True)])
def test_short_run_writes_a_checkpoint_and_resumes(corpus: Path, tmp_path: Path, phase: str, bf16: bool) -> None:
    out = tmp_path / "run"
    train_target(short_run(corpus, out, phase=phase, bf16=bf16))
    model = load_model(out)
    assert model.config.d_model == 32 and model.config.n_layers == 1
    state = load_training_state(out)
    assert state["runs"] == 1 and state["tokens_seen"][phase] > 0
    assert state["train_config"]["bf16"] is bf16
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert np.isfinite(log[-1][f"heldout_{phase}_loss"])
    first_tokens = state["tokens_seen"][phase]

    train_target(short_run(corpus, out, phase=phase, d_model=64))  # resumes: the saved shape wins
    resumed = load_training_state(out)
    assert resumed["runs"] == 2 and resumed["tokens_seen"][phase] > first_tokens
    assert load_model(out).config.d_model == 32
    assert {t.dtype for t in load_file(str(out / "model.safetensors")).values()} == {torch.float16}  # 16-bit


def test_missing_device_is_a_clear_error(corpus: Path, tmp_path: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("checks the refusal on a machine without CUDA")
    with pytest.raises(ValueError, match="CUDA"):
        train_target(short_run(corpus, tmp_path / "run", device="cuda"))


def test_distilling_a_teacher_logs_the_soft_loss(corpus: Path, tmp_path: Path, checkpoint_dir: Path) -> None:
    out = tmp_path / "student"
    train_target(short_run(corpus, out, phase="bd", teacher=checkpoint_dir))
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert np.isfinite(log[-1]["heldout_teacher_loss"]) and np.isfinite(log[-1]["heldout_bd_loss"])
    assert load_training_state(out)["train_config"]["teacher"] == str(checkpoint_dir)


def test_a_teacher_is_checked_before_training(
    corpus: Path, tmp_path: Path, checkpoint_dir: Path, model_factory
) -> None:
    with pytest.raises(ValueError, match="block-diffusion phase"):
        short_run(corpus, tmp_path / "a", phase="ar", teacher=checkpoint_dir)
    with pytest.raises(FileNotFoundError, match="teacher checkpoint"):
        train_target(short_run(corpus, tmp_path / "b", phase="bd", teacher=tmp_path / "nowhere"))
    other = tmp_path / "other-vocab"
    save_checkpoint(model_factory(vocab_size=50, dtype=torch.float32), other)
    with pytest.raises(ValueError, match="vocabulary"):
        train_target(short_run(corpus, tmp_path / "c", phase="bd", teacher=other))


def test_a_layer_dropped_student_starts_from_the_kept_layers(
    corpus: Path, tmp_path: Path, tiny_codec: TextCodec, capsys: pytest.CaptureFixture
) -> None:
    torch.manual_seed(0)
    teacher = BlockDiffusionLM(ModelConfig(vocab_size=tiny_codec.vocab_size, d_model=32, n_layers=3, n_heads=2))
    init = tmp_path / "init"
    save_checkpoint(teacher, init)
    teacher = load_model(init)  # the 16-bit weights the student starts from
    student = keep_layers(teacher, (0, 2))
    assert student.config.n_layers == 2 and student.config.d_model == teacher.config.d_model
    for new, old in ((0, 0), (1, 2)):
        for (name, a), b in zip(student.layers[new].state_dict().items(), teacher.layers[old].state_dict().values()):
            assert torch.equal(a, b), name
    assert torch.equal(student.embed.weight, teacher.embed.weight)
    for bad in ((), (2, 0), (0, 0), (0, 3), (-1, 1)):
        with pytest.raises(ValueError, match="layers to keep"):
            keep_layers(teacher, bad)

    out = tmp_path / "student"
    train_target(short_run(corpus, out, phase="bd", init_from=init, keep_layers=(0, 2), teacher=init))
    assert load_model(out).config.n_layers == 2
    assert load_training_state(out)["runs"] == 1  # a new run, not the teacher's
    with pytest.raises(ValueError, match="--init checkpoint"):
        short_run(corpus, tmp_path / "x", keep_layers=(0,))
    argv = ["train-target", "--phase", "bd", "--corpus", str(corpus), "--out", str(tmp_path / "y")]
    assert cli.main([*argv, "--init", str(init), "--keep-layers", "0,3"]) == 2
    assert "layers to keep must be increasing indices in [0, 3)" in capsys.readouterr().err
