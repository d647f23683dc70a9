"""The transformers adapter: a stock causal-LM architecture (Qwen3, Llama) driven as a block-diffusion target.

Stand-ins follow the interface of SDAR / Fast-dLLM v2 / Dream (forward with a 4-D mask, position ids and a
``DynamicCache``); no DLM weights are reachable here, so the weights are random and the checks are structural:
the cached, packed pass equals a full recompute, candidates do not see each other, speculative decoding equals
standard decoding token for token, and a saved folder loads through ``transformers`` (safetensors only).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from spot_dlm.api import GenerateConfig, generate, load_target  # noqa: E402
from spot_dlm.cli import main  # noqa: E402
from spot_dlm.decode import DecodeSettings, NoDrafter, decode_ids  # noqa: E402
from spot_dlm.drafters.simple import RandomDrafter, StaleConfidenceDrafter  # noqa: E402
from spot_dlm.models.hf import HFTarget, additive_mask, is_hf_checkpoint, load_hf_target  # noqa: E402
from spot_dlm.models.layout import attention_mask, block_layout, clean_layout, concat  # noqa: E402
from spot_dlm.noise import NoiseKey  # noqa: E402
from spot_dlm.rules import CommitRule  # noqa: E402
from spot_dlm.train.collect import load_shards  # noqa: E402

VOCAB, MASK_ID, EOS_ID = 48, 2, 1
ARCHITECTURES = ("qwen3", "llama")


def stand_in(arch: str, seed: int = 0, vocab: int = VOCAB, dtype: torch.dtype = torch.float64):
    """A tiny random causal LM; weights spread wide enough that logits are peaked and the context matters."""
    common = {
        "vocab_size": vocab,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "eos_token_id": EOS_ID,
        "pad_token_id": 0,
    }
    if arch == "qwen3":
        config = transformers.Qwen3Config(head_dim=8, **common)
        model_class = transformers.Qwen3ForCausalLM
    else:
        config = transformers.LlamaConfig(head_dim=8, **common)
        model_class = transformers.LlamaForCausalLM
    torch.manual_seed(seed)
    model = model_class(config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.4)
    return model.to(dtype).eval()


def full_recompute(model, prompt: torch.Tensor, finished: list[torch.Tensor], block: torch.Tensor) -> torch.Tensor:
    """Reference: one forward over [prompt | finished blocks | block] without any cache. -> logits [L, V]"""
    clean = torch.cat([prompt, *finished])
    layout = concat(clean_layout(0, len(clean)), block_layout(len(clean), len(block), 0))
    out = model(
        input_ids=torch.cat([clean, block])[None],
        attention_mask=additive_mask(attention_mask(layout, 0), torch.float64),
        position_ids=layout.positions[None],
    )
    return out.logits[0, len(clean) - 1 : -1], out.logits[0, len(clean) :]  # (shifted view, plain view)


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("shifted", [False, True])
def test_cached_packed_pass_equals_full_recompute(arch: str, shifted: bool) -> None:
    model = stand_in(arch, seed=1)
    target = HFTarget(model, MASK_ID, EOS_ID, shifted_logits=shifted)
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, VOCAB, (7,), generator=generator)
    first = torch.randint(3, VOCAB, (4,), generator=generator)
    candidates = torch.randint(3, VOCAB, (3, 4), generator=generator)
    candidates[:, 1::2] = MASK_ID
    with torch.no_grad():
        cache = target.prefill(prompt)
        cache = target.score(cache, first[None]).cache  # no finished block yet: cache unchanged
        result = target.score(cache, candidates, finished=first)
        assert result.cache.length == 11 and result.cache.kv.get_seq_length() == 11
        for k in range(3):
            shifted_ref, plain_ref = full_recompute(model, prompt, [first], candidates[k])
            expected = shifted_ref if shifted else plain_ref
            torch.testing.assert_close(result.logits[k], expected, rtol=1e-9, atol=1e-9)
        again = target.score(result.cache, candidates[:1])  # the cache was cut back to the clean tokens
        torch.testing.assert_close(again.logits[0], result.logits[0], rtol=1e-9, atol=1e-9)
    assert target.counter.passes == 4


def test_candidates_in_one_pass_do_not_see_each_other() -> None:
    target = HFTarget(stand_in("qwen3", seed=2), MASK_ID, EOS_ID)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        cache = target.prefill(torch.randint(3, VOCAB, (5,), generator=generator))
        blocks = torch.randint(3, VOCAB, (4, 6), generator=generator)
        together = target.score(cache, blocks).logits
        for k in range(4):
            alone = target.score(cache, blocks[k : k + 1]).logits[0]
            torch.testing.assert_close(together[k], alone, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("shifted", [False, True])
@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.5])
def test_speculative_equals_standard_on_a_transformers_target(arch: str, shifted: bool, temperature: float) -> None:
    target = HFTarget(stand_in(arch, seed=3), MASK_ID, EOS_ID, shifted_logits=shifted)
    settings = DecodeSettings(CommitRule(temperature=temperature), block_length=6, gen_length=18, stop_at_eos=False)
    accepted_deep = handed_off = 0
    for seed in range(3):
        prompt = torch.randint(3, VOCAB, (4 + seed,), generator=torch.Generator().manual_seed(seed))
        key = NoiseKey(seed, request=seed)
        reference = decode_ids(target, prompt, settings, NoDrafter(), key)
        for drafter in (StaleConfidenceDrafter(budget=6, depth=4), RandomDrafter(budget=5, depth=3, salt=seed)):
            raw = decode_ids(target, prompt, settings, drafter, key)
            assert raw.token_ids.tolist() == reference.token_ids.tolist()
            assert raw.commit_step.tolist() == reference.commit_step.tolist()
            assert raw.stats.target_passes <= reference.stats.target_passes
            accepted_deep += sum(n for length, n in raw.stats.accepted_lengths.items() if length > 1)
            handed_off += raw.stats.handoff_blocks
    assert accepted_deep > 0  # some drafts were accepted: the equality above was not only ever the root
    assert handed_off > 0  # and some blocks opened by a hand-off


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("shifted", [False, True])
def test_a_hand_off_is_the_next_blocks_first_pass_on_a_transformers_target(arch: str, shifted: bool) -> None:
    target = HFTarget(stand_in(arch, seed=4), MASK_ID, EOS_ID, shifted_logits=shifted)
    generator = torch.Generator().manual_seed(5)
    prompt = torch.randint(3, VOCAB, (6,), generator=generator)
    blocks = torch.randint(3, VOCAB, (3, 4), generator=generator)
    blocks[:, ::2] = MASK_ID
    complete = torch.randint(3, VOCAB, (2, 4), generator=generator)
    all_mask = torch.full((1, 4), MASK_ID)
    with torch.no_grad():
        for m in range(2):
            cache = target.prefill(prompt)
            scored = target.score_handoffs(cache, blocks, complete)
            torch.testing.assert_close(scored.logits, target.score(cache, blocks).logits, rtol=1e-9, atol=1e-9)
            opened = scored.opening(m)
            apart = target.score(target.prefill(prompt), all_mask, complete[m])  # the next block's own first pass
            torch.testing.assert_close(scored.next_logits[m], apart.logits[0], rtol=1e-9, atol=1e-9)
            assert torch.equal(opened.tokens, apart.cache.tokens) and opened.kv.get_seq_length() == 10
            torch.testing.assert_close(opened.last_logits, apart.cache.last_logits, rtol=1e-9, atol=1e-9)
            after, expected = target.score(opened, blocks).logits, target.score(apart.cache, blocks).logits
            torch.testing.assert_close(after, expected, rtol=1e-9, atol=1e-9)  # the opened cache serves the block


def test_bad_token_ids_are_rejected() -> None:
    model = stand_in("llama")
    with pytest.raises(ValueError, match="mask token id"):
        HFTarget(model, VOCAB + 5, EOS_ID)


# ------------------------------------------------------------------------------------------- loading a folder


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory, tiny_codec) -> Path:
    """A saved stand-in (safetensors) with a transformers tokenizer built from the test tokenizer."""
    folder = tmp_path_factory.mktemp("hf") / "tiny-qwen3-dlm"
    model = stand_in("qwen3", seed=4, vocab=tiny_codec.vocab_size, dtype=torch.float32)
    model.config.mask_token_id = tiny_codec.mask_id
    model.save_pretrained(folder)
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tiny_codec.tokenizer, eos_token="<eos>", mask_token="<mask>", pad_token="<pad>"
    )
    tokenizer.save_pretrained(folder)
    return folder


def test_folder_loads_through_transformers_and_decodes_exactly(hf_folder: Path) -> None:
    assert is_hf_checkpoint(hf_folder)
    target, codec = load_target(hf_folder)
    assert isinstance(target, HFTarget) and target.name == "tiny-qwen3-dlm"
    assert target.mask_id == codec.mask_id == 2 and target.eos_id == 1
    question = "what is 3 + 4?"
    standard = generate([question], GenerateConfig(method="standard", block_length=8, gen_length=16), target, codec)
    stale = generate(
        [question], GenerateConfig(method="stale", budget=4, block_length=8, gen_length=16), target, codec
    )
    assert stale[0].raw_token_ids == standard[0].raw_token_ids
    assert isinstance(standard[0].text, str)


def test_folder_without_a_mask_token_is_a_clear_error(hf_folder: Path, tmp_path: Path) -> None:
    folder = tmp_path / "no-mask"
    folder.mkdir()
    for path in hf_folder.iterdir():
        (folder / path.name).write_bytes(path.read_bytes())
    config = json.loads((folder / "config.json").read_text())
    config.pop("mask_token_id")
    (folder / "config.json").write_text(json.dumps(config))
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    tokenizer_config.pop("mask_token", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    with pytest.raises(ValueError, match="mask"):
        load_hf_target(folder)
    assert load_hf_target(folder, mask_id=2)[0].mask_id == 2


def test_pickled_weights_are_refused(hf_folder: Path, tmp_path: Path) -> None:
    folder = tmp_path / "pickled"
    folder.mkdir()
    for path in hf_folder.iterdir():
        if path.suffix != ".safetensors":
            (folder / path.name).write_bytes(path.read_bytes())
    torch.save({}, folder / "pytorch_model.bin")
    with pytest.raises(ValueError, match="safetensors"):
        load_target(folder)


def test_cli_generate_with_a_transformers_folder(hf_folder: Path, capsys) -> None:
    code = main(
        [
            "generate",
            "--model",
            str(hf_folder),
            "--method",
            "stale",
            "--budget",
            "3",
            "--block-length",
            "8",
            "--gen-length",
            "16",
            "--prompt",
            "what is 2 + 2?",
        ]
    )
    assert code == 0
    assert "passes" in capsys.readouterr().out


def test_cli_collect_passes_the_transformers_options(hf_folder: Path, tmp_path: Path) -> None:
    def collect_top(*options: str) -> np.ndarray:
        out = tmp_path / ("traj" + "".join(options))
        args = ["collect", "--model", str(hf_folder), *options, "--out", str(out), "--n-prompts", "2"]
        assert main([*args, "--temperatures", "0", "--block-length", "8", "--gen-length", "16", "--depth", "2"]) == 0
        return load_shards(sorted(out.glob("shard_*.npz")))["top"]

    plain, shifted = collect_top(), collect_top("--shifted-logits")
    assert plain.shape[1:] == shifted.shape[1:] == (8, 32)
    assert not np.array_equal(plain[: len(shifted)], shifted[: len(plain)])  # the option reached the target


def test_cli_fit_bigram_counts_over_the_models_vocabulary(hf_folder: Path, tmp_path: Path) -> None:
    from spot_dlm.drafters.neighbours import load_bigram

    assert main(["fit-bigram", "--model", str(hf_folder), "--out", str(tmp_path), "--n-symbolic", "0"]) == 0
    target, _ = load_target(hf_folder)
    table = load_bigram(tmp_path, target.vocab_size)
    assert table.vocab_size == target.vocab_size and len(table.keys) > 100


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_spot_with_neighbour_tokens_equals_standard_on_a_transformers_target(temperature: float) -> None:
    from spot_dlm.drafters.neighbours import BigramTable, NeighbourTokens
    from spot_dlm.drafters.order_net import OrderModel, OrderModelConfig
    from spot_dlm.drafters.spot import SpotDrafter

    target = HFTarget(stand_in("qwen3", seed=3), MASK_ID, EOS_ID, shifted_logits=True)
    settings = DecodeSettings(CommitRule(temperature=temperature), block_length=6, gen_length=18, stop_at_eos=False)
    stream = np.random.default_rng(0).integers(3, VOCAB, 3000) ** 2 % VOCAB
    neighbours = NeighbourTokens(BigramTable.from_stream(stream, VOCAB), 2.0, 2.0)
    torch.manual_seed(0)
    model = OrderModel(OrderModelConfig(top_k=8, d_model=32, n_layers=1, n_heads=2)).eval()
    for seed in range(3):
        prompt = torch.randint(3, VOCAB, (4 + seed,), generator=torch.Generator().manual_seed(seed))
        key = NoiseKey(seed, request=seed)
        reference = decode_ids(target, prompt, settings, NoDrafter(), key)
        raw = decode_ids(target, prompt, settings, SpotDrafter(model, budget=6, depth=4, neighbours=neighbours), key)
        assert raw.token_ids.tolist() == reference.token_ids.tolist()
        assert raw.commit_step.tolist() == reference.commit_step.tolist()
