"""Targets that drive a real DLM family through its authors' own interface, block by block on the authors' grid.

A family target is used by ``decode.decode_canvas``: ``plan`` lays out the canvas (where blocks sit, how many),
``open`` makes the authors' prefill pass and gives the first block's starting state (the prompt tail, or Fast-dLLM
v2's first token, before the masks), ``score`` runs one pass over K candidate states of the current block, and
``finish`` closes a finished block the way the authors do (SDAR's finish pass, v2's store pass that also gives the
next block's first token; nothing for full-canvas families), returning the next block's starting state.

How K candidates share one pass, per attention kind:

- SDAR (block-causal, honours a boolean mask, ``store_kv`` writes the cache): one row ``[cand 0 | cand 1 | ...]``,
  each candidate seeing the cache and itself; a single state gets the all-ones mask the authors pass.
- Fast-dLLM v2 (builds its own block mask, ignores ours; ``update_past_key_values`` writes): K batch rows over the
  cache expanded to K rows.
- LLaDA and Dream (full attention over the whole canvas, no cache): K full-canvas rows ``[prompt | finished blocks |
  candidate | future masks]``; Dream's logits shifted over the canvas.

The three adapters stay in one module, longer than most, because they share the canvas plan and the hand-off
scoring, and each is easiest to check against the others.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from spot_dlm.family_rules import Window
from spot_dlm.models.base import HandoffScore, PassCounter, ScoreResult
from spot_dlm.models.families import Family
from spot_dlm.models.hf import keep_first


@dataclass(frozen=True)
class CanvasPlan:
    """Where a request's blocks lie: ``n_blocks`` blocks of ``block_length`` from absolute position ``first_start``;
    the first ``tail`` positions of the first block are the prompt's tail (never committed)."""

    prompt_length: int
    block_length: int
    first_start: int
    n_blocks: int
    canvas_length: int  # prompt + every block: the row the full-canvas families run

    @property
    def tail(self) -> int:
        return self.prompt_length - self.first_start

    def block_start(self, block_index: int) -> int:
        return self.first_start + block_index * self.block_length


def plan_canvas(family: Family, prompt_length: int, gen_length: int, block_length: int) -> CanvasPlan:
    """The authors' canvas for a prompt of P tokens and G generated ones. SDAR / v2: blocks at multiples of L from
    position 0, the prompt tail inside the first, ``ceil((P + G) / L)`` blocks in all; LLaDA: G / L blocks from P;
    Dream: one block of G from P."""
    if family.grid == "whole":
        return CanvasPlan(prompt_length, gen_length, prompt_length, 1, prompt_length + gen_length)
    if family.grid == "after_prompt":
        if gen_length % block_length:
            raise ValueError(f"gen length {gen_length} is not a multiple of block length {block_length}")
        n_blocks = gen_length // block_length
        return CanvasPlan(prompt_length, block_length, prompt_length, n_blocks, prompt_length + gen_length)
    first = (prompt_length // block_length) * block_length
    n_blocks = math.ceil((prompt_length + gen_length) / block_length) - prompt_length // block_length
    return CanvasPlan(prompt_length, block_length, first, n_blocks, first + n_blocks * block_length)


@dataclass
class FamilyTarget:
    """Shared state of the family targets (see the module docstring); subclasses implement the passes."""

    model: Any  # the family's transformers model (remote code), eval mode
    family: Family
    mask_id: int
    stop_ids: tuple[int, ...]
    name: str = "hf"
    trained_block_length: int | None = None
    counter: PassCounter = field(default_factory=PassCounter)
    # called after each scoring pass with (cache, blocks [K, L], logits [K, L, V]) (``check_model``'s flip probe)
    on_score: Any = None

    # How the authors end: which stop tokens count ("generated": any after the prompt; "committed": only those the
    # rule committed), whether the block that stops decoding is still closed by ``finish``, and whether the last
    # ``finish`` adds its next token to the output.
    stop_counts = "generated"
    finish_stopping_block = True
    trailing_token = False

    def __post_init__(self) -> None:
        config = self.model.config
        self.vocab_size = int(config.vocab_size)
        self.max_length = int(getattr(config, "max_position_embeddings", 0) or 0)
        if self.max_length < 1:
            raise ValueError("the model config has no max_position_embeddings: its context length is unknown")
        for label, token in (("mask", self.mask_id), *(("stop", s) for s in self.stop_ids)):
            if not 0 <= token < self.vocab_size:
                raise ValueError(f"{label} token id {token} is outside the model's vocabulary of {self.vocab_size}")
        if not self.stop_ids:
            raise ValueError("the checkpoint names no EOS / stop token (generation_config.json or config.json)")

    @property
    def eos_id(self) -> int:
        return self.stop_ids[0]

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def plan(self, prompt_length: int, gen_length: int, block_length: int) -> CanvasPlan:
        plan = plan_canvas(self.family, prompt_length, gen_length, block_length)
        if plan.canvas_length > self.max_length:
            raise ValueError(
                f"prompt of {prompt_length} tokens + gen length {gen_length} ({plan.canvas_length} on the "
                f"{self.family.title} grid) exceeds the model's {self.max_length}-token context"
            )
        return plan

    @torch.no_grad()
    def score(self, cache, blocks: torch.Tensor, finished=None) -> ScoreResult:
        """One pass over K candidate states of the current block (int64 [K, L]) -> logits [K, L, V]; the cache is
        not changed (``finished`` must be None: finished blocks are closed by ``finish``)."""
        if finished is not None:
            raise ValueError("a family target closes finished blocks with finish(), not score(finished=...)")
        logits = self._score(cache, blocks)
        if self.on_score is not None:
            self.on_score(cache, blocks, logits)
        return ScoreResult(logits=logits, cache=cache)

    def window(self, plan: CanvasPlan, block_index: int) -> Window:
        """Where the authors rank positions: over the whole canvas row (full-canvas families) or the block."""
        if self.family.attention == "full_canvas":
            return Window(plan.block_start(block_index), plan.canvas_length)
        return Window()

    def next_state(self, plan: CanvasPlan) -> torch.Tensor:
        """The starting state of a block after the first: all masks (Fast-dLLM v2 opens with a known token and does
        not hand off)."""
        return self._starting_state(plan, torch.zeros(0, dtype=torch.int64))

    def _starting_state(self, plan: CanvasPlan, known: torch.Tensor) -> torch.Tensor:
        """int64 [L]: ``known`` tokens, then masks."""
        state = torch.full((plan.block_length,), self.mask_id, dtype=torch.int64, device=self.device)
        state[: known.shape[0]] = known
        return state


@dataclass(frozen=True)
class KVPrefix:
    """Block-causal families: the tokens whose keys and values the cache holds (a multiple of L), and the cache."""

    length: int
    kv: Any  # transformers DynamicCache, written in place by the authors' prefill / finish passes


def _block_causal(n_tokens: int, block_length: int, device) -> torch.Tensor:
    """bool [N, N]: token i sees token j when j's block is not after i's (prefill of whole prompt blocks)."""
    blocks = torch.arange(n_tokens, device=device) // block_length
    return blocks[None, :] <= blocks[:, None]


def _empty_cache():
    from transformers import DynamicCache

    return DynamicCache()


def expanded_cache(kv: Any, rows: int):
    """A new DynamicCache holding ``kv``'s keys and values repeated over ``rows`` batch rows."""
    cache = _empty_cache()
    for index, layer in enumerate(getattr(kv, "layers", [])):
        if getattr(layer, "keys", None) is None or layer.keys.numel() == 0:
            continue
        cache.update(layer.keys.expand(rows, -1, -1, -1), layer.values.expand(rows, -1, -1, -1), index)
    return cache


@dataclass
class SdarTarget(FamilyTarget):
    """SDAR / TraDo: boolean masks (True = may attend), the cache written only by passes with ``store_kv=True``."""

    def _forward(self, ids: torch.Tensor, allowed: torch.Tensor, positions: torch.Tensor, kv, store: bool):
        """ids int64 [N], allowed bool [N, C + N], positions int64 [N] -> logits [N, V]"""
        out = self.model(
            input_ids=ids[None],
            attention_mask=allowed[None, None],
            position_ids=positions[None],
            past_key_values=kv,
            use_cache=True,
            store_kv=store,
        )
        self.counter.record(ids.shape[0])
        return out.logits[0]

    @torch.no_grad()
    def open(self, prompt_ids: torch.Tensor, plan: CanvasPlan) -> tuple[KVPrefix, torch.Tensor]:
        prompt_ids, kv = prompt_ids.to(self.device), _empty_cache()
        n = plan.first_start
        if n:  # the whole prompt blocks, block-causal, written
            positions = torch.arange(n, device=self.device)
            self._forward(prompt_ids[:n], _block_causal(n, plan.block_length, self.device), positions, kv, True)
        return KVPrefix(n, kv), self._starting_state(plan, prompt_ids[n:])

    def _score(self, cache: KVPrefix, blocks: torch.Tensor) -> torch.Tensor:
        """blocks int64 [K, L] at positions [C, C + L) -> logits [K, L, V] in one pass (nothing written)."""
        n_nodes, length = blocks.shape
        device = self.device
        groups = torch.arange(n_nodes, device=device).repeat_interleave(length)  # [K L]
        allowed = torch.cat(
            [torch.ones(n_nodes * length, cache.length, dtype=torch.bool, device=device), groups[:, None] == groups],
            dim=1,
        )  # [K L, C + K L]: the cache, and its own candidate
        positions = torch.arange(cache.length, cache.length + length, device=device).repeat(n_nodes)
        logits = self._forward(blocks.to(device).reshape(-1), allowed, positions, cache.kv, False)
        return logits.reshape(n_nodes, length, -1)

    @torch.no_grad()
    def score_handoffs(self, cache: KVPrefix, blocks: torch.Tensor, handoffs: torch.Tensor) -> HandoffScore:
        """One pass over K candidate states and M hand-offs, each a complete candidate encoded as the authors' finish
        pass encodes a block (the cache and itself, bidirectionally) followed by the all-mask next block (which sees
        the cache, that candidate and itself): logits [K, L, V] and the next block's [M, L, V]; ``opening(m)``
        writes complete candidate m's keys and values into the cache, as its finish pass would."""
        (n_nodes, length), n_handoffs, device = blocks.shape, handoffs.shape[0], self.device
        start = cache.length
        masks = torch.full((n_handoffs, length), self.mask_id, dtype=torch.int64, device=device)
        ids = torch.cat([blocks.to(device).reshape(-1), torch.cat([handoffs.to(device), masks], 1).reshape(-1)])
        groups = torch.cat(
            [
                torch.arange(n_nodes, device=device).repeat_interleave(length),
                (n_nodes + torch.arange(2 * n_handoffs, device=device)).repeat_interleave(length),
            ]
        )  # [N]: one group per candidate, per complete candidate and per next block
        finished_of = torch.where(groups >= n_nodes, n_nodes + 2 * ((groups - n_nodes) // 2), -1)  # its branch's block
        is_next = (groups >= n_nodes) & ((groups - n_nodes) % 2 == 1)
        within = (groups[:, None] == groups) | (is_next[:, None] & (groups[None, :] == finished_of[:, None]))
        allowed = torch.cat([torch.ones(ids.shape[0], start, dtype=torch.bool, device=device), within], dim=1)
        offsets = torch.where(is_next, length, 0)
        positions = start + offsets + torch.arange(ids.shape[0], device=device) % length
        logits = self._forward(ids, allowed, positions, cache.kv, True)  # writes every query token: cut back below
        first = start + n_nodes * length
        written = [
            [
                (layer.keys[:, :, at : at + length].clone(), layer.values[:, :, at : at + length].clone())
                for layer in cache.kv.layers
            ]
            for at in range(first, first + 2 * length * n_handoffs, 2 * length)
        ]
        keep_first(cache.kv, start)
        rows = logits[n_nodes * length :].reshape(n_handoffs, 2, length, -1)  # [M, complete | next block, L, V]

        def opening(m: int) -> KVPrefix:
            for index, (keys, values) in enumerate(written[m]):
                cache.kv.update(keys, values, index)
            return KVPrefix(start + length, cache.kv)

        nodes = logits[: n_nodes * length].reshape(n_nodes, length, -1)
        return HandoffScore(logits=nodes, next_logits=rows[:, 1], opening=opening)

    @torch.no_grad()
    def finish(self, cache: KVPrefix, block: torch.Tensor, plan: CanvasPlan) -> tuple[KVPrefix, torch.Tensor]:
        """The authors' finish pass: the complete block, all-ones mask, ``store_kv=True``; the next block is all
        masks."""
        length = block.shape[0]
        allowed = torch.ones(length, cache.length + length, dtype=torch.bool, device=self.device)
        positions = torch.arange(cache.length, cache.length + length, device=self.device)
        self._forward(block.to(self.device), allowed, positions, cache.kv, True)
        return KVPrefix(cache.length + length, cache.kv), self._starting_state(plan, block.new_zeros(0))


@dataclass
class FastDllmV2Target(FamilyTarget):
    """Fast-dLLM v2: its own block mask (ours would be ignored), the cache written with
    ``update_past_key_values=True``, logits shifted inside the fed block, each block's first token known."""

    stop_counts = "committed"
    finish_stopping_block = False
    trailing_token = True

    def plan(self, prompt_length: int, gen_length: int, block_length: int) -> CanvasPlan:
        """``batch_sample``'s grid: ``G // B`` blocks from the one holding the prompt tail (a whole prompt: from the
        next), plus the last store pass's token."""
        if prompt_length == block_length:
            raise ValueError(
                f"a prompt of exactly one block ({block_length} tokens) is never read by Fast-dLLM v2's loop (it "
                "prefills only prompts longer than a block); add or remove a token"
            )
        if gen_length < block_length:
            raise ValueError(f"Fast-dLLM v2 decodes whole blocks: gen length {gen_length} < block {block_length}")
        if self.trained_block_length is not None and block_length != self.trained_block_length:
            raise ValueError(
                f"Fast-dLLM v2's denoising passes use the model's own block grid ({self.trained_block_length}): block "
                f"length {block_length} is not defined for its loop"
            )
        first = (prompt_length // block_length) * block_length
        n_blocks = gen_length // block_length
        plan = CanvasPlan(prompt_length, block_length, first, n_blocks, first + n_blocks * block_length + 1)
        if plan.canvas_length > self.max_length:
            raise ValueError(
                f"prompt of {prompt_length} tokens + gen length {gen_length} ({plan.canvas_length} on the "
                f"{self.family.title} grid) exceeds the model's {self.max_length}-token context"
            )
        return plan

    def _forward(self, ids: torch.Tensor, kv, store: bool) -> torch.Tensor:
        """ids int64 [B, N] after the cache -> logits [B, N, V]"""
        out = self.model(input_ids=ids, past_key_values=kv, use_cache=True, update_past_key_values=store)
        self.counter.record(ids.numel())
        return out.logits

    def _first_token(self, logits: torch.Tensor) -> torch.Tensor:
        """The next block's first token: argmax at the last position (greedy at any temperature). [V] -> [1]"""
        return logits.argmax(-1, keepdim=True)

    @torch.no_grad()
    def open(self, prompt_ids: torch.Tensor, plan: CanvasPlan) -> tuple[KVPrefix, torch.Tensor]:
        length, prompt_ids, kv = plan.block_length, prompt_ids.to(self.device), _empty_cache()
        if plan.prompt_length <= length:  # no prefill: the block is the prompt, then masks
            return KVPrefix(0, kv), self._starting_state(plan, prompt_ids)
        n = plan.first_start
        logits = self._forward(prompt_ids[None, :n], kv, True)[0]
        known = prompt_ids[n:] if plan.tail else self._first_token(logits[-1])
        return KVPrefix(n, kv), self._starting_state(plan, known)

    def _score(self, cache: KVPrefix, blocks: torch.Tensor) -> torch.Tensor:
        n_nodes = blocks.shape[0]
        kv = cache.kv if n_nodes == 1 else expanded_cache(cache.kv, n_nodes)
        logits = self._forward(blocks.to(self.device), kv, False)  # [K, L, V]
        return torch.cat([logits[:, :1], logits[:, :-1]], dim=1)

    @torch.no_grad()
    def finish(self, cache: KVPrefix, block: torch.Tensor, plan: CanvasPlan) -> tuple[KVPrefix, torch.Tensor]:
        """The store pass: the complete block written; its last position's argmax starts the next block."""
        logits = self._forward(block.to(self.device)[None], cache.kv, True)[0]
        next_state = self._starting_state(plan, self._first_token(logits[-1]))
        return KVPrefix(cache.length + block.shape[0], cache.kv), next_state


@dataclass(frozen=True)
class CanvasPrefix:
    """Full-canvas families: the clean text before the current block (prompt, finished blocks) and the plan."""

    tokens: torch.Tensor  # int64 [C]
    plan: CanvasPlan


@dataclass
class FullCanvasTarget(FamilyTarget):
    """LLaDA and Dream: no cache; every pass runs whole canvas rows, future blocks still masked."""

    def _forward(self, rows: torch.Tensor) -> torch.Tensor:
        """rows int64 [K, W] -> logits [K, W, V] (LLaDA's forward takes no position ids and no other keywords)"""
        if self.family.name == "dream":
            out = self.model(input_ids=rows, attention_mask="full")
        else:
            out = self.model(input_ids=rows)
        self.counter.record(rows.numel())
        return out.logits

    @torch.no_grad()
    def open(self, prompt_ids: torch.Tensor, plan: CanvasPlan) -> tuple[CanvasPrefix, torch.Tensor]:
        return CanvasPrefix(prompt_ids.to(self.device), plan), self._starting_state(plan, prompt_ids.new_zeros(0))

    def _score(self, cache: CanvasPrefix, blocks: torch.Tensor) -> torch.Tensor:
        n_nodes, length = blocks.shape
        start = cache.tokens.shape[0]
        future = cache.plan.canvas_length - start - length
        rows = torch.cat(
            [
                cache.tokens.expand(n_nodes, -1),
                blocks.to(self.device),
                torch.full((n_nodes, future), self.mask_id, dtype=torch.int64, device=self.device),
            ],
            dim=1,
        )  # [K, W]
        logits = self._forward(rows)
        first = start - 1 if self.family.shifted else start  # shifted: token j from position j - 1
        return logits[:, first : first + length]

    @torch.no_grad()
    def score_handoffs(self, cache: CanvasPrefix, blocks: torch.Tensor, handoffs: torch.Tensor) -> HandoffScore:
        """K candidate rows and M hand-off rows in one batch: a hand-off row holds a complete candidate and the
        all-mask next block after it (the next block's own first pass). -> logits [K, L, V], next [M, L, V]"""
        n_nodes, length = blocks.shape
        start = cache.tokens.shape[0]
        ahead = torch.cat([handoffs.to(self.device), torch.full_like(handoffs, self.mask_id).to(self.device)], 1)
        future = cache.plan.canvas_length - start - 2 * length
        rows = torch.cat(
            [
                cache.tokens.expand(n_nodes + handoffs.shape[0], -1),
                torch.cat([_pad(blocks.to(self.device), length, self.mask_id), ahead]),
                torch.full((n_nodes + handoffs.shape[0], future), self.mask_id, dtype=torch.int64, device=self.device),
            ],
            dim=1,
        )  # [K + M, W]
        logits = self._forward(rows)
        first = start - 1 if self.family.shifted else start
        nodes = logits[:n_nodes, first : first + length]
        next_logits = logits[n_nodes:, first + length : first + 2 * length]

        def opening(m: int) -> CanvasPrefix:
            return CanvasPrefix(torch.cat([cache.tokens, handoffs[m].to(self.device)]), cache.plan)

        return HandoffScore(logits=nodes, next_logits=next_logits, opening=opening)

    def finish(self, cache: CanvasPrefix, block: torch.Tensor, plan: CanvasPlan) -> tuple[CanvasPrefix, torch.Tensor]:
        """No pass: the block joins the clean text."""
        tokens = torch.cat([cache.tokens, block.to(self.device)])
        return CanvasPrefix(tokens, plan), self._starting_state(plan, block.new_zeros(0))


def _pad(blocks: torch.Tensor, length: int, mask_id: int) -> torch.Tensor:
    """Candidate blocks [K, L] followed by the all-mask next block [K, L] -> [K, 2 L]."""
    return torch.cat([blocks, torch.full_like(blocks, mask_id)], dim=1)


TARGET_CLASSES = {"sdar": SdarTarget, "fast_dllm_v2": FastDllmV2Target, "llada": FullCanvasTarget}
TARGET_CLASSES["dream"] = FullCanvasTarget


def is_family_target(target) -> bool:
    return isinstance(target, FamilyTarget)


def load_family_target(
    folder,
    family: Family,
    config: dict,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    trust_remote_code: bool = False,
    device_map: str | dict | None = None,
):
    """Load a real family's checkpoint as its authors do (their auto class, their remote code, safetensors only)
    with its tokenizer; mask id, stop ids and trained block length from the checkpoint. -> (target, HFCodec)

    ``device_map`` (e.g. ``"auto"``; needs the ``accelerate`` package) goes to ``from_pretrained``, which spreads
    the layers over the GPUs (and the CPU) in place of ``device``: a target larger than one GPU."""
    from pathlib import Path

    import transformers

    from spot_dlm.models.families import stop_ids, trained_block_length
    from spot_dlm.models.hf import HFCodec, _first_id

    folder = Path(folder)
    if config.get("auto_map") and not trust_remote_code:
        raise ValueError(
            f"{folder} is a {family.title} checkpoint that runs its own modeling code; pass --trust-remote-code "
            "(trust_remote_code=True) to load it"
        )
    missing = [name for name in _remote_files(config) if not (folder / name).is_file()]
    if missing:
        raise ValueError(
            f"{folder} lacks the {family.title} modeling code its config.json names: {', '.join(missing)}"
        )
    auto_class = getattr(transformers, family.auto_class)
    try:
        placed = {} if device_map is None else {"device_map": device_map}
        model = auto_class.from_pretrained(
            folder,
            dtype=dtype,
            local_files_only=True,
            use_safetensors=True,
            trust_remote_code=trust_remote_code,
            **placed,
        )
        tokenizer = transformers.AutoTokenizer.from_pretrained(
            folder, local_files_only=True, trust_remote_code=trust_remote_code
        )
    except (OSError, ValueError, KeyError, RuntimeError, ImportError) as err:
        raise ValueError(f"could not load the {family.title} checkpoint in {folder}: {err}") from err
    mask = _first_id(config.get("mask_token_id"))
    mask = mask if mask is not None else _first_id(tokenizer.mask_token_id)
    mask = mask if mask is not None else family.default_mask_id
    if mask is None:
        raise ValueError(f"{folder} names no mask token (config mask_token_id or the tokenizer's mask token)")
    stops = stop_ids(folder, config, family)
    cls = TARGET_CLASSES[family.name]
    target = cls(
        (model if device_map is not None else model.to(device)).eval(),
        family,
        mask,
        stops,
        name=folder.name,
        trained_block_length=trained_block_length(config, family),
    )
    return target, HFCodec(tokenizer, mask, stops[0])


def _remote_files(config: dict) -> list[str]:
    """The .py files a config's ``auto_map`` imports from the folder ("module.Class" -> "module.py")."""
    names = []
    for value in (config.get("auto_map") or {}).values():
        for reference in value if isinstance(value, (list, tuple)) else [value]:
            if reference and "--" not in str(reference):  # "repo--module.Class" points to another repository
                names.append(str(reference).rsplit(".", 1)[0] + ".py")
    return sorted(set(names))
