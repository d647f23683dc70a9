"""The built-in target: ``BlockDiffusionLM`` behind the ``Target`` protocol, with an exact prefix KV cache.

Candidate states are scored either as batch rows that share the cache (``scoring="batched"``) or packed into one
sequence where each candidate sees the prefix and itself only (``scoring="packed"``). ``use_cache=False``
recomputes the whole prefix on every pass (a reference for tests and for models without a cache).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from spot_dlm.models.base import HandoffScore, PassCounter, ScoreResult
from spot_dlm.models.checkpoint import TOKENIZER_FILE, load_model
from spot_dlm.models.layout import Layout, attention_mask, block_layout, clean_layout, concat
from spot_dlm.models.transformer import BlockDiffusionLM, LayerKV

SCORING_MODES = ("batched", "packed")


@dataclass(frozen=True)
class PrefixCache:
    tokens: torch.Tensor  # int64 [C]: every clean token so far (prompt and finished blocks)
    kv: tuple[LayerKV, ...] | None  # per layer [1, H, C, Dh]; None when the target recomputes the prefix
    last_hidden: torch.Tensor  # [d]: hidden state of the last clean token (it predicts the next position)

    @property
    def length(self) -> int:
        return int(self.tokens.shape[0])


@dataclass(frozen=True)
class _Hidden:
    clean: torch.Tensor  # [Nc, d]: hidden states of the clean segment
    nodes: torch.Tensor  # [K, L, d]: hidden states of the candidate blocks
    clean_kv: tuple[LayerKV, ...]  # per layer [1, H, Nc, Dh]
    handoff_clean: torch.Tensor | None = None  # [M, L, d]: each complete candidate, written as the finished block
    handoff_nodes: torch.Tensor | None = None  # [M, L, d]: the all-mask next block after it
    handoff_kv: tuple[LayerKV, ...] | None = None  # per layer [M, H, L, Dh]: the complete candidates' keys, values


@dataclass(frozen=True)
class _Query:
    """The query rows of one pass and where each candidate block and each hand-off starts in them."""

    input_ids: torch.Tensor  # int64 [R, N]
    rows: tuple[tuple[Layout, int], ...]  # (a row's layout, how many consecutive rows share it)
    node_at: torch.Tensor  # int64 [K, 2]: (row, column) of each candidate block's first token
    handoff_at: torch.Tensor  # int64 [M, 2]: (row, column) of each hand-off's first token

    def positions(self) -> torch.Tensor:
        """int64 [R, N] (a view when every row shares one layout)"""
        return _stack_rows([layout.positions[None].expand(n, -1) for layout, n in self.rows])

    def mask(self, n_past: int) -> torch.Tensor:
        """bool [R, N, n_past + N] (a view when every row shares one layout)"""
        return _stack_rows([attention_mask(layout, n_past)[None].expand(n, -1, -1) for layout, n in self.rows])


def _stack_rows(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _handoff_layout(start: int, length: int, branch: int, device: torch.device) -> Layout:
    """A hand-off: the complete candidate (clean) and the all-mask next block after it, in a branch of its own."""
    complete = clean_layout(start, length, device, branch)
    return concat(complete, block_layout(start + length, length, branch, device, branch))


def _packed_query(
    prefix: Layout, start: int, clean: torch.Tensor, blocks: torch.Tensor, handoff_ids: torch.Tensor
) -> _Query:
    """One row [clean | candidate 0 | ... | hand-off 0 | ...]: each candidate its own group, each hand-off its own
    branch; ``start`` is the block's first position. clean [Nc], blocks [K, L], handoff_ids [M, 2 L]"""
    (n_nodes, length), n_handoffs, device = blocks.shape, handoff_ids.shape[0], blocks.device
    layout = concat(
        prefix,
        *(block_layout(start, length, k, device) for k in range(n_nodes)),
        *(_handoff_layout(start, length, n_nodes + m, device) for m in range(n_handoffs)),
    )
    firsts = torch.cat([torch.arange(n_nodes, device=device), n_nodes + 2 * torch.arange(n_handoffs, device=device)])
    at = torch.stack([torch.zeros_like(firsts), len(prefix) + length * firsts], 1)  # [K + M, 2]
    input_ids = torch.cat([clean, blocks.reshape(-1), handoff_ids.reshape(-1)])[None]  # [1, Nc + K L + 2 M L]
    return _Query(input_ids, ((layout, 1),), at[:n_nodes], at[n_nodes:])


def _batched_query(
    prefix: Layout, start: int, clean: torch.Tensor, blocks: torch.Tensor, handoff_ids: torch.Tensor, mask_id: int
) -> _Query:
    """A row per candidate [clean | candidate]; with hand-offs, rows two blocks wide: the candidates in pairs (an
    odd one beside a masked block nobody reads), then a row per hand-off [clean | complete | next block].
    clean [Nc], blocks [K, L], handoff_ids [M, 2 L]"""
    (n_nodes, length), n_handoffs, device = blocks.shape, handoff_ids.shape[0], blocks.device
    n_clean = len(prefix)
    nodes = torch.arange(n_nodes, device=device)
    if not n_handoffs:
        rows = ((concat(prefix, block_layout(start, length, 0, device)), blocks),)
        node_at = torch.stack([nodes, torch.full_like(nodes, n_clean)], 1)
    else:
        pairs = -(-n_nodes // 2)
        spare = torch.full((2 * pairs - n_nodes, length), mask_id, dtype=blocks.dtype, device=device)
        two = concat(prefix, *(block_layout(start, length, side, device, branch=side) for side in (0, 1)))
        handoff_row = concat(prefix, _handoff_layout(start, length, 0, device))
        rows = ((two, torch.cat([blocks, spare]).reshape(pairs, 2 * length)), (handoff_row, handoff_ids))
        node_at = torch.stack([nodes // 2, n_clean + nodes % 2 * length], 1)
    handoffs = rows[0][1].shape[0] + torch.arange(n_handoffs, device=device)
    handoff_at = torch.stack([handoffs, torch.full_like(handoffs, n_clean)], 1)
    input_ids = torch.cat([torch.cat([clean.expand(q.shape[0], -1), q], 1) for _, q in rows])  # [R, Nc + W]
    return _Query(input_ids, tuple((layout, q.shape[0]) for layout, q in rows), node_at, handoff_at)


def _gather(x: torch.Tensor, at: torch.Tensor, offset: int, length: int) -> torch.Tensor:
    """``length`` consecutive tokens from each (row, column + offset). x [R, N, d], at int64 [K, 2] -> [K, L, d]"""
    columns = at[:, 1:] + offset + torch.arange(length, device=at.device)  # [K, L]
    return x[at[:, :1], columns]


def _gather_kv(kv: tuple[LayerKV, ...], at: torch.Tensor, length: int) -> tuple[LayerKV, ...]:
    """Each layer's keys and values of ``length`` tokens from each (row, column). [R, H, N, Dh] -> [K, H, L, Dh]"""
    columns = at[:, 1:] + torch.arange(length, device=at.device)  # [K, L]
    return tuple(
        LayerKV(layer.keys[at[:, :1], :, columns].transpose(1, 2), layer.values[at[:, :1], :, columns].transpose(1, 2))
        for layer in kv
    )


@dataclass
class BuiltinTarget:
    model: BlockDiffusionLM
    scoring: str = "batched"
    use_cache: bool = True
    name: str = "builtin"
    counter: PassCounter = field(default_factory=PassCounter)

    def __post_init__(self) -> None:
        if self.scoring not in SCORING_MODES:
            raise ValueError(f"unknown scoring {self.scoring!r}; choose one of {SCORING_MODES}")
        config = self.model.config
        self.vocab_size, self.mask_id, self.eos_id = config.vocab_size, config.mask_id, config.eos_id
        self.max_length = config.max_seq_len

    @property
    def device(self) -> torch.device:
        return self.model.embed.weight.device

    def _run(
        self,
        cache: PrefixCache | None,
        clean: torch.Tensor,
        blocks: torch.Tensor,
        handoffs: torch.Tensor | None = None,
    ) -> _Hidden:
        """One forward: the clean tokens (causal, after the cache), K candidate blocks after them and M hand-offs
        (a complete candidate of the block, clean, then an all-mask next block: a branch of the query of its own).

        clean int64 [Nc]; blocks int64 [K, L] (K may be 0); handoffs int64 [M, L] or None.
        """
        if not self.use_cache and cache is not None:
            clean = torch.cat([cache.tokens, clean])  # recompute the whole prefix
        past = cache.kv if (self.use_cache and cache is not None) else None
        n_past = 0 if past is None else cache.length
        n_clean, (n_nodes, length) = clean.shape[0], blocks.shape
        prefix = clean_layout(n_past, n_clean, self.device)
        handoff_ids = blocks.new_zeros(0, 2 * length)
        if handoffs is not None:  # each complete candidate, then the all-mask next block
            handoff_ids = torch.cat([handoffs, torch.full_like(handoffs, self.mask_id)], 1)
        if self.scoring == "packed" or n_nodes + handoff_ids.shape[0] == 0:
            query = _packed_query(prefix, n_past + n_clean, clean, blocks, handoff_ids)
        else:
            query = _batched_query(prefix, n_past + n_clean, clean, blocks, handoff_ids, self.mask_id)
        hidden, new_kv = self.model(query.input_ids, query.positions(), query.mask(n_past), past)
        self.counter.record(query.input_ids.numel())
        clean_kv = tuple(LayerKV(kv.keys[:1, :, :n_clean], kv.values[:1, :, :n_clean]) for kv in new_kv)
        out = _Hidden(clean=hidden[0, :n_clean], nodes=_gather(hidden, query.node_at, 0, length), clean_kv=clean_kv)
        if handoffs is None:
            return out
        at = query.handoff_at
        complete, after = _gather(hidden, at, 0, length), _gather(hidden, at, length, length)
        return replace(out, handoff_clean=complete, handoff_nodes=after, handoff_kv=_gather_kv(new_kv, at, length))

    def _extend(
        self, cache: PrefixCache | None, clean: torch.Tensor, hidden: torch.Tensor, kv: tuple[LayerKV, ...]
    ) -> PrefixCache:
        """The cache with ``clean`` (int64 [Nc]) written, from its hidden states [Nc, d] and per-layer keys and
        values [1, H, Nc, Dh] (no pass)."""
        if cache is not None and not self.use_cache:
            return PrefixCache(tokens=torch.cat([cache.tokens, clean]), kv=None, last_hidden=hidden[-1])
        if cache is None or cache.kv is None:
            return PrefixCache(tokens=clean, kv=kv if self.use_cache else None, last_hidden=hidden[-1])
        kv = tuple(
            LayerKV(torch.cat([old.keys, new.keys], 2), torch.cat([old.values, new.values], 2))
            for old, new in zip(cache.kv, kv, strict=True)
        )
        return PrefixCache(tokens=torch.cat([cache.tokens, clean]), kv=kv, last_hidden=hidden[-1])

    @torch.no_grad()
    def prefill(self, prompt_ids: torch.Tensor) -> PrefixCache:
        """prompt_ids int64 [P], P >= 1."""
        if prompt_ids.ndim != 1 or prompt_ids.shape[0] == 0:
            raise ValueError("the prompt must be a non-empty 1-D tensor of token ids")
        prompt_ids = prompt_ids.to(self.device)
        out = self._run(None, prompt_ids, prompt_ids.new_zeros(0, 1))
        return self._extend(None, prompt_ids, out.clean, out.clean_kv)

    def _block_logits(self, last: torch.Tensor, nodes: torch.Tensor) -> torch.Tensor:
        """Logits of candidate blocks: position 0 is predicted from the last clean token, position i from the
        block's position i - 1. last [d] or [K, d], nodes [K, L, d] -> [K, L, V]"""
        first = last.expand(nodes.shape[0], -1)[:, None]  # [K, 1, d]
        return self.model.logits(torch.cat([first, nodes[:, :-1]], dim=1))

    @torch.no_grad()
    def score(self, cache: PrefixCache, blocks: torch.Tensor, finished: torch.Tensor | None = None) -> ScoreResult:
        """Logits [K, L, V] of K candidate states; ``finished`` (int64 [L']) is written to the cache first (cache
        None: ``finished`` is the prompt, prefilled in this pass)."""
        if cache is None and (finished is None or finished.numel() == 0):
            raise ValueError("scoring without a cache needs the prompt as the finished text")
        clean = blocks.new_zeros(0) if finished is None else finished.to(self.device)
        out = self._run(cache, clean, blocks.to(self.device))
        new_cache = cache if finished is None else self._extend(cache, clean, out.clean, out.clean_kv)
        last = out.clean[-1] if out.clean.shape[0] else cache.last_hidden  # predicts position 0 of the block
        return ScoreResult(logits=self._block_logits(last, out.nodes), cache=new_cache)

    @torch.no_grad()
    def score_handoffs(self, cache: PrefixCache, blocks: torch.Tensor, handoffs: torch.Tensor) -> HandoffScore:
        """One pass: logits [K, L, V] of K candidate states and, for each of M complete candidates of the block
        (int64 [M, L]), those of the all-mask next block with that candidate written as the finished block."""
        device = self.device
        out = self._run(cache, blocks.new_zeros(0, device=device), blocks.to(device), handoffs.to(device))
        last = out.clean[-1] if out.clean.shape[0] else cache.last_hidden
        next_logits = self._block_logits(out.handoff_clean[:, -1], out.handoff_nodes)  # [M, L, V]

        def opening(m: int) -> PrefixCache:
            written = tuple(LayerKV(layer.keys[m : m + 1], layer.values[m : m + 1]) for layer in out.handoff_kv)
            return self._extend(cache, handoffs[m].to(device), out.handoff_clean[m], written)

        return HandoffScore(logits=self._block_logits(last, out.nodes), next_logits=next_logits, opening=opening)

    @torch.no_grad()
    def write(self, cache: PrefixCache, finished: torch.Tensor) -> PrefixCache:
        finished = finished.to(self.device)
        out = self._run(cache, finished, finished.new_zeros(0, 1))
        return self._extend(cache, finished, out.clean, out.clean_kv)


def builtin_dir() -> Path:
    return Path(__file__).resolve().parent.parent / "assets" / "builtin"


def load_builtin_target(
    path: Path | None = None,
    scoring: str = "batched",
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> tuple[BuiltinTarget, object]:
    """Load a built-in-architecture checkpoint folder (default: the shipped one) and its tokenizer."""
    from spot_dlm.models.tokenizer import TextCodec

    folder = Path(path) if path is not None else builtin_dir()
    model = load_model(folder, dtype=dtype, device=device)
    codec = TextCodec.from_file(folder / TOKENIZER_FILE)
    if codec.vocab_size != model.config.vocab_size:
        raise ValueError(
            f"tokenizer in {folder} has {codec.vocab_size} tokens but the model expects {model.config.vocab_size}"
        )
    return BuiltinTarget(model=model, scoring=scoring, name=folder.name), codec
