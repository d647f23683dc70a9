"""Devices: choosing one, refusing one that is not there, the verification-cost benchmark, and (with CUDA) exactness
of speculative decoding on the GPU."""

from __future__ import annotations

import json

import pytest
import torch

from spot_dlm.api import GenerateConfig, generate, load_target, resolve_device
from spot_dlm.bench.output import machine_description
from spot_dlm.bench.verify_cost import (
    VerifyCostConfig,
    format_verify_table,
    measure_verify_cost,
    parse_shape,
    plot_verify_cost,
)
from spot_dlm.cli import main

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_resolve_device_names() -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    for bad in ("tpu", "gpu0", "", "cuda:x"):
        with pytest.raises(ValueError, match="device"):
            resolve_device(bad)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_cuda_without_cuda_is_a_clear_error(capsys) -> None:
    with pytest.raises(ValueError, match="sees no CUDA device"):
        resolve_device("cuda")
    assert main(["generate", "--prompt", "What is 2 + 2?", "--device", "cuda"]) == 2
    assert "sees no CUDA device" in capsys.readouterr().err


def test_unknown_device_on_the_command_line(capsys) -> None:
    assert main(["bench", "--methods", "standard", "--n-prompts", "1", "--device", "quantum"]) == 2
    assert "unknown device 'quantum'" in capsys.readouterr().err


def test_target_device_follows_the_weights() -> None:
    target, _ = load_target(device="cpu")
    assert target.device == torch.device("cpu")
    assert "decoding on the CPU" in machine_description(target.device)


def test_parse_shape() -> None:
    assert parse_shape("builtin") is None
    config = parse_shape("d64-l3-h4-v300-m2")
    assert (config.d_model, config.n_layers, config.n_heads, config.vocab_size, config.mlp_ratio) == (64, 3, 4, 300, 2)
    assert parse_shape("d64-l3-h4-v300").mlp_ratio == 4
    for bad in ("d64-l3", "big", "d63-l3-h4-v300"):
        with pytest.raises(ValueError):
            parse_shape(bad)
    with pytest.raises(ValueError, match="dtype"):
        VerifyCostConfig(dtype="int8")
    with pytest.raises(ValueError, match="node counts"):
        VerifyCostConfig(nodes=(0, 4))


def test_verify_cost_report(tmp_path) -> None:
    config = VerifyCostConfig(shapes=("d32-l2-h2-v64",), nodes=(1, 3), prefix_length=20, block_length=8, repeats=2)
    report = measure_verify_cost(config, progress=False)
    rows = report["results"]
    assert [r["nodes"] for r in rows] == [1, 3]
    assert rows[0]["cost_vs_one_node"] == 1.0
    assert all(r["ms_per_pass"] > 0 for r in rows)
    assert rows[0]["parameters"] == rows[1]["parameters"] > 0
    assert "d32-l2-h2-v64" in format_verify_table(report)
    json.dumps(report)  # the report is plain JSON
    assert plot_verify_cost(report, tmp_path / "cost.png").stat().st_size > 0


def test_verify_cost_cli(tmp_path, capsys) -> None:
    out = tmp_path / "vc.json"
    argv = ["verify-cost", "--shapes", "d32-l2-h2-v64", "--nodes", "1,2", "--prefix-length", "16"]
    assert main([*argv, "--block-length", "8", "--repeats", "1", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["config"]["nodes"] == [1, 2]
    assert main(["verify-cost", "--shapes", "huge"]) == 2
    assert "unknown model shape" in capsys.readouterr().err


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_spot_on_cuda_equals_standard_on_cuda(temperature: float) -> None:
    """The shipped target and drafter on the GPU: SPOT gives standard decoding's tokens and uses fewer passes."""
    target, codec = load_target(device="cuda")
    prompts = ["Tom has 3 apples and buys 5 more. How many apples does he have?", "What is 12 times 7?"]
    common = {"temperature": temperature, "gen_length": 64, "seed": 3}
    standard = generate(prompts, GenerateConfig(method="standard", **common), target, codec)
    spot = generate(prompts, GenerateConfig(method="spot", budget=8, **common), target, codec)
    for a, b in zip(standard, spot):
        assert a.raw_token_ids == b.raw_token_ids
        assert a.commit_step == b.commit_step
    assert sum(g.target_passes for g in spot) < sum(g.target_passes for g in standard)


@pytest.mark.gpu
@needs_cuda
def test_verify_cost_on_cuda() -> None:
    config = VerifyCostConfig(shapes=("builtin",), nodes=(1, 4), repeats=2, device="cuda")
    report = measure_verify_cost(config, progress=False)
    assert "decoding on" in report["machine"] and "CPU" not in report["machine"].split("decoding on")[-1]
    assert len(report["results"]) == 2
