"""The Python API (GenerateConfig, generate, load_target) and the ``spot-dlm generate`` command line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from spot_dlm import cli
from spot_dlm.api import GenerateConfig, Generation, cut_at_eos, generate, load_target, make_drafter, runs_order_model
from spot_dlm.cli import options as cli_options
from spot_dlm.models.base import ScoreResult
from spot_dlm.models.builtin import BuiltinTarget, PrefixCache
from spot_dlm.models.checkpoint import CONFIG_FILE
from spot_dlm.models.tokenizer import TextCodec

PROMPT = "What is 3 + 4?"
EOS_ID = 1


@pytest.fixture
def loaded(checkpoint_dir: Path) -> tuple[BuiltinTarget, TextCodec]:
    return load_target(checkpoint_dir)


class EosAtTarget:
    """Wraps a target so that EOS has by far the largest logit at one position of every block."""

    def __init__(self, inner: BuiltinTarget, position: int) -> None:
        self.inner, self.position = inner, position
        self.name, self.vocab_size, self.mask_id = inner.name, inner.vocab_size, inner.mask_id
        self.eos_id, self.max_length, self.counter = inner.eos_id, inner.max_length, inner.counter
        self.device = inner.device

    def prefill(self, prompt_ids: torch.Tensor) -> PrefixCache:
        return self.inner.prefill(prompt_ids)

    def score(self, cache: PrefixCache, blocks: torch.Tensor, finished: torch.Tensor | None = None) -> ScoreResult:
        result = self.inner.score(cache, blocks, finished)
        logits = result.logits.clone()
        logits[:, self.position, self.eos_id] = 1e4
        return ScoreResult(logits=logits, cache=result.cache)

    def write(self, cache: PrefixCache, finished: torch.Tensor) -> PrefixCache:
        return self.inner.write(cache, finished)


# --------------------------------------------------------------------------------------------- GenerateConfig


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"temperature": -0.5}, "temperature"),
        ({"method": "bogus"}, "unknown method"),
        ({"gen_length": 10, "block_length": 4}, "multiple"),
        ({"block_length": 0}, "block length"),
        ({"gen_length": 0, "block_length": 4}, "gen length"),
        ({"budget": 0}, "budget"),
        ({"depth": 0}, "depth"),
        ({"confidence_prior": -1.0}, "confidence_prior"),
        ({"confidence_prior": float("nan")}, "confidence_prior"),
        ({"seed": -1}, "seed"),
        ({"confidence": "vibes"}, "confidence"),
        ({"method": "threshold", "tau": 1.5}, "tau"),
        ({"method": "dynamic", "min_commits": 0}, "k"),
    ],
)
def test_generate_config_errors(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        GenerateConfig(**kwargs)


def test_generate_config_builds_rule_and_settings() -> None:
    config = GenerateConfig(method="dynamic", tau=0.7, min_commits=2, temperature=0.5, block_length=4, gen_length=8)
    rule = config.rule()
    assert (rule.kind, rule.tau, rule.k, rule.temperature) == ("dynamic", 0.7, 2, 0.5)
    settings = config.settings()
    assert (settings.block_length, settings.gen_length, settings.stop_at_eos) == (4, 8, True)
    assert GenerateConfig(method="threshold").rule().kind == "threshold"


# --------------------------------------------------------------------------------------------- generate


@pytest.mark.parametrize("prompt", ["", "   \n\t"])
def test_generate_rejects_empty_prompt(loaded: tuple[BuiltinTarget, TextCodec], prompt: str) -> None:
    target, codec = loaded
    with pytest.raises(ValueError, match="empty prompt"):
        generate([PROMPT, prompt], GenerateConfig(block_length=4, gen_length=8), target, codec)
    assert target.counter.passes == 0  # every prompt is validated before any is decoded


def test_generate_rejects_over_long_prompt(loaded: tuple[BuiltinTarget, TextCodec]) -> None:
    target, codec = loaded
    assert target.max_length == 128
    long_prompt = " ".join(["cat dog mat"] * 60)
    with pytest.raises(ValueError, match="exceeds"):
        generate([long_prompt], GenerateConfig(block_length=4, gen_length=8), target, codec)
    # a prompt that fits alone but not with the generation length
    n_tokens = len(codec.encode_prompt(PROMPT))
    with pytest.raises(ValueError, match="context"):
        generate([PROMPT], GenerateConfig(block_length=8, gen_length=(128 - n_tokens) // 8 * 8 + 8), target, codec)


def test_generate_basic(loaded: tuple[BuiltinTarget, TextCodec]) -> None:
    target, codec = loaded
    config = GenerateConfig(block_length=4, gen_length=8, stop_at_eos=False)
    (out,) = generate(PROMPT, config, target, codec)  # a single string is one prompt
    assert isinstance(out, Generation)
    assert (out.method, out.prompt) == ("standard", PROMPT)
    assert len(out.raw_token_ids) == 8
    assert out.token_ids == cut_at_eos(out.raw_token_ids, EOS_ID)
    assert EOS_ID not in out.token_ids
    assert codec.mask_id not in out.raw_token_ids
    assert out.text == codec.decode(out.token_ids)
    assert out.target_passes == out.stats["target_passes"] == 8  # the first pass prefills the prompt too
    assert sorted(out.commit_step[:4]) == [0, 1, 2, 3]
    assert out.stats["commits_per_pass"] == pytest.approx(8 / 8)
    assert 0.0 <= out.stats["draft_time_share"] < 1.0
    assert sum(out.stats["accepted_lengths"].values()) == 8 - 2  # one verify pass per commit after each free one


def test_generate_request_index_keys_the_noise(loaded: tuple[BuiltinTarget, TextCodec]) -> None:
    target, codec = loaded
    config = GenerateConfig(block_length=4, gen_length=16, temperature=1.5, stop_at_eos=False)
    outs = generate([PROMPT, PROMPT, PROMPT], config, target, codec)
    assert len({tuple(o.raw_token_ids) for o in outs}) > 1  # the same prompt is a different request each time
    (second,) = generate([PROMPT], config, target, codec, first_request=1)
    assert second.raw_token_ids == outs[1].raw_token_ids
    (again,) = generate([PROMPT], config, target, codec)
    assert again.raw_token_ids == outs[0].raw_token_ids


def test_generate_cuts_at_eos(loaded: tuple[BuiltinTarget, TextCodec]) -> None:
    target, codec = loaded
    eos_target = EosAtTarget(target, position=2)
    (out,) = generate([PROMPT], GenerateConfig(block_length=4, gen_length=12), eos_target, codec)
    assert len(out.raw_token_ids) == 4  # decoding stopped after the block holding EOS
    assert out.raw_token_ids[2] == EOS_ID
    assert out.token_ids == out.raw_token_ids[:2]
    assert out.text == codec.decode(out.raw_token_ids[:2])
    assert out.target_passes == 4


def test_cut_at_eos() -> None:
    assert cut_at_eos([5, 6, 1, 7, 1], 1) == [5, 6]
    assert cut_at_eos([5, 6], 1) == [5, 6]
    assert cut_at_eos([1], 1) == []


def test_load_target_unknown_path(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown model"):
        load_target(tmp_path / "missing")


# --------------------------------------------------------------------------------------------- CLI


def run_cli(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def generate_args(model: Path, *extra: str) -> list[str]:
    return ["generate", "--model", str(model), "--gen-length", "8", "--block-length", "4", *extra]


@pytest.mark.parametrize("method", ["standard", "threshold"])
def test_cli_generate_json(
    capsys: pytest.CaptureFixture, checkpoint_dir: Path, tiny_codec: TextCodec, method: str
) -> None:
    code, out, err = run_cli(capsys, *generate_args(checkpoint_dir, "--prompt", PROMPT, "--json", "--method", method))
    assert code == 0, err
    lines = out.splitlines()
    assert len(lines) == 1
    record = json.loads(lines[0])
    assert {"method", "token_ids", "text", "target_passes"} <= record.keys()
    assert record["method"] == method
    assert record["prompt"] == PROMPT
    assert EOS_ID not in record["token_ids"]
    assert len(record["token_ids"]) <= 8
    assert all(isinstance(t, int) for t in record["token_ids"])
    assert record["text"] == tiny_codec.decode(record["token_ids"])
    assert 2 <= record["target_passes"] <= 1 + 8


def test_cli_order_model_option(capsys: pytest.CaptureFixture, checkpoint_dir: Path, tmp_path: Path) -> None:
    """--order-model small reads the drafter folder's small/ model, and says so clearly when there is none; none
    drafts without one (and needs the confidence prior)."""
    from spot_dlm.drafters.folder import save_order_model
    from spot_dlm.drafters.order_net import OrderModel, OrderModelConfig

    folder = tmp_path / "drafter"
    save_order_model(OrderModel(OrderModelConfig(d_model=16, n_layers=1, n_heads=2)), folder)
    spot = ("--prompt", PROMPT, "--json", "--method", "spot", "--budget", "3", "--drafter", str(folder))
    code, _, err = run_cli(capsys, *generate_args(checkpoint_dir, *spot, "--order-model", "small"))
    assert code == 2 and "no small order model" in err
    save_order_model(OrderModel(OrderModelConfig(d_model=8, n_layers=1, n_heads=2)), folder / "small")
    code, out, err = run_cli(capsys, *generate_args(checkpoint_dir, *spot, "--order-model", "small"))
    assert code == 0, err
    standard = run_cli(capsys, *generate_args(checkpoint_dir, "--prompt", PROMPT, "--json"))[1]
    assert json.loads(out)["token_ids"] == json.loads(standard)["token_ids"]
    code, out, err = run_cli(capsys, *generate_args(checkpoint_dir, *spot, "--order-model", "none"))
    assert code == 0, err
    assert json.loads(out)["token_ids"] == json.loads(standard)["token_ids"]
    target, _ = load_target(checkpoint_dir)
    without_prior = GenerateConfig(
        method="spot", budget=3, drafter=str(folder), order_model="none", confidence_prior=0
    )
    with pytest.raises(ValueError, match="confidence prior ranks positions alone"):
        make_drafter(without_prior, target)


def test_auto_order_model_drafts_one_node_on_a_cpu_without_the_model(tmp_path: Path) -> None:
    """auto skips the order model only where it was measured not to pay: budget 2, a CPU target, and a confidence
    prior corrected for fresh neighbours; every explicit choice is kept."""
    target, _ = load_target()  # the shipped target on the CPU, with the shipped drafter (bigram fit included)

    def runs(corrected: bool = True, **options) -> bool:
        return runs_order_model(GenerateConfig(method="spot", **options), target, corrected)

    assert not runs(budget=2) and not runs(budget=2, order_model="none") and not runs(budget=16, order_model="none")
    assert runs(budget=3) and runs(budget=2, corrected=False) and runs(budget=2, confidence_prior=0.0)
    assert runs(budget=2, order_model="small") and runs(budget=2, order_model="paper")
    assert make_drafter(GenerateConfig(method="spot", budget=2), target).model is None
    assert make_drafter(GenerateConfig(method="spot", budget=16), target).model is not None
    plain = GenerateConfig(method="spot", budget=2, neighbour_tokens=False)  # no correction: the model drafts
    assert make_drafter(plain, target).model is not None


def test_cli_demo_runs_the_main_job(capsys: pytest.CaptureFixture) -> None:
    """The README's main job on the shipped target and drafter: SPOT's tokens equal standard decoding's."""
    args = ("demo", "--methods", "standard,spot", "--gen-length", "32", "--questions", "2", "--no-plot")
    code, out, err = run_cli(capsys, *args)
    assert code == 0, err
    assert "every method produced the same tokens as standard: True" in out
    assert "--- spot (block 32, T=0.0) ---" in out and "2 questions, decoded interleaved" in out
    assert "budget auto -> 2 (cpu, builtin; prior" in out  # no measurement cached in the tests' own cache folder
    assert "fewer passes" in out and "faster than standard" in out


def test_cli_full_length_pass_count(capsys: pytest.CaptureFixture, checkpoint_dir: Path) -> None:
    code, out, err = run_cli(capsys, *generate_args(checkpoint_dir, "--prompt", PROMPT, "--json", "--full-length"))
    assert code == 0, err
    assert json.loads(out)["target_passes"] == 8  # per block: its first pass (the first prefills too) + L - 1


def test_cli_prompts_file(capsys: pytest.CaptureFixture, checkpoint_dir: Path, tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("What is 1 + 2?\n\n   \nWhat is 5 + 0?\n")
    code, out, err = run_cli(capsys, *generate_args(checkpoint_dir, "--prompts-file", str(prompts), "--json"))
    assert code == 0, err
    records = [json.loads(line) for line in out.splitlines()]
    assert [r["prompt"] for r in records] == ["What is 1 + 2?", "What is 5 + 0?"]


def test_cli_plain_output(capsys: pytest.CaptureFixture, checkpoint_dir: Path) -> None:
    code, out, err = run_cli(capsys, *generate_args(checkpoint_dir, "--prompt", PROMPT))
    assert code == 0, err
    assert "[standard:" in out
    assert "target passes" in out


def test_cli_json_token_ids_cut_before_eos(
    capsys: pytest.CaptureFixture, checkpoint_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_target, real_codec = load_target(checkpoint_dir)
    monkeypatch.setattr(
        cli_options, "load_target", lambda name, **options: (EosAtTarget(real_target, position=1), real_codec)
    )
    code, out, err = run_cli(capsys, *generate_args(checkpoint_dir, "--prompt", PROMPT, "--json"))
    assert code == 0, err
    record = json.loads(out)
    assert len(record["token_ids"]) == 1
    assert EOS_ID not in record["token_ids"]
    assert record["target_passes"] == 4


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        (["--prompt", PROMPT, "--temperature", "-1"], "temperature"),
        (["--prompt", PROMPT, "--method", "bogus"], "unknown method"),
        (["--prompts-file", "/nonexistent/prompts.txt"], "prompts file not found"),
        (["--prompt", PROMPT, "--gen-length", "10"], "multiple"),
        (["--prompt", "  "], "empty prompt"),
        ([], "exactly one"),
    ],
)
def test_cli_bad_input_exit_code_2(
    capsys: pytest.CaptureFixture, checkpoint_dir: Path, extra: list[str], match: str
) -> None:
    code, out, err = run_cli(capsys, *generate_args(checkpoint_dir, *extra))
    assert code == 2
    assert out == ""
    assert "error" in err
    assert match in err


def test_cli_unknown_model_path(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    code, out, err = run_cli(capsys, *generate_args(tmp_path / "no-such-model", "--prompt", PROMPT))
    assert code == 2
    assert "error" in err
    assert "no-such-model" in err


def test_cli_empty_prompts_file(capsys: pytest.CaptureFixture, checkpoint_dir: Path, tmp_path: Path) -> None:
    prompts = tmp_path / "empty.txt"
    prompts.write_text("\n  \n")
    code, _, err = run_cli(capsys, *generate_args(checkpoint_dir, "--prompts-file", str(prompts)))
    assert code == 2
    assert "holds no prompt" in err


def test_cli_bad_checkpoint_config_exit_code_2(
    capsys: pytest.CaptureFixture, checkpoint_dir: Path, tmp_path: Path
) -> None:
    """A checkpoint whose config.json has a wrongly typed value is bad input too: exit code 2, not a traceback."""
    folder = tmp_path / "bad-config"
    folder.mkdir()
    for item in checkpoint_dir.iterdir():
        (folder / item.name).write_bytes(item.read_bytes())
    config = json.loads((folder / CONFIG_FILE).read_text())
    config["n_heads"] = "2"
    (folder / CONFIG_FILE).write_text(json.dumps(config))
    code, _, err = run_cli(capsys, *generate_args(folder, "--prompt", PROMPT))
    assert code == 2
    assert "error" in err


@pytest.mark.parametrize("split", ["2/2", "1", "a/b", "0/0"])
def test_cli_collect_rejects_a_bad_worker_split(capsys: pytest.CaptureFixture, tmp_path: Path, split: str) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["collect", "--out", str(tmp_path), "--worker", split])
    assert exit_info.value.code == 2
    assert "I/N" in capsys.readouterr().err


def test_cli_evaluate_target_nelbo_only(capsys: pytest.CaptureFixture, checkpoint_dir: Path, tmp_path: Path) -> None:
    import numpy as np

    tokens = tmp_path / "heldout_tokens.npy"
    np.save(tokens, np.random.default_rng(0).integers(3, 40, size=600).astype(np.int32))
    report_path = tmp_path / "eval.json"
    args = ["evaluate-target", "--model", str(checkpoint_dir), "--n-prompts", "0", "--block-lengths", "4,8"]
    code, _, _ = run_cli(capsys, *args, "--heldout-tokens", str(tokens), "--json", str(report_path))
    assert code == 0
    report = json.loads(report_path.read_text())
    assert set(report["heldout_nelbo_per_token"]) == {"4", "8"}
    assert all(value > 0 for value in report["heldout_nelbo_per_token"].values())
    assert "gsm8k" not in report and "gsm_symbolic" not in report  # 0 prompts: nothing decoded


def test_cli_evaluate_target_rejects_negative_prompt_count(capsys: pytest.CaptureFixture, checkpoint_dir: Path):
    code, out, err = run_cli(capsys, "evaluate-target", "--model", str(checkpoint_dir), "--n-prompts", "-1")
    assert code == 2 and out == ""
    assert "--n-prompts" in err


def test_generate_help_fits_on_one_screen(capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "100")
    with pytest.raises(SystemExit):
        cli.main(["generate", "-h"])
    assert len(capsys.readouterr().out.splitlines()) <= 45
