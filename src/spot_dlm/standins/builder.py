"""Write tiny random-weight checkpoint folders that load like the real SDAR, LLaDA, Dream and Fast-dLLM v2 ones."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch
from safetensors.torch import save_file

from spot_dlm.standins.tokenizer import (
    LLAMA3_TEMPLATE,
    QWEN_SYSTEM_TEMPLATE,
    QWEN_TEMPLATE,
    TokenizerSpec,
    build_tokenizer,
)

QWEN_SPECIALS = {151643: "<|endoftext|>", 151644: "<|im_start|>", 151645: "<|im_end|>"}


@dataclass(frozen=True)
class Sizes:
    """The model sizes a stand-in is built with."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    block_size: int | None
    max_position_embeddings: int


@dataclass(frozen=True)
class Family:
    """One family's folder layout: remote-code files, config, generation config and tokenizer."""

    template: str  # package under spot_dlm.standins.templates
    files: tuple[str, ...]  # the family's own files, copied into the folder
    shared: tuple[str, ...]  # files of spot_dlm.standins.templates the family's files import, copied beside them
    model_class: str  # "module.Class" of the class the weights belong to
    lm_head: str  # state-dict name of the output projection
    mask_id: int
    config: Callable[[Sizes], dict]
    generation: dict
    tokenizer: TokenizerSpec


def _qwen_sizes(sizes: Sizes) -> dict:
    return {
        "hidden_size": sizes.hidden_size,
        "intermediate_size": 2 * sizes.hidden_size,
        "num_hidden_layers": sizes.num_layers,
        "num_attention_heads": sizes.num_heads,
        "num_key_value_heads": sizes.num_kv_heads,
        "head_dim": sizes.hidden_size // sizes.num_heads,
        "max_position_embeddings": sizes.max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
    }


def _sdar_config(sizes: Sizes) -> dict:
    return {
        "architectures": ["SDARForCausalLM"],
        "model_type": "sdar",
        "auto_map": {
            "AutoConfig": "configuration_sdar.SDARConfig",
            "AutoModel": "modeling_sdar.SDARModel",
            "AutoModelForCausalLM": "modeling_sdar.SDARForCausalLM",
        },
        "vocab_size": 151936,
        **_qwen_sizes(sizes),
        "block_size": 4 if sizes.block_size is None else sizes.block_size,
        "mask_token_id": 151669,
        "bos_token_id": 151643,
        "eos_token_id": 151643,
        "pad_token_id": 151643,
    }


def _llada_config(sizes: Sizes) -> dict:
    return {
        "architectures": ["LLaDAModelLM"],
        "model_type": "llada",
        "auto_map": {
            "AutoConfig": "configuration_llada.LLaDAConfig",
            "AutoModel": "modeling_llada.LLaDAModelLM",
            "AutoModelForCausalLM": "modeling_llada.LLaDAModelLM",
        },
        "vocab_size": 126464,
        "embedding_size": 126464,
        "d_model": sizes.hidden_size,
        "mlp_hidden_size": 2 * sizes.hidden_size,
        "n_layers": sizes.num_layers,
        "n_heads": sizes.num_heads,
        "n_kv_heads": sizes.num_kv_heads,
        "max_sequence_length": sizes.max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "weight_tying": False,
        "bos_token_id": 126080,
        "eos_token_id": 126081,
        "pad_token_id": 126081,
    }


def _dream_config(sizes: Sizes) -> dict:
    return {
        "architectures": ["DreamModel"],
        "model_type": "Dream",
        "auto_map": {"AutoConfig": "configuration_dream.DreamConfig", "AutoModel": "modeling_dream.DreamModel"},
        "vocab_size": 152064,
        **_qwen_sizes(sizes),
        "mask_token_id": 151666,
        "bos_token_id": 151643,
        "eos_token_id": 151643,
        "pad_token_id": 151643,
    }


def _fast_dllm_v2_config(sizes: Sizes) -> dict:
    return {
        "architectures": ["Fast_dLLM_QwenForCausalLM"],
        "model_type": "Fast_dLLM_Qwen",
        "auto_map": {
            "AutoConfig": "configuration.Fast_dLLM_QwenConfig",
            "AutoModelForCausalLM": "modeling.Fast_dLLM_QwenForCausalLM",
        },
        "vocab_size": 151936,
        **_qwen_sizes(sizes),
        "bd_size": 32 if sizes.block_size is None else sizes.block_size,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
    }


QWEN_SHARED = ("configuration_base.py", "layers.py")
_QWEN_ROLES = {"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"}

SPECS: dict[str, Family] = {
    "sdar": Family(
        template="sdar",
        files=("configuration_sdar.py", "modeling_sdar.py"),
        shared=QWEN_SHARED,
        model_class="modeling_sdar.SDARForCausalLM",
        lm_head="lm_head.weight",
        mask_id=151669,
        config=_sdar_config,
        generation={"bos_token_id": 151643, "eos_token_id": [151645, 151643], "pad_token_id": 151643},
        tokenizer=TokenizerSpec(
            vocab_size=151936,
            specials={**QWEN_SPECIALS, 151669: "<|MASK|>"},
            roles={**_QWEN_ROLES, "mask_token": "<|MASK|>"},
            chat_template=QWEN_TEMPLATE,
        ),
    ),
    "llada": Family(
        template="llada",
        files=("configuration_llada.py", "modeling_llada.py"),
        shared=("layers.py",),
        model_class="modeling_llada.LLaDAModelLM",
        lm_head="model.transformer.ff_out.weight",
        mask_id=126336,
        config=_llada_config,
        generation={"bos_token_id": 126080, "eos_token_id": 126081, "pad_token_id": 126081},
        tokenizer=TokenizerSpec(
            vocab_size=126464,
            specials={
                126080: "<|startoftext|>",
                126081: "<|endoftext|>",
                126336: "<|mdm_mask|>",
                126346: "<|start_header_id|>",
                126347: "<|end_header_id|>",
                126348: "<|eot_id|>",
            },
            roles={
                "bos_token": "<|startoftext|>",
                "eos_token": "<|endoftext|>",
                "pad_token": "<|endoftext|>",
                "mask_token": "<|mdm_mask|>",
            },
            chat_template=LLAMA3_TEMPLATE,
        ),
    ),
    "dream": Family(
        template="dream",
        files=("configuration_dream.py", "modeling_dream.py"),
        shared=QWEN_SHARED,
        model_class="modeling_dream.DreamModel",
        lm_head="lm_head.weight",
        mask_id=151666,
        config=_dream_config,
        generation={"bos_token_id": 151643, "eos_token_id": 151643, "pad_token_id": 151643},
        tokenizer=TokenizerSpec(
            vocab_size=152064,
            specials={**QWEN_SPECIALS, 151665: "<|beginoftext|>", 151666: "<|mask|>"},
            roles={**_QWEN_ROLES, "bos_token": "<|beginoftext|>", "mask_token": "<|mask|>"},
            chat_template=QWEN_SYSTEM_TEMPLATE,
        ),
    ),
    "fast_dllm_v2": Family(
        template="fast_dllm_v2",
        files=("configuration.py", "modeling.py"),
        shared=QWEN_SHARED,
        model_class="modeling.Fast_dLLM_QwenForCausalLM",
        lm_head="lm_head.weight",
        mask_id=151665,
        config=_fast_dllm_v2_config,
        generation={"bos_token_id": 151643, "eos_token_id": 151645, "pad_token_id": 151643},
        tokenizer=TokenizerSpec(
            vocab_size=151936,
            specials={**QWEN_SPECIALS, 151665: "|<MASK>|"},
            roles={"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "mask_token": "|<MASK>|"},
            chat_template=QWEN_SYSTEM_TEMPLATE,
        ),
    ),
}
FAMILIES = tuple(SPECS)


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (the config's spelling)."""
    return str(dtype).removeprefix("torch.")


def check_sizes(sizes: Sizes) -> None:
    """Reject sizes the attention cannot use (uneven head split, odd head size)."""
    if sizes.hidden_size % sizes.num_heads or sizes.num_heads % sizes.num_kv_heads:
        raise ValueError("hidden_size must divide by num_heads, and num_heads by num_kv_heads")
    if (sizes.hidden_size // sizes.num_heads) % 2:
        raise ValueError("the head size (hidden_size / num_heads) must be even for rotary positions")


def write_remote_code(family: Family, folder: Path) -> None:
    """Copy the family's configuration and modeling files, and the shared files they import, into ``folder``."""
    templates = resources.files(f"{__package__}.templates")
    for name in family.files:
        (folder / name).write_bytes((templates / family.template / name).read_bytes())
    for name in family.shared:
        (folder / name).write_bytes((templates / name).read_bytes())


def meta_model(family: Family, folder: Path, config: dict) -> torch.nn.Module:
    """The family's model built on the meta device (parameter names and shapes, no storage).

    The class comes from the remote code written into ``folder``, imported by transformers as a checkpoint's remote
    code is (its relative imports copied beside it in transformers' module cache).
    """
    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    model_class = get_class_from_dynamic_module(family.model_class, folder, local_files_only=True)
    with torch.device("meta"):
        return model_class(model_class.config_class.from_dict(config))


def random_weights(model: torch.nn.Module, seed: int, scale: float, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Norm weights 1; every other weight N(0, scale^2), drawn in float32 from a seeded generator."""
    norms = {f"{name}.weight" for name, module in model.named_modules() if type(module).__name__.endswith("RMSNorm")}
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for name, param in model.state_dict().items():
        value = torch.ones(param.shape) if name in norms else torch.randn(param.shape, generator=generator) * scale
        weights[name] = value.to(dtype)
    return weights


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")


def build_standin(
    family: str,
    folder: str | Path,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    hidden_size: int = 32,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    block_size: int | None = None,
    max_position_embeddings: int = 2048,
    weight_scale: float = 0.4,
) -> Path:
    """Write a random-weight checkpoint of ``family`` into ``folder`` and return the folder.

    The folder holds config.json (with ``auto_map``), the family's configuration and modeling files with the shared
    ``layers.py`` (and ``configuration_base.py``) they import relatively, safetensors weights in ``dtype`` (norm
    weights 1, every other weight N(0, weight_scale^2) from ``seed``, the mask token's output row zeroed),
    generation_config.json and a tokenizer whose special tokens sit at the family's real ids.
    ``block_size`` is SDAR's ``block_size`` (default 4) or Fast-dLLM v2's ``bd_size`` (default 32); LLaDA and
    Dream have no block size.
    """
    if family not in SPECS:
        raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")
    spec = SPECS[family]
    sizes = Sizes(hidden_size, num_layers, num_heads, num_kv_heads, block_size, max_position_embeddings)
    check_sizes(sizes)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = {**spec.config(sizes), "torch_dtype": dtype_name(dtype), "dtype": dtype_name(dtype)}

    write_remote_code(spec, folder)
    _write_json(folder / "config.json", config)
    _write_json(folder / "generation_config.json", spec.generation)

    weights = random_weights(meta_model(spec, folder, config), seed, weight_scale, dtype)
    weights[spec.lm_head][spec.mask_id] = 0
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    tokenizer = build_tokenizer(spec.tokenizer)
    tokenizer.model_max_length = max_position_embeddings
    tokenizer.save_pretrained(folder)
    return folder
