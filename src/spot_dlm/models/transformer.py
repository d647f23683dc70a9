"""The built-in block-diffusion transformer (weights only; no decoding state lives on the module).

Architecture: pre-norm decoder, RoPE, SDPA attention, GELU MLP, RMSNorm, tied embeddings. The module is a
plain function of (tokens, positions, attention mask, past keys/values); the attention pattern decides whether a
token behaves as clean causal context or as part of a bidirectional noisy block:

- clean tokens (the prompt and finished blocks) attend causally to earlier clean tokens; their keys/values are
  the prefix cache and do not depend on the block length used at inference;
- the tokens of a block being decoded attend to every clean token before the block and bidirectionally to the
  tokens of their own block.

Output is shifted by one position (as in Dream and Fast-dLLM v2): the hidden state at position p predicts the
token at p + 1, so the first position of a block is predicted by the last clean token before it.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 2048
    d_model: int = 256
    n_layers: int = 6
    n_heads: int = 4
    mlp_ratio: int = 4
    max_seq_len: int = 1024
    rope_theta: float = 10_000.0
    pad_id: int = 0
    eos_id: int = 1
    mask_id: int = 2

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "mlp_ratio", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"model config {name} must be a positive integer, got {value!r}")
        if not isinstance(self.rope_theta, (int, float)) or self.rope_theta <= 0:
            raise ValueError(f"model config rope_theta must be > 0, got {self.rope_theta!r}")
        for name in ("pad_id", "eos_id", "mask_id"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < self.vocab_size:
                raise ValueError(f"model config {name} must be a token id in [0, {self.vocab_size}), got {value!r}")
        if self.d_model % self.n_heads or (self.d_model // self.n_heads) % 2:
            raise ValueError(f"d_model {self.d_model} must split into {self.n_heads} heads of even size")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_dict(cls, raw: dict) -> ModelConfig:
        known = {f.name for f in fields(cls)}
        unknown = set(raw) - known
        if unknown:
            raise ValueError(f"unknown model config keys {sorted(unknown)}")
        return cls(**raw)

    @classmethod
    def from_file(cls, path: Path) -> ModelConfig:
        try:
            raw = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise ValueError(f"cannot read model config {path}: {err}") from err
        if not isinstance(raw, dict):
            raise ValueError(f"model config {path} is not a JSON object")
        try:
            return cls.from_dict(raw)
        except (TypeError, ValueError) as err:
            raise ValueError(f"invalid model config {path}: {err}") from err


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """Rotary tables for absolute positions. positions int64 [B, Q] -> cos, sin [B, 1, Q, head_dim]"""
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float64) / head_dim)
    angles = positions.to(torch.float64)[..., None] * inv_freq  # [B, Q, head_dim/2]
    angles = torch.cat([angles, angles], dim=-1)[:, None]  # [B, 1, Q, head_dim]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, Q, Dh] rotated by position."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


@dataclass(frozen=True)
class LayerKV:
    keys: torch.Tensor  # [B, H, T, Dh]
    values: torch.Tensor  # [B, H, T, Dh]


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.head_dim = config.head_dim
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model, bias=False)
        self.out = nn.Linear(config.d_model, config.d_model, bias=False)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor, past: LayerKV | None
    ) -> tuple[torch.Tensor, LayerKV]:
        """x [B, Q, d]; mask bool [B, Q, C + Q] (True = may attend); past [1 or B, H, C, Dh]."""
        batch, n_query, _ = x.shape
        q, k, v = self.qkv(x).view(batch, n_query, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)  # [B, H, Q, Dh]
        new_kv = LayerKV(keys=k, values=v)
        if past is not None and past.keys.shape[2] > 0:
            k = torch.cat([past.keys.expand(batch, -1, -1, -1), k], dim=2)
            v = torch.cat([past.values.expand(batch, -1, -1, -1), v], dim=2)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None])  # [B, H, Q, Dh]
        return self.out(y.transpose(1, 2).reshape(batch, n_query, -1)), new_kv


class Layer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(config.d_model)
        self.attn = Attention(config)
        self.mlp_norm = RMSNorm(config.d_model)
        hidden = config.mlp_ratio * config.d_model
        self.mlp = nn.Sequential(
            nn.Linear(config.d_model, hidden, bias=False), nn.GELU(), nn.Linear(hidden, config.d_model, bias=False)
        )

    def forward(self, x, cos, sin, mask, past):
        attended, new_kv = self.attn(self.attn_norm(x), cos, sin, mask, past)
        x = x + attended
        return x + self.mlp(self.mlp_norm(x)), new_kv


class BlockDiffusionLM(nn.Module):
    """Weights of the built-in target. ``forward`` returns normalised hidden states; ``logits`` applies the head."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.layers = nn.ModuleList(Layer(config) for _ in range(config.n_layers))
        self.final_norm = RMSNorm(config.d_model)
        self.apply(self._init_weights)
        for name, param in self.named_parameters():
            if name.endswith("out.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(param, std=0.02 / math.sqrt(2 * config.n_layers))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor,
        past: tuple[LayerKV, ...] | None = None,
    ) -> tuple[torch.Tensor, tuple[LayerKV, ...]]:
        """input_ids, positions int64 [B, Q]; mask bool [B, Q, C + Q]; past per layer [1 or B, H, C, Dh].

        Returns the final-normalised hidden states [B, Q, d] and the keys/values of the Q query tokens per layer.
        """
        x = self.embed(input_ids)
        cos, sin = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta, x.dtype)
        new_kv = []
        for index, layer in enumerate(self.layers):
            x, kv = layer(x, cos, sin, mask, None if past is None else past[index])
            new_kv.append(kv)
        return self.final_norm(x), tuple(new_kv)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Tied output head. hidden [..., d] -> logits [..., V]"""
        return hidden @ self.embed.weight.T

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


def keep_layers(model: BlockDiffusionLM, layers: tuple[int, ...]) -> BlockDiffusionLM:
    """A copy of ``model`` with only the given layers (in the given increasing order), its embeddings, final norm
    and tied head: the starting point of a layer-dropped student (a token LM distilled from its own target)."""
    n_layers = model.config.n_layers
    if not layers or list(layers) != sorted(set(layers)) or not 0 <= layers[0] <= layers[-1] < n_layers:
        raise ValueError(f"layers to keep must be increasing indices in [0, {n_layers}), got {list(layers)}")
    student = BlockDiffusionLM(replace(model.config, n_layers=len(layers)))
    weights = model.state_dict()
    kept = {name: tensor for name, tensor in weights.items() if not name.startswith("layers.")}
    for new, old in enumerate(layers):
        prefix = f"layers.{old}."
        kept |= {f"layers.{new}.{k[len(prefix) :]}": v for k, v in weights.items() if k.startswith(prefix)}
    student.load_state_dict(kept)
    return student.to(dtype=next(model.parameters()).dtype)
