"""The built-in target: ``BlockDiffusionLM`` behind the ``Target`` protocol, with an exact prefix KV cache.

Candidate states are scored either as batch rows that share the cache (``scoring="batched"``) or packed into one
sequence where each candidate sees the prefix and itself only (``scoring="packed"``). ``use_cache=False``
recomputes the whole prefix on every pass (a reference for tests and for models without a cache).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from spot_dlm.models.base import PassCounter, ScoreResult
from spot_dlm.models.checkpoint import TOKENIZER_FILE, load_model
from spot_dlm.models.layout import attention_mask, block_layout, clean_layout, concat
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

    def _run(self, cache: PrefixCache | None, clean: torch.Tensor, blocks: torch.Tensor) -> _Hidden:
        """One forward: the clean tokens (causal, after the cache) and K candidate blocks after them.

        clean int64 [Nc]; blocks int64 [K, L] (K may be 0).
        """
        if not self.use_cache and cache is not None:
            clean = torch.cat([cache.tokens, clean])  # recompute the whole prefix
        past = cache.kv if (self.use_cache and cache is not None) else None
        n_past = 0 if past is None else cache.length
        n_clean, (n_nodes, block_length) = clean.shape[0], blocks.shape
        block_start = n_past + n_clean
        device = self.device
        prefix = clean_layout(n_past, n_clean, device)
        if self.scoring == "packed" or n_nodes == 0:
            layout = concat(prefix, *(block_layout(block_start, block_length, k, device) for k in range(n_nodes)))
            input_ids = torch.cat([clean, blocks.reshape(-1)])[None]  # [1, Nc + K L]
        else:
            layout = concat(prefix, block_layout(block_start, block_length, 0, device))
            input_ids = torch.cat([clean.expand(n_nodes, -1), blocks], dim=1)  # [K, Nc + L]
        rows = input_ids.shape[0]
        mask = attention_mask(layout, n_past)[None].expand(rows, -1, -1)
        hidden, new_kv = self.model(input_ids, layout.positions[None].expand(rows, -1), mask, past)
        self.counter.record(input_ids.numel())
        nodes = hidden[:, n_clean:].reshape(n_nodes, block_length, hidden.shape[-1])
        clean_kv = tuple(LayerKV(kv.keys[:1, :, :n_clean], kv.values[:1, :, :n_clean]) for kv in new_kv)
        return _Hidden(clean=hidden[0, :n_clean], nodes=nodes, clean_kv=clean_kv)

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

    @torch.no_grad()
    def score(self, cache: PrefixCache, blocks: torch.Tensor, finished: torch.Tensor | None = None) -> ScoreResult:
        """Logits [K, L, V] of K candidate states; ``finished`` (int64 [L']) is written to the cache first."""
        clean = blocks.new_zeros(0) if finished is None else finished.to(self.device)
        out = self._run(cache, clean, blocks.to(self.device))
        new_cache = cache if finished is None else self._extend(cache, clean, out)
        last = out.clean[-1] if out.clean.shape[0] else cache.last_hidden  # predicts position 0 of the block
        first = last.expand(out.nodes.shape[0], 1, -1)
        logits = self.model.logits(torch.cat([first, out.nodes[:, :-1]], dim=1))  # [K, L, V]
        return ScoreResult(logits=logits, cache=new_cache)

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
