"""Targets served by a Hugging Face ``transformers`` model used as a block-diffusion LM.

Any ``AutoModelForCausalLM`` whose forward takes ``input_ids, attention_mask (4-D), position_ids,
past_key_values`` (Llama, Qwen2/3 and the SDAR / Fast-dLLM v2 / Dream families built on them) is driven with the
same query layouts and masks as the built-in target (``models/layout.py``): clean tokens (prompt, finished blocks)
attend causally, a candidate block attends to every clean token and bidirectionally to itself. The K candidate
states of a pass are packed into one row, each seeing the prefix and itself only, so the prefix ``DynamicCache`` is
shared without copies; after the pass the cache is cut back to the clean tokens.

``shifted_logits``: Dream and Fast-dLLM v2 predict token j from the hidden state at j - 1 (position 0 of a block
from the last clean token); SDAR and LLaDA predict token j at j.

This is the *generic* family (stock Qwen2 / Qwen3 / Llama bodies). SDAR, LLaDA, Dream and Fast-dLLM v2 are driven
through their own interfaces and loops by ``models/family_targets.py``.
"""

from __future__ import annotations

import inspect
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from spot_dlm.models.base import HandoffScore, PassCounter, ScoreResult
from spot_dlm.models.layout import attention_mask, block_layout, clean_layout, concat
from spot_dlm.models.tokenizer import format_prompt


@dataclass(frozen=True)
class HFPrefix:
    """The clean prefix: its tokens, the model's KV cache of them, and the logits at the last one."""

    tokens: torch.Tensor  # int64 [C]
    kv: Any  # a transformers Cache holding exactly C positions (updated in place by the next pass)
    last_logits: torch.Tensor  # [V]: output at the last clean token (predicts block position 0 when shifted)

    @property
    def length(self) -> int:
        return int(self.tokens.shape[0])


def keep_first(kv: Any, n_tokens: int) -> None:
    """Cut a transformers cache back to its first ``n_tokens`` positions (in place)."""
    extra = kv.get_seq_length() - n_tokens
    if extra > 0:
        kv.crop(-extra)


def cache_keyword(model: Any) -> str:
    """The forward's name for the KV cache: ``cache`` in current transformers, ``past_key_values`` in remote code
    (SDAR, Dream) and older releases."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """bool [Q, K] (True = may attend) -> additive float mask [1, 1, Q, K] that every attention backend accepts."""
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return mask.masked_fill(~allowed, torch.finfo(dtype).min)[None, None]


@dataclass
class HFTarget:
    """A ``transformers`` causal-LM architecture behind the ``Target`` protocol (see the module docstring)."""

    model: Any  # a transformers PreTrainedModel with a causal-LM head, in eval mode
    mask_id: int
    eos_id: int
    shifted_logits: bool = False
    name: str = "hf"
    counter: PassCounter = field(default_factory=PassCounter)

    def __post_init__(self) -> None:
        config = self.model.config
        self.vocab_size = int(config.vocab_size)
        self.max_length = int(getattr(config, "max_position_embeddings", 0) or 0)
        for label, token in (("mask", self.mask_id), ("EOS", self.eos_id)):
            if not 0 <= token < self.vocab_size:
                raise ValueError(f"{label} token id {token} is outside the model's vocabulary of {self.vocab_size}")
        if self.max_length < 1:
            raise ValueError("the model config has no max_position_embeddings: its context length is unknown")

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def _forward(
        self, cache: HFPrefix | None, clean: torch.Tensor, blocks: torch.Tensor, handoffs: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, Any, list]:
        """One pass over [clean | candidate 0 | candidate 1 | ... | hand-off 0 | ...] after the cached prefix; a
        hand-off is a complete candidate of the block (clean) and the all-mask next block after it, its own branch.

        clean int64 [Nc]; blocks int64 [K, L]; handoffs int64 [M, L] or None -> (logits [Nc + K L + 2 M L, V], the
        cache now holding prefix + clean, per hand-off the (keys, values) of its complete candidate per layer).
        """
        from transformers import DynamicCache

        n_past = 0 if cache is None else cache.length
        n_clean, (n_nodes, length) = clean.shape[0], blocks.shape
        n_handoffs = 0 if handoffs is None else handoffs.shape[0]
        device, start = self.device, n_past + n_clean
        branches = [
            concat(
                clean_layout(start, length, device, n_nodes + m),
                block_layout(start + length, length, n_nodes + m, device, n_nodes + m),
            )
            for m in range(n_handoffs)
        ]
        layout = concat(
            clean_layout(n_past, n_clean, device),
            *(block_layout(start, length, k, device) for k in range(n_nodes)),
            *branches,
        )
        masks = torch.full((n_handoffs, length), self.mask_id, dtype=torch.int64, device=device)
        handoff_ids = blocks.new_zeros(0) if handoffs is None else torch.cat([handoffs, masks], 1).reshape(-1)
        kv = DynamicCache(config=self.model.config) if cache is None else cache.kv
        dtype = next(self.model.parameters()).dtype
        out = self.model(
            input_ids=torch.cat([clean, blocks.reshape(-1), handoff_ids])[None],
            attention_mask=additive_mask(attention_mask(layout, n_past), dtype),
            position_ids=layout.positions[None],
            use_cache=True,
            **{cache_keyword(self.model): kv},
        )
        first = start + n_nodes * length  # the first hand-off's first column in the cache
        written = [
            [
                (layer.keys[:, :, at : at + length].clone(), layer.values[:, :, at : at + length].clone())
                for layer in kv.layers
            ]
            for at in range(first, first + 2 * length * n_handoffs, 2 * length)
        ]
        keep_first(kv, start)
        self.counter.record(len(layout))
        return out.logits[0], kv, written

    @staticmethod
    def _extend(cache: HFPrefix | None, clean: torch.Tensor, logits: torch.Tensor, kv: Any) -> HFPrefix:
        tokens = clean if cache is None else torch.cat([cache.tokens, clean])
        return HFPrefix(tokens=tokens, kv=kv, last_logits=logits[clean.shape[0] - 1])

    @torch.no_grad()
    def prefill(self, prompt_ids: torch.Tensor) -> HFPrefix:
        """prompt_ids int64 [P], P >= 1."""
        if prompt_ids.ndim != 1 or prompt_ids.shape[0] == 0:
            raise ValueError("the prompt must be a non-empty 1-D tensor of token ids")
        prompt_ids = prompt_ids.to(self.device)
        logits, kv, _ = self._forward(None, prompt_ids, prompt_ids.new_zeros(0, 1))
        return self._extend(None, prompt_ids, logits, kv)

    @torch.no_grad()
    def score(self, cache: HFPrefix, blocks: torch.Tensor, finished: torch.Tensor | None = None) -> ScoreResult:
        """Logits [K, L, V] of K candidate states; ``finished`` (int64 [L']) is written to the cache first.

        The cache object passed in is advanced in place: use the returned one afterwards. Cache None: ``finished``
        is the prompt, prefilled in this pass."""
        if cache is None and (finished is None or finished.numel() == 0):
            raise ValueError("scoring without a cache needs the prompt as the finished text")
        clean = blocks.new_zeros(0) if finished is None else finished.to(self.device)
        n_nodes, block_length = blocks.shape
        logits, kv, _ = self._forward(cache, clean, blocks.to(self.device))
        new_cache = cache if finished is None else self._extend(cache, clean, logits, kv)
        nodes = logits[clean.shape[0] :].reshape(n_nodes, block_length, -1)  # [K, L, V]
        return ScoreResult(logits=self._blocks(nodes, new_cache.last_logits), cache=new_cache)

    def _blocks(self, logits: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
        """Per-position logits of candidate blocks from the pass's rows: with shifted logits position 0 comes from
        the last clean token (``last`` [V] or [K, V]). logits [K, L, V] -> [K, L, V]"""
        if not self.shifted_logits:
            return logits
        return torch.cat([last.expand(logits.shape[0], -1)[:, None], logits[:, :-1]], dim=1)

    @torch.no_grad()
    def score_handoffs(self, cache: HFPrefix, blocks: torch.Tensor, handoffs: torch.Tensor) -> HandoffScore:
        """One pass: logits [K, L, V] of K candidate states and, for each of M complete candidates of the block
        (int64 [M, L]), those of the all-mask next block with that candidate written as the finished block.

        The cache is cut back to the prefix after the pass; ``opening(m)`` writes candidate m's keys and values
        into it (in place: open one hand-off, then use only the returned cache)."""
        device = self.device
        (n_nodes, length), n_handoffs = blocks.shape, handoffs.shape[0]
        logits, kv, written = self._forward(
            cache, blocks.new_zeros(0, device=device), blocks.to(device), handoffs.to(device)
        )
        nodes = self._blocks(logits[: n_nodes * length].reshape(n_nodes, length, -1), cache.last_logits)
        rows = logits[n_nodes * length :].reshape(n_handoffs, 2, length, -1)  # [M, complete | next block, L, V]
        next_logits = self._blocks(rows[:, 1], rows[:, 0, -1])

        def opening(m: int) -> HFPrefix:
            for index, (keys, values) in enumerate(written[m]):
                kv.update(keys, values, index)
            return self._extend(cache, handoffs[m].to(device), rows[m, 0], kv)

        return HandoffScore(logits=nodes, next_logits=next_logits, opening=opening)

    @torch.no_grad()
    def write(self, cache: HFPrefix, finished: torch.Tensor) -> HFPrefix:
        finished = finished.to(self.device)
        logits, kv, _ = self._forward(cache, finished, finished.new_zeros(0, 1))
        return self._extend(cache, finished, logits, kv)


@dataclass(frozen=True)
class HFCodec:
    """Text <-> ids through the checkpoint's own ``transformers`` tokenizer (chat template when it has one)."""

    tokenizer: Any
    mask_id: int
    eos_id: int

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids) -> str:
        return self.tokenizer.decode([int(i) for i in ids if int(i) != self.mask_id], skip_special_tokens=True)

    def encode_prompt(self, question: str) -> list[int]:
        if getattr(self.tokenizer, "chat_template", None):
            messages = [{"role": "user", "content": question}]
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            return list(ids["input_ids"] if hasattr(ids, "keys") else ids)  # a BatchEncoding or a plain list
        return self.encode(format_prompt(question))


def is_hf_checkpoint(folder: Path) -> bool:
    """A transformers checkpoint folder: its config.json names a ``model_type`` (the built-in config does not)."""
    config = Path(folder) / "config.json"
    if not config.is_file():
        return False
    try:
        return "model_type" in json.loads(config.read_text())
    except json.JSONDecodeError:
        return False


def _first_id(value) -> int | None:
    if isinstance(value, (list, tuple)):
        return int(value[0]) if value else None
    return None if value is None else int(value)


def load_hf_target(
    folder: str | Path,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    shifted_logits: bool = False,
    mask_id: int | None = None,
    trust_remote_code: bool = False,
    device_map: str | dict | None = None,
) -> tuple[HFTarget, HFCodec]:
    """Load a local transformers checkpoint (safetensors weights only) and its tokenizer.

    The mask token comes from ``mask_id``, else the config's ``mask_token_id`` (SDAR, Dream), else the
    tokenizer's mask token. ``trust_remote_code`` lets the folder's own modeling code run (SDAR, LLaDA, Dream ship
    theirs); it is off unless asked for. ``device_map`` (e.g. ``"auto"``; needs ``accelerate``) places the layers
    over the GPUs in place of ``device``. Nothing is downloaded.
    """
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as err:  # pragma: no cover - the [hf] extra is part of every documented install
        raise ImportError(
            "loading a transformers checkpoint needs the [hf] extra: pip install 'spot-dlm[hf]'"
        ) from err

    folder = Path(folder)
    if not is_hf_checkpoint(folder):
        raise ValueError(f"{folder} is not a transformers checkpoint folder (no config.json with a model_type)")
    if not any(folder.glob("*.safetensors")):
        raise ValueError(f"no safetensors weights in {folder} (pickled weights are not loaded: they can run code)")
    try:
        placed = {} if device_map is None else {"device_map": device_map}
        model = AutoModelForCausalLM.from_pretrained(
            folder,
            dtype=dtype,
            local_files_only=True,
            use_safetensors=True,
            trust_remote_code=trust_remote_code,
            **placed,
        )
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError, RuntimeError) as err:
        raise ValueError(f"could not load the transformers checkpoint in {folder}: {err}") from err
    config = model.config
    mask = mask_id if mask_id is not None else _first_id(getattr(config, "mask_token_id", None))
    mask = mask if mask is not None else _first_id(tokenizer.mask_token_id)
    if mask is None:
        raise ValueError(f"{folder} names no mask token (config mask_token_id or tokenizer mask token): pass mask_id")
    eos = _first_id(getattr(config, "eos_token_id", None))
    eos = eos if eos is not None else _first_id(tokenizer.eos_token_id)
    if eos is None:
        raise ValueError(f"{folder} names no EOS token (config eos_token_id or tokenizer eos token)")
    model = model if device_map is not None else model.to(device)
    target = HFTarget(model.eval(), mask, eos, shifted_logits=shifted_logits, name=folder.name)
    return target, HFCodec(tokenizer, mask, eos)
