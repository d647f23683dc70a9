"""Stand-in checkpoints of SDAR, LLaDA, Dream and Fast-dLLM v2: folder layout, tokenizer and forward interfaces.

Every folder is loaded back from disk the way the real checkpoint is (remote code, safetensors, local files only).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from safetensors.torch import load_file  # noqa: E402
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer, DynamicCache  # noqa: E402

from spot_dlm.standins import FAMILIES, build_standin  # noqa: E402

AUTO_CLASS = {
    "sdar": AutoModelForCausalLM,
    "llada": AutoModel,
    "dream": AutoModel,
    "fast_dllm_v2": AutoModelForCausalLM,
}
ARCHITECTURE = {
    "sdar": "SDARForCausalLM",
    "llada": "LLaDAModelLM",
    "dream": "DreamModel",
    "fast_dllm_v2": "Fast_dLLM_QwenForCausalLM",
}
MODEL_TYPE = {"sdar": "sdar", "llada": "llada", "dream": "Dream", "fast_dllm_v2": "Fast_dLLM_Qwen"}
VOCAB = {"sdar": 151936, "llada": 126464, "dream": 152064, "fast_dllm_v2": 151936}
MASK = {"sdar": 151669, "llada": 126336, "dream": 151666, "fast_dllm_v2": 151665}
SPECIALS = {
    "sdar": {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645, "<|MASK|>": 151669},
    "llada": {
        "<|startoftext|>": 126080,
        "<|endoftext|>": 126081,
        "<|mdm_mask|>": 126336,
        "<|start_header_id|>": 126346,
        "<|end_header_id|>": 126347,
        "<|eot_id|>": 126348,
    },
    "dream": {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645, "<|mask|>": 151666},
    "fast_dllm_v2": {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645, "|<MASK>|": 151665},
}
GENERATION_EOS = {"sdar": [151645, 151643], "llada": 126081, "dream": 151643, "fast_dllm_v2": 151645}
TEXT = "The cat sat on the mat. What is 12 + 30? The answer is 42."


pytestmark = pytest.mark.usefixtures("remote_code_cache")


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """One float64 stand-in per family (float64 so that equal computations compare tightly)."""
    root = tmp_path_factory.mktemp("standins")
    return {family: build_standin(family, root / family, dtype=torch.float64) for family in FAMILIES}


@pytest.fixture(scope="module")
def loaded(folders) -> dict:
    """(model, tokenizer) per family, loaded from disk like the real checkpoints."""
    return {family: load(family, folder) for family, folder in folders.items()}


def load(family: str, folder: Path):
    model = AUTO_CLASS[family].from_pretrained(
        folder, trust_remote_code=True, local_files_only=True, use_safetensors=True
    )
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True, trust_remote_code=True)
    return model.eval(), tokenizer


def random_ids(length: int, seed: int = 0, batch: int = 1) -> torch.Tensor:
    """Ids [B, N] from the base vocabulary."""
    return torch.randint(0, 500, (batch, length), generator=torch.Generator().manual_seed(seed))


def logits(model, ids: torch.Tensor, **kwargs) -> torch.Tensor:
    with torch.no_grad():
        return model(ids, **kwargs).logits  # [B, N, V]


def block_causal(length: int, block: int) -> torch.Tensor:
    """[1, 1, N, N] bool: a token sees its own block and every earlier one."""
    blocks = torch.arange(length) // block
    return (blocks[:, None] >= blocks[None, :])[None, None]


# ---------------------------------------------------------------- folder, config, tokenizer


@pytest.mark.parametrize("family", FAMILIES)
def test_folder_config_and_generation_config(folders, family):
    folder = folders[family]
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == MODEL_TYPE[family]
    assert config["architectures"] == [ARCHITECTURE[family]]
    assert config["vocab_size"] == VOCAB[family]
    assert config["torch_dtype"] == config["dtype"] == "float64"
    for reference in config["auto_map"].values():
        assert (folder / f"{reference.split('.')[0]}.py").is_file()
    auto_key = "AutoModelForCausalLM" if AUTO_CLASS[family] is AutoModelForCausalLM else "AutoModel"
    assert config["auto_map"][auto_key].endswith(f".{ARCHITECTURE[family]}")
    assert config.get("mask_token_id") == {"sdar": 151669, "dream": 151666}.get(family)
    assert config.get("block_size") == (4 if family == "sdar" else None)
    assert config.get("bd_size") == (32 if family == "fast_dllm_v2" else None)
    generation = json.loads((folder / "generation_config.json").read_text())
    assert generation["eos_token_id"] == GENERATION_EOS[family]
    assert (folder / "model.safetensors").is_file()
    assert not [path for path in folder.iterdir() if path.suffix in (".bin", ".pt", ".pth", ".pkl")]


@pytest.mark.parametrize("family", FAMILIES)
def test_remote_code_imports_only_files_of_the_folder(folders, family):
    """The family's files import the shared layers (and configuration base) relatively; all of them sit in the
    folder, so transformers copies them into its module cache beside the family's files."""
    from transformers.dynamic_module_utils import get_relative_import_files

    folder = folders[family]
    config = json.loads((folder / "config.json").read_text())
    for reference in config["auto_map"].values():
        needed = get_relative_import_files(folder / f"{reference.split('.')[0]}.py")
        assert all(Path(path).is_file() and Path(path).parent == folder for path in needed)
    modeling = next(name for name in config["auto_map"].values() if "modeling" in name).split(".")[0]
    assert {Path(path).name for path in get_relative_import_files(folder / f"{modeling}.py")} >= {"layers.py"}
    assert (folder / "layers.py").read_bytes() == (folders["sdar"] / "layers.py").read_bytes()


@pytest.mark.parametrize("family", FAMILIES)
def test_tokenizer_special_ids_text_and_chat_template(loaded, family):
    _, tokenizer = loaded[family]
    assert len(tokenizer) == VOCAB[family]
    for token, token_id in SPECIALS[family].items():
        assert tokenizer.convert_tokens_to_ids(token) == token_id
        assert tokenizer(token, add_special_tokens=False)["input_ids"] == [token_id]
    assert tokenizer.mask_token_id == MASK[family]
    ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    assert max(ids) < 512
    assert tokenizer.decode(ids) == TEXT
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi there"}], add_generation_prompt=True, tokenize=False
    )
    if family == "llada":
        assert chat.startswith("<|startoftext|><|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|>")
        assert chat.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
    else:
        assert "<|im_start|>user\nHi there<|im_end|>\n" in chat
        assert chat.endswith("<|im_start|>assistant\n")


# ---------------------------------------------------------------- every family


@pytest.mark.parametrize("family", FAMILIES)
def test_loads_with_full_vocabulary_logits_that_avoid_the_mask(loaded, family):
    model, tokenizer = loaded[family]
    assert type(model).__name__ == ARCHITECTURE[family]
    ids = torch.cat([random_ids(8), torch.full((1, 24), MASK[family])], dim=1)
    out = logits(model, ids)
    assert out.shape == (1, 32, VOCAB[family]) and out.dtype == torch.float64
    assert (out.argmax(-1) != MASK[family]).all()
    assert (out[..., MASK[family]] == 0).all()


@pytest.mark.parametrize(("family", "dtype"), [("sdar", torch.bfloat16), ("llada", torch.float32)])
def test_dtype_of_weights_and_logits(tmp_path, family, dtype):
    folder = build_standin(family, tmp_path / family, dtype=dtype, seed=3)
    assert {tensor.dtype for tensor in load_file(folder / "model.safetensors").values()} == {dtype}
    model, _ = load(family, folder)
    assert model.dtype == dtype
    assert logits(model, random_ids(6)).dtype == dtype


def test_seeded_weights_and_unknown_family(tmp_path):
    first = load_file(build_standin("dream", tmp_path / "a", hidden_size=16, seed=1) / "model.safetensors")
    again = load_file(build_standin("dream", tmp_path / "b", hidden_size=16, seed=1) / "model.safetensors")
    other = load_file(build_standin("dream", tmp_path / "c", hidden_size=16, seed=2) / "model.safetensors")
    assert all(torch.equal(first[name], again[name]) for name in first)
    assert not torch.equal(first["lm_head.weight"], other["lm_head.weight"])
    with pytest.raises(ValueError, match="unknown family"):
        build_standin("bert", tmp_path / "d")


# ---------------------------------------------------------------- SDAR


def test_sdar_bool_cast_mask(loaded):
    model, _ = loaded["sdar"]
    ids = random_ids(8)
    reference = logits(model, ids)
    assert torch.equal(logits(model, ids, attention_mask=torch.ones(1, 1, 8, 8)), reference)
    allowed = block_causal(8, 4)
    additive = torch.zeros(1, 1, 8, 8, dtype=torch.float64).masked_fill(~allowed, torch.finfo(torch.float64).min)
    masked = logits(model, ids, attention_mask=allowed)
    assert not torch.allclose(masked, reference)
    assert torch.equal(logits(model, ids, attention_mask=allowed.double()), masked)
    assert not torch.allclose(logits(model, ids, attention_mask=additive), masked, equal_nan=True)


def test_sdar_cache_written_only_with_store_kv(loaded):
    model, _ = loaded["sdar"]
    ids = random_ids(8)
    cache = DynamicCache()
    logits(model, ids, past_key_values=cache)
    assert cache.get_seq_length() == 0
    logits(model, ids, past_key_values=cache, store_kv=True)
    assert cache.get_seq_length() == 8 and len(cache.layers) == model.config.num_hidden_layers
    logits(model, random_ids(4, seed=1), past_key_values=cache)
    assert cache.get_seq_length() == 8


def test_sdar_prefix_cache_equals_block_causal_pass(loaded):
    model, _ = loaded["sdar"]
    ids = random_ids(12)
    full = logits(model, ids, attention_mask=block_causal(12, 4))
    cache = DynamicCache()
    prefix = logits(model, ids[:, :8], attention_mask=block_causal(8, 4), past_key_values=cache, store_kv=True)
    block = logits(model, ids[:, 8:], attention_mask=torch.ones(1, 1, 4, 12), past_key_values=cache)
    torch.testing.assert_close(prefix, full[:, :8], rtol=0, atol=1e-10)
    torch.testing.assert_close(block, full[:, 8:], rtol=0, atol=1e-10)
    assert cache.get_seq_length() == 8


# ---------------------------------------------------------------- Fast-dLLM v2


def test_v2_ignores_attention_mask_and_is_block_causal(loaded):
    model, _ = loaded["fast_dllm_v2"]
    ids = random_ids(40)
    reference = logits(model, ids)
    assert torch.equal(logits(model, ids, attention_mask=torch.zeros(1, 1, 40, 40, dtype=torch.bool)), reference)
    assert torch.equal(logits(model, ids, attention_mask=torch.ones(1, 40)), reference)
    later = ids.clone()
    later[0, 35] = (later[0, 35] + 1) % 500
    changed = logits(model, later)
    assert torch.equal(changed[:, :32], reference[:, :32])  # block 0 does not see block 1
    assert not torch.allclose(changed[:, 32:], reference[:, 32:])
    inside = ids.clone()
    inside[0, 20] = (inside[0, 20] + 1) % 500
    assert not torch.allclose(logits(model, inside)[:, 0], reference[:, 0])  # bidirectional inside a block


def test_v2_cache_written_only_on_update(loaded):
    model, _ = loaded["fast_dllm_v2"]
    ids = random_ids(40)
    full = logits(model, ids)
    cache = DynamicCache()
    logits(model, ids[:, :32], past_key_values=cache)
    assert cache.get_seq_length() == 0
    prefix = logits(model, ids[:, :32], past_key_values=cache, update_past_key_values=True)
    assert cache.get_seq_length() == 32
    block = logits(model, ids[:, 32:], past_key_values=cache)
    assert cache.get_seq_length() == 32
    torch.testing.assert_close(prefix, full[:, :32], rtol=0, atol=1e-10)
    torch.testing.assert_close(block, full[:, 32:], rtol=0, atol=1e-10)


def test_v2_batch_with_expanded_cache_equals_single_rows(loaded):
    model, _ = loaded["fast_dllm_v2"]
    cache = DynamicCache()
    logits(model, random_ids(32), past_key_values=cache, update_past_key_values=True)
    blocks = random_ids(32, seed=1, batch=2)
    singles = torch.cat([logits(model, blocks[row : row + 1], past_key_values=cache) for row in range(2)])
    expanded = DynamicCache()
    for index, layer in enumerate(cache.layers):
        expanded.update(layer.keys.expand(2, -1, -1, -1), layer.values.expand(2, -1, -1, -1), index)
    torch.testing.assert_close(logits(model, blocks, past_key_values=expanded), singles, rtol=0, atol=1e-10)
    assert expanded.get_seq_length() == 32


# ---------------------------------------------------------------- LLaDA and Dream


def test_llada_has_no_position_ids_and_attends_to_the_future(loaded):
    model, _ = loaded["llada"]
    ids = random_ids(10)
    with pytest.raises(TypeError):
        model(ids, position_ids=torch.arange(10)[None])
    with pytest.raises(TypeError):
        model(ids, store_kv=True)
    reference = logits(model, ids)
    assert torch.equal(logits(model, ids, attention_mask=torch.zeros(1, 10)), reference)
    later = ids.clone()
    later[0, -1] = (later[0, -1] + 1) % 500
    assert not torch.allclose(logits(model, later)[:, 0], reference[:, 0])
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True, last_logits_only=True)
    assert out.logits.shape == (1, 1, VOCAB["llada"])
    assert len(out.cache) == model.config.n_layers and out.cache[0][0].shape[-2] == 10


def test_dream_full_attention_and_masks(loaded):
    model, _ = loaded["dream"]
    ids = random_ids(10)
    reference = logits(model, ids)
    assert torch.equal(logits(model, ids, attention_mask="full"), reference)
    later = ids.clone()
    later[0, -1] = (later[0, -1] + 1) % 500
    assert not torch.allclose(logits(model, later)[:, 0], reference[:, 0])
    causal = torch.ones(10, 10, dtype=torch.bool).tril()[None, None]
    torch.testing.assert_close(
        logits(model, later, attention_mask=causal)[:, :9], logits(model, ids, attention_mask=causal)[:, :9]
    )
