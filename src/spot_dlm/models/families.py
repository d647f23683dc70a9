"""Real DLM families: recognised from a checkpoint's config.json and described by what their authors' loop needs.

A family says how its authors decode: which ``transformers`` auto class loads it, whether attention is block-causal
over a KV cache (SDAR, Fast-dLLM v2) or full over the whole canvas with no cache (LLaDA, Dream), where the block grid
is anchored, whether logits are shifted, whether decoding stops after a block holding a stop token, and where the
trained block length is written in the config. Stock Qwen2 / Qwen3 / Llama bodies are the ``generic`` family, driven
as a block-diffusion target by ``models/hf.py`` with the project's own rule. See ``reference/real-dlm-loops.md``
(shared) for the loops themselves.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Family:
    name: str
    title: str  # how users and papers name it
    auto_class: str  # the transformers auto class the authors load it with
    attention: str  # "block_causal" (a KV cache of finished blocks) or "full_canvas" (every pass sees everything)
    grid: str  # "absolute": blocks at multiples of L from position 0, prompt included; "after_prompt"; "whole"
    shifted: bool  # token j is predicted at position j - 1
    stops_early: bool  # decoding ends after a block holding a stop token (else every position is decoded)
    block_size_key: str | None  # the config key of the trained block length
    default_mask_id: int | None  # the authors' hard-coded mask id, where the config names none
    default_block_length: int  # when the config names none
    loop: str  # the authors' loop reproduced as this family's standard method


SDAR = Family(
    "sdar",
    "SDAR / TraDo",
    "AutoModelForCausalLM",
    "block_causal",
    "absolute",
    shifted=False,
    stops_early=True,
    block_size_key="block_size",
    default_mask_id=None,
    default_block_length=4,
    loop="JetAstra/SDAR evaluation wrapper (huggingface_bd3.py): static top-k per pass, greedy = top_k 1",
)
LLADA = Family(
    "llada",
    "LLaDA",
    "AutoModel",
    "full_canvas",
    "after_prompt",
    shifted=False,
    stops_early=False,
    block_size_key=None,
    default_mask_id=126336,
    default_block_length=32,
    loop="ML-GSAI/LLaDA generate.py: low_confidence remasking, steps spread over blocks",
)
DREAM = Family(
    "dream",
    "Dream",
    "AutoModel",
    "full_canvas",
    "whole",
    shifted=True,
    stops_early=False,
    block_size_key=None,
    default_mask_id=151666,
    default_block_length=0,
    loop="Dream diffusion_generate (alg entropy, alg_temp 0): float32 linspace schedule over the whole canvas",
)
FAST_DLLM_V2 = Family(
    "fast_dllm_v2",
    "Fast-dLLM v2",
    "AutoModelForCausalLM",
    "block_causal",
    "absolute",
    shifted=True,
    stops_early=True,
    block_size_key="bd_size",
    default_mask_id=151665,
    default_block_length=32,
    loop="NVlabs/Fast-dLLM v2 batch_sample: sub-blocks of 8 left to right, threshold 1, store pass per block",
)
GENERIC = Family(
    "generic",
    "stock Qwen2 / Qwen3 / Llama body",
    "AutoModelForCausalLM",
    "block_causal",
    "after_prompt",
    shifted=False,
    stops_early=True,
    block_size_key=None,
    default_mask_id=None,
    default_block_length=32,
    loop="the project's own loop (float64 rule, one commit per pass)",
)
FAMILIES: dict[str, Family] = {f.name: f for f in (SDAR, LLADA, DREAM, FAST_DLLM_V2, GENERIC)}
GENERIC_MODEL_TYPES = ("qwen2", "qwen3", "llama")
LLADA_END_OF_TURN = 126348  # <|eot_id|>: ends an Instruct answer as EOS does

# what names each family in config.json: model_type values and architecture names (lower case)
_MARKERS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "sdar": (("sdar", "trado"), ("sdarforcausallm", "tradoforcausallm")),
    "llada": (("llada",), ("lladamodellm",)),
    "dream": (("dream",), ("dreammodel",)),
    "fast_dllm_v2": (("fast_dllm_qwen",), ("fast_dllm_qwenforcausallm",)),
}


class UnknownFamily(ValueError):
    pass


def detect_family(config: dict, declared: str | None = None) -> Family:
    """The family of a checkpoint from its config.json (``model_type``, ``architectures``, ``auto_map``), or the
    ``declared`` one. Unknown remote-code models are an error that lists the families."""
    if declared is not None:
        if declared not in FAMILIES:
            raise UnknownFamily(f"unknown family {declared!r}; choose one of {', '.join(FAMILIES)}")
        return FAMILIES[declared]
    model_type = str(config.get("model_type", "")).lower()
    architectures = [str(a).lower() for a in config.get("architectures") or []]
    auto_map = " ".join(str(v).lower() for v in (config.get("auto_map") or {}).values())
    for name, (types, archs) in _MARKERS.items():
        if model_type in types or any(a in archs for a in architectures) or any(t in auto_map for t in types):
            return FAMILIES[name]
    if model_type in GENERIC_MODEL_TYPES and not config.get("auto_map"):
        return GENERIC
    known = ", ".join(f.title for f in FAMILIES.values())
    raise UnknownFamily(
        f"model_type {config.get('model_type')!r} (architectures {config.get('architectures')}) is not a known DLM "
        f"family ({known}); a body whose forward takes input_ids, a 4-D attention mask, position_ids and "
        "past_key_values can be driven as a generic block-diffusion target with --family generic"
    )


def read_json(path: Path) -> dict:
    """A JSON object from a file, {} when the file is absent; a clear error when it is not JSON."""
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path} is not valid JSON: {err}") from err
    if not isinstance(value, dict):
        raise ValueError(f"{path} holds no JSON object")
    return value


def id_list(value) -> tuple[int, ...]:
    """Token ids from a config value: an int, a list of ints, or None."""
    if value is None:
        return ()
    if isinstance(value, (list, tuple)):
        return tuple(int(v) for v in value)
    return (int(value),)


def stop_ids(folder: Path, config: dict, family: Family) -> tuple[int, ...]:
    """The stop set: ``generation_config.json``'s ``eos_token_id`` (a list) where present, else the config's; LLaDA
    adds its end-of-turn token (126348) when the tokenizer has it: both end an answer."""
    generation = read_json(folder / "generation_config.json")
    ids = id_list(generation.get("eos_token_id")) or id_list(config.get("eos_token_id"))
    has_end_of_turn = int(config.get("vocab_size", 0)) > LLADA_END_OF_TURN
    if family.name == "llada" and has_end_of_turn and LLADA_END_OF_TURN not in ids:
        ids = (*ids, LLADA_END_OF_TURN)
    return ids


def trained_block_length(config: dict, family: Family) -> int | None:
    """The block length the checkpoint was trained with, where its config says."""
    if family.block_size_key and config.get(family.block_size_key):
        return int(config[family.block_size_key])
    return None
