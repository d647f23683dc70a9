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


def _slice_kv(kv: tuple[LayerKV, ...], rows: slice, columns: slice) -> tuple[LayerKV, ...]:
    return tuple(LayerKV(layer.keys[rows, :, columns], layer.values[rows, :, columns]) for layer in kv)


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
        (a complete candidate of the block, clean, then an all-mask next block: its own branch of the query).

        clean int64 [Nc]; blocks int64 [K, L] (K may be 0); handoffs int64 [M, L] or None.
        """
        if not self.use_cache and cache is not None:
            clean = torch.cat([cache.tokens, clean])  # recompute the whole prefix
        past = cache.kv if (self.use_cache and cache is not None) else None
        n_past = 0 if past is None else cache.length
        n_clean, (n_nodes, length) = clean.shape[0], blocks.shape
        n_handoffs = 0 if handoffs is None else handoffs.shape[0]
        start, device = n_past + n_clean, self.device
        prefix = clean_layout(n_past, n_clean, device)
        masks = torch.full((n_handoffs, length), self.mask_id, dtype=torch.int64, device=device)
        handoff_ids = blocks.new_zeros(0, 2 * length) if handoffs is None else torch.cat([handoffs, masks], 1)

        def handoff_layout(branch: int) -> Layout:  # the complete candidate, then the next block after it
            return concat(
                clean_layout(start, length, device, branch),
                block_layout(start + length, length, branch, device, branch),
            )

        if self.scoring == "packed" or n_nodes + n_handoffs == 0:
            layout = concat(
                prefix,
                *(block_layout(start, length, k, device) for k in range(n_nodes)),
                *(handoff_layout(n_nodes + m) for m in range(n_handoffs)),
            )
            input_ids = torch.cat([clean, blocks.reshape(-1), handoff_ids.reshape(-1)])[None]  # [1, Nc + K L + 2 M L]
            mask, positions = attention_mask(layout, n_past)[None], layout.positions[None]
            node_at = [(0, n_clean + k * length) for k in range(n_nodes)]
            handoff_at = [(0, n_clean + n_nodes * length + 2 * m * length) for m in range(n_handoffs)]
        else:
            rows = [(concat(prefix, block_layout(start, length, 0, device)), blocks)]  # (layout, queries [R, .])
            node_at = [(k, n_clean) for k in range(n_nodes)]
            if n_handoffs:  # rows two blocks wide: nodes in pairs (the last one maybe beside a block nobody reads)
                pairs = -(-n_nodes // 2)
                paired = torch.cat([blocks, masks[:1].expand(2 * pairs - n_nodes, -1)]).reshape(pairs, 2 * length)
                two = [block_layout(start, length, side, device, branch=side) for side in (0, 1)]
                rows = [(concat(prefix, *two), paired), (concat(prefix, handoff_layout(0)), handoff_ids)]
                node_at = [(k // 2, n_clean + k % 2 * length) for k in range(n_nodes)]
            input_ids = torch.cat([torch.cat([clean.expand(q.shape[0], -1), q], 1) for _, q in rows])  # [R, Nc + W]
            mask = torch.cat([attention_mask(lay, n_past)[None].expand(q.shape[0], -1, -1) for lay, q in rows])
            positions = torch.cat([lay.positions[None].expand(q.shape[0], -1) for lay, q in rows])
            handoff_at = [(rows[0][1].shape[0] + m, n_clean) for m in range(n_handoffs)]
        hidden, new_kv = self.model(input_ids, positions, mask, past)
        self.counter.record(input_ids.numel())

        def take(at: list[tuple[int, int]], offset: int) -> torch.Tensor:  # [len(at), L, d]
            if not at:
                return hidden.new_zeros(0, length, hidden.shape[-1])
            return torch.stack([hidden[row, col + offset : col + offset + length] for row, col in at])

        out = _Hidden(
            clean=hidden[0, :n_clean],
            nodes=take(node_at, 0),
            clean_kv=_slice_kv(new_kv, slice(0, 1), slice(0, n_clean)),
        )
        if not n_handoffs:
            return out
        kv = tuple(
            LayerKV(
                *(
                    torch.stack([t[row, :, col : col + length] for row, col in handoff_at])
                    for t in (layer.keys, layer.values)
                )
            )
            for layer in new_kv
        )
        return replace(out, handoff_clean=take(handoff_at, 0), handoff_nodes=take(handoff_at, length), handoff_kv=kv)

    def _extend(self, cache: PrefixCache | None, clean: torch.Tensor, out: _Hidden) -> PrefixCache:
        if cache is not None and not self.use_cache:
            return PrefixCache(tokens=torch.cat([cache.tokens, clean]), kv=None, last_hidden=out.clean[-1])
        if cache is None or cache.kv is None:
            kv = out.clean_kv if self.use_cache else None
            return PrefixCache(tokens=clean, kv=kv, last_hidden=out.clean[-1])
        kv = tuple(
            LayerKV(torch.cat([old.keys, new.keys], 2), torch.cat([old.values, new.values], 2))
            for old, new in zip(cache.kv, out.clean_kv, strict=True)
        )
        return PrefixCache(tokens=torch.cat([cache.tokens, clean]), kv=kv, last_hidden=out.clean[-1])

    @torch.no_grad()
    def prefill(self, prompt_ids: torch.Tensor) -> PrefixCache:
        """prompt_ids int64 [P], P >= 1."""
        if prompt_ids.ndim != 1 or prompt_ids.shape[0] == 0:
            raise ValueError("the prompt must be a non-empty 1-D tensor of token ids")
        prompt_ids = prompt_ids.to(self.device)
        out = self._run(None, prompt_ids, prompt_ids.new_zeros(0, 1))
        return self._extend(None, prompt_ids, out)

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
        new_cache = cache if finished is None else self._extend(cache, clean, out)
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
            written = handoffs[m].to(device)
            kv = None
            if self.use_cache:
                mine = _slice_kv(out.handoff_kv, slice(m, m + 1), slice(None))
                kv = tuple(
                    LayerKV(torch.cat([old.keys, new.keys], 2), torch.cat([old.values, new.values], 2))
                    for old, new in zip(cache.kv, mine, strict=True)
                )
            return PrefixCache(tokens=torch.cat([cache.tokens, written]), kv=kv, last_hidden=out.handoff_clean[m, -1])

        return HandoffScore(logits=self._block_logits(last, out.nodes), next_logits=next_logits, opening=opening)

    @torch.no_grad()
    def write(self, cache: PrefixCache, finished: torch.Tensor) -> PrefixCache:
        finished = finished.to(self.device)
        out = self._run(cache, finished, finished.new_zeros(0, 1))
        return self._extend(cache, finished, out)


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
