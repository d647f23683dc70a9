"""Sanity checks of the reference transcriptions in reference_loops.py, on the tiny stand-in checkpoints.

They check properties of the authors' loops themselves (lengths, forward counts, schedules, what each pass may
touch), not agreement with our adapter.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModel, AutoModelForCausalLM

from reference_loops import dream_generate, fast_dllm_v2_generate, llada_generate, sdar_generate
from spot_dlm.standins import build_standin

pytestmark = pytest.mark.usefixtures("remote_code_cache")

LOADERS = {"sdar": AutoModelForCausalLM, "llada": AutoModel, "dream": AutoModel, "fast_dllm_v2": AutoModelForCausalLM}
MASK = {"sdar": 151669, "llada": 126336, "dream": 151666, "fast_dllm_v2": 151665}
NEVER = -1  # a stop id that no token equals


class Recorder(torch.nn.Module):
    """Passes every call to the model and keeps its input ids and cache-write flag."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model
        self.calls: list[tuple[list[int], bool]] = []

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def config(self):
        return self.model.config

    def forward(self, *args, **kwargs):
        ids = kwargs["input_ids"] if "input_ids" in kwargs else args[0]
        writes = bool(kwargs.get("store_kv") or kwargs.get("update_past_key_values"))
        self.calls.append((ids[0].tolist(), writes))
        return self.model(*args, **kwargs)


@pytest.fixture(scope="module")
def standin(tmp_path_factory):
    loaded: dict[str, torch.nn.Module] = {}

    def load(family: str) -> torch.nn.Module:
        if family not in loaded:
            folder = build_standin(family, tmp_path_factory.mktemp(family), seed=0, dtype=torch.float32)
            model = LOADERS[family].from_pretrained(folder, trust_remote_code=True, local_files_only=True)
            loaded[family] = model.eval()
        return loaded[family]

    return load


def prompt(length: int, seed: int = 0) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(10, 1000, (length,), generator=generator).tolist()


# --- SDAR ---------------------------------------------------------------------------------------------------------


def sdar_expected_forwards(p: int, g: int, block: int, steps: int) -> int:
    """Prefill (if any) + per decoded block: ceil(masks / (L // steps)) denoising passes + 1 finish pass."""
    per_pass = block // steps
    first, last = p // block, math.ceil((p + g) / block)
    masks = [block - p % block if b == first else block for b in range(first, last)]
    return (1 if first else 0) + sum(math.ceil(m / per_pass) + 1 for m in masks)


@pytest.mark.parametrize("p", [8, 6])
@pytest.mark.parametrize("steps", [4, 2])
def test_sdar_static(standin, p: int, steps: int) -> None:
    block, g = 4, 12
    model = Recorder(standin("sdar"))
    ids = prompt(p)
    out, nfe = sdar_generate(model, ids, g, block, steps, MASK["sdar"], stop_ids=[])
    assert len(out) == math.ceil((p + g) / block) * block - p
    assert MASK["sdar"] not in out
    assert nfe == len(model.calls) == sdar_expected_forwards(p, g, block, steps)
    calls = model.calls
    if p // block:  # the prefill: the full prompt blocks, written
        assert calls[0] == (ids[: p // block * block], True)
        calls = calls[1:]
    # every pass of the first decoded block feeds the prompt tail unchanged; the block ends with one finish pass
    r = p % block
    first_block = calls[: next(i for i, (_, writes) in enumerate(calls) if writes) + 1]
    assert all(fed[:r] == ids[p - r :] for fed, _ in first_block)
    assert [writes for _, writes in first_block] == [False] * (len(first_block) - 1) + [True]
    assert first_block[-1][0] == ids[p - r :] + out[: block - r]


@pytest.mark.parametrize("p", [8, 6])
def test_sdar_dynamic(standin, p: int) -> None:
    block, steps, g = 4, 4, 12
    model = standin("sdar")
    # threshold 0: every masked position is above it, so each block is decoded in one pass (+ its finish pass)
    out, nfe = sdar_generate(model, prompt(p), g, block, steps, MASK["sdar"], stop_ids=[], threshold=0.0)
    assert len(out) == math.ceil((p + g) / block) * block - p
    assert MASK["sdar"] not in out
    assert nfe == (1 if p // block else 0) + 2 * (math.ceil((p + g) / block) - p // block)


def test_sdar_stops_after_the_block(standin) -> None:
    block, steps, g, p = 4, 4, 16, 6
    model = standin("sdar")
    full, _ = sdar_generate(model, prompt(p), g, block, steps, MASK["sdar"], stop_ids=[])
    start = 2 * block - p  # the second decoded block, in output coordinates
    j = next(j for j in range(start, start + block) if full[j] not in full[:start])
    out, nfe = sdar_generate(model, prompt(p), g, block, steps, MASK["sdar"], stop_ids=[full[j]])
    assert out == full[: start + block]
    assert nfe == 1 + (block - p % block + 1) + (block + 1)


# --- LLaDA --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("p", [8, 5])
@pytest.mark.parametrize("steps", [16, 8])
def test_llada(standin, p: int, steps: int) -> None:
    g, block = 16, 8
    model = Recorder(standin("llada"))
    ids = prompt(p)
    out, nfe = llada_generate(model, ids, g, block, steps, MASK["llada"])
    assert len(out) == g
    assert MASK["llada"] not in out
    assert nfe == len(model.calls) == steps
    fed = [x for x, _ in model.calls]
    assert all(x[:p] == ids and len(x) == p + g for x in fed)
    # G/steps commits per pass; the second block stays all masks while the first is decoded
    masks = [x.count(MASK["llada"]) for x in fed] + [0]
    assert [a - b for a, b in zip(masks, masks[1:])] == [g // steps] * steps
    assert all(x[p + block :] == [MASK["llada"]] * block for x in fed[: steps // 2])


# --- Dream --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("p", [8, 5])
@pytest.mark.parametrize("alg", ["entropy", "maskgit_plus"])
def test_dream(standin, p: int, alg: str) -> None:
    n = steps = 32
    model = Recorder(standin("dream"))
    ids = prompt(p)
    out, nfe = dream_generate(model, ids, n, steps, MASK["dream"], alg=alg)
    assert len(out) == n
    assert MASK["dream"] not in out
    assert nfe == len(model.calls) == steps
    fed = [x for x, _ in model.calls]
    assert all(x[:p] == ids and len(x) == p + n for x in fed)
    masks = [x.count(MASK["dream"]) for x in fed] + [0]
    assert [a - b for a, b in zip(masks, masks[1:])] == [0] + [1] * (steps - 2) + [2]


def test_dream_fewer_steps(standin) -> None:
    model = Recorder(standin("dream"))
    out, nfe = dream_generate(model, prompt(6), 32, 16, MASK["dream"])
    assert len(out) == 32 and MASK["dream"] not in out
    assert nfe == len(model.calls) == 16


# --- Fast-dLLM v2 -------------------------------------------------------------------------------------------------


def v2_expected_forwards(p: int, g: int, block: int) -> int:
    """threshold 1 (one commit per pass): prefill if P > B, then per block its masks + 1 store pass."""
    first_masks = block - p % block if p % block else block - 1
    blocks = g // block
    return (1 if p > block else 0) + (first_masks + 1) + (blocks - 1) * block


@pytest.mark.parametrize("p", [20, 40, 64])
def test_fast_dllm_v2(standin, p: int) -> None:
    g, block, small = 64, 32, 8
    model = Recorder(standin("fast_dllm_v2"))
    ids = prompt(p)
    out, nfe = fast_dllm_v2_generate(model, ids, g, MASK["fast_dllm_v2"], NEVER, block, small)
    assert len(out) == (p // block + g // block) * block - p + 1  # the last store pass appends one token
    assert MASK["fast_dllm_v2"] not in out
    assert nfe == len(model.calls) == v2_expected_forwards(p, g, block)
    calls = model.calls
    if p > block:
        assert calls[0] == (ids[: p // block * block], True)
        calls = calls[1:]
    head = ids[p // block * block :] if p % block else out[:1]  # the prompt tail or the prefill's argmax token
    assert calls[0][0][: len(head)] == head
    # within a block, one commit per pass, always in the sub-block of the first mask
    for (before, writes), (after, _) in zip(calls, calls[1:]):
        if writes or MASK["fast_dllm_v2"] not in after:
            continue
        changed = [i for i in range(block) if before[i] != after[i]]
        assert len(changed) == 1
        assert changed[0] // small == before.index(MASK["fast_dllm_v2"]) // small
    assert [w for _, w in calls].count(True) == g // block  # one store pass per block, the last one included


def test_fast_dllm_v2_threshold(standin) -> None:
    g, block, p = 64, 32, 40
    model = standin("fast_dllm_v2")
    # threshold 0: one pass per sub-block that has masks (3 in the first block, whose first 8 are the prompt
    # tail; 4 in the second), a store pass per block, and the prefill
    out, nfe = fast_dllm_v2_generate(model, prompt(p), g, MASK["fast_dllm_v2"], NEVER, threshold=0.0)
    assert len(out) == (p // block + g // block) * block - p + 1
    assert MASK["fast_dllm_v2"] not in out
    assert nfe == 1 + (3 + 1) + (4 + 1)


def test_fast_dllm_v2_stop_finishes_the_block(standin) -> None:
    g, block, p = 64, 32, 40
    model = standin("fast_dllm_v2")
    full, _ = fast_dllm_v2_generate(model, prompt(p), g, MASK["fast_dllm_v2"], NEVER)
    first_block = block - p % block  # output positions of the first decoded block
    stop = full[first_block // 2]  # committed by the rule in the first block
    out, nfe = fast_dllm_v2_generate(model, prompt(p), g, MASK["fast_dllm_v2"], stop)
    assert out == full[:first_block]  # the block is completed, no store pass, no next token
    assert nfe == 1 + first_block


def test_fast_dllm_v2_refusals(standin) -> None:
    model = standin("fast_dllm_v2")
    with pytest.raises(ValueError):
        fast_dllm_v2_generate(model, prompt(32), 64, MASK["fast_dllm_v2"], NEVER)
    with pytest.raises(ValueError):
        fast_dllm_v2_generate(model, prompt(20), 16, MASK["fast_dllm_v2"], NEVER)


def test_deterministic(standin) -> None:
    runs = {
        "sdar": lambda m: sdar_generate(m, prompt(6), 12, 4, 4, MASK["sdar"], stop_ids=[]),
        "llada": lambda m: llada_generate(m, prompt(5), 16, 8, 16, MASK["llada"]),
        "dream": lambda m: dream_generate(m, prompt(5), 8, 8, MASK["dream"]),
        "fast_dllm_v2": lambda m: fast_dllm_v2_generate(m, prompt(40), 32, MASK["fast_dllm_v2"], NEVER),
    }
    for family, run in runs.items():
        model = standin(family)
        assert run(model) == run(model), family
