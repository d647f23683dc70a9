"""SPOT's order model: which masked position does the target commit next, read from stale distributions only.

Per block position the model sees the stale top-32 probabilities (sorted), whether the position was masked in the
stale state, whether this tree branch has already committed it, the stale confidence of its noise-coupled token
for the step being predicted, and its position inside the block (these inputs: ``drafters/order_features.py``). No
token ids, so one drafter serves any target and vocabulary. A 3-layer bidirectional transformer (width 128, 8 heads,
~0.6M parameters) gives one logit per position; a softmax over the positions still masked on the branch is the
next-commit distribution. This module owns the config, the network and its frozen trace for decoding.
"""

from __future__ import annotations

import hashlib
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

TOP_K_FEATURES = 32


@dataclass(frozen=True)
class OrderModelConfig:
    top_k: int = TOP_K_FEATURES
    d_model: int = 128
    n_layers: int = 3
    n_heads: int = 8
    max_block_length: int = 64
    mlp_ratio: int = 4
    threshold_feature: bool = False  # SPOT-Sets: the rule's tau is an input, so one model serves every tau
    temperature_feature: bool = False  # the sampling temperature is an input, so one model serves every T
    previous_feature: bool = False  # each position's top-1 stale probability one commit earlier (its trend)
    corrected_feature: bool = False  # the coupled confidence corrected for neighbours filled since the stale pass

    def __post_init__(self) -> None:
        for name in ("top_k", "d_model", "n_layers", "n_heads", "max_block_length", "mlp_ratio"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"drafter config {name} must be a positive integer, got {value!r}")
        if self.d_model % self.n_heads:
            raise ValueError(f"drafter d_model {self.d_model} is not divisible by n_heads {self.n_heads}")

    @property
    def feature_names(self) -> tuple[str, ...]:
        """The input columns in order (``order_features`` builds them in this order)."""
        names = [f"top{i + 1}" for i in range(self.top_k)] + ["stale_masked", "branch_committed", "coupled_confidence"]
        names += [
            name for on, name in ((self.threshold_feature, "tau"), (self.temperature_feature, "temperature")) if on
        ]
        names += ["previous_top1", "has_previous"] if self.previous_feature else []
        return tuple(names + (["corrected_confidence"] if self.corrected_feature else []))

    @property
    def n_features(self) -> int:
        return len(self.feature_names)

    def extra_inputs(self, tau, temperature, previous_top1=None, has_previous=None, corrected=None) -> list:
        """The inputs beyond the base features that this model reads, in feature order.

        tau, temperature: scalars or per-example [...]; previous_top1: per-position [..., L] (the top-1 stale
        probability of the state one commit earlier); has_previous: scalar or [...] (0 at a block's first state);
        corrected: per-position [..., L], the coupled confidence where no neighbour moved and the neighbour-corrected
        guess's confidence where one did (``StaleGuesses.node_confidence``), 0 where not allowed.
        """
        extras = [
            value for on, value in ((self.threshold_feature, tau), (self.temperature_feature, temperature)) if on
        ]
        if self.previous_feature:
            extras += [previous_top1, has_previous]
        if self.corrected_feature:
            if corrected is None:
                raise ValueError("this order model reads the neighbour-corrected confidence; none was given")
            extras.append(corrected)
        return extras


class SelfAttention(nn.Module):
    """Bidirectional multi-head self-attention; parameter names as ``nn.MultiheadAttention`` (fused in-projection)."""

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.in_proj_weight = nn.Parameter(torch.empty(3 * d_model, d_model))
        self.in_proj_bias = nn.Parameter(torch.zeros(3 * d_model))
        self.out_proj = nn.Linear(d_model, d_model)
        nn.init.xavier_uniform_(self.in_proj_weight)
        nn.init.zeros_(self.out_proj.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, L, d] -> [B, L, d]"""
        batch, length, width = x.shape
        qkv = F.linear(x, self.in_proj_weight, self.in_proj_bias)  # [B, L, 3d]
        q, k, v = qkv.view(batch, length, 3, self.n_heads, width // self.n_heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v)  # [B, H, L, d/H]
        return self.out_proj(y.transpose(1, 2).reshape(batch, length, width))


class EncoderLayer(nn.Module):
    """Pre-norm transformer layer (GELU MLP); parameter names as ``nn.TransformerEncoderLayer``, whose checkpoints
    load unchanged. Written out because at one block of 32 positions the fused fast path's dispatch cost is a
    visible share of every SPOT round."""

    def __init__(self, d_model: int, n_heads: int, hidden: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(d_model)
        self.self_attn = SelfAttention(d_model, n_heads)
        self.norm2 = nn.LayerNorm(d_model)
        self.linear1 = nn.Linear(d_model, hidden)
        self.linear2 = nn.Linear(hidden, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, L, d] -> [B, L, d]"""
        x = x + self.self_attn(self.norm1(x))
        return x + self.linear2(F.gelu(self.linear1(self.norm2(x))))


class Encoder(nn.Module):
    def __init__(self, config: OrderModelConfig) -> None:
        super().__init__()
        hidden = config.mlp_ratio * config.d_model
        self.layers = nn.ModuleList(
            EncoderLayer(config.d_model, config.n_heads, hidden) for _ in range(config.n_layers)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class OrderModel(nn.Module):
    def __init__(self, config: OrderModelConfig) -> None:
        super().__init__()
        self.config = config
        self.input = nn.Linear(config.n_features, config.d_model)
        self.position = nn.Embedding(config.max_block_length, config.d_model)
        self.encoder = Encoder(config)
        self.norm = nn.LayerNorm(config.d_model)
        self.head = nn.Linear(config.d_model, 1)

    @property
    def device(self) -> torch.device:
        return self.input.weight.device

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """features float32 [B, L, F] -> logits [B, L] (unnormalised; mask disallowed positions yourself)."""
        check_block_length(features.shape[1], self.config)
        x = self.input(features) + self.position.weight[: features.shape[1]]
        return self.head(self.norm(self.encoder(x)))[..., 0]


def check_block_length(length: int, config: OrderModelConfig) -> None:
    if length > config.max_block_length:
        raise ValueError(f"block length {length} exceeds the order model's {config.max_block_length}")


@dataclass(frozen=True)
class FrozenOrderModel:
    """An order model traced and frozen for decoding: the same logits bit for bit, at less cost per call.

    At one block (B x 32 positions, width 128) the eager model spends a visible share of each SPOT round in
    Python and module dispatch; the frozen TorchScript graph (weights folded in as constants) does not. It cannot
    be trained: ``freeze_order_model`` makes one from a trained ``OrderModel``, whose weights stay untouched.
    TorchScript is deprecated upstream but works in the pinned torch; the eager model stays the reference (the tests
    hold the two equal), so dropping the freeze only costs speed.
    """

    config: OrderModelConfig
    device: torch.device
    graph: torch.jit.ScriptModule

    def __call__(self, features: torch.Tensor) -> torch.Tensor:
        """features float32 [B, L, F] -> logits [B, L], as ``OrderModel.forward``."""
        check_block_length(features.shape[1], self.config)
        with torch.no_grad(), one_host_thread(self.device):
            return self.graph(features)


@contextmanager
def one_host_thread(device: torch.device) -> Iterator[None]:
    """Run torch's host ops on one thread inside the block, then restore the thread count.

    An order model's matrices (a few blocks of 32 positions, width 64 to 128) are too small to split, while the
    target's passes around it keep every thread. Safe from several Python threads: the first to enter saves the
    count and sets one thread, the last to leave restores it."""
    if device.type != "cpu":
        yield
        return
    _ONE_THREAD.enter()
    try:
        yield
    finally:
        _ONE_THREAD.leave()


class _OneThread:
    """The shared state of ``one_host_thread``: how many callers are inside, and the count to restore."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.inside = 0
        self.saved = 1

    def enter(self) -> None:
        with self.lock:
            if self.inside == 0:
                self.saved = torch.get_num_threads()
                if self.saved != 1:
                    torch.set_num_threads(1)
            self.inside += 1

    def leave(self) -> None:
        with self.lock:
            self.inside -= 1
            if self.inside == 0 and torch.get_num_threads() != self.saved:
                torch.set_num_threads(self.saved)


_ONE_THREAD = _OneThread()
_FROZEN: dict[tuple, FrozenOrderModel] = {}  # (config, device, weights digest) -> its frozen trace
_FROZEN_LOCK = threading.Lock()
MAX_FROZEN = 8  # frozen traces kept (one per distinct order model in use)


def weights_digest(model: nn.Module) -> str:
    """A digest of a module's parameter names, shapes, dtypes and values (identifies a trained model)."""
    digest = hashlib.blake2b(digest_size=16)
    for name, tensor in model.state_dict().items():
        flat = tensor.detach().to("cpu").contiguous().reshape(-1)
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype};".encode())
        digest.update(flat.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def freeze_order_model(model: OrderModel) -> FrozenOrderModel:
    """Trace ``model`` (eval mode, any batch size and block length up to its maximum) and freeze the trace.

    Traced once per distinct model (config, device, weights) and cached: callers on several threads share one
    frozen graph (concurrent tracing fails torch's trace check), and a drafter built per call costs no trace."""
    key = (model.config, str(model.device), weights_digest(model))
    with _FROZEN_LOCK:
        frozen = _FROZEN.get(key)
        if frozen is None:
            frozen = _trace(model)
            if len(_FROZEN) >= MAX_FROZEN:
                del _FROZEN[next(iter(_FROZEN))]  # the oldest
            _FROZEN[key] = frozen
        return frozen


def _trace(model: OrderModel) -> FrozenOrderModel:
    example = torch.zeros(1, 2, model.config.n_features, device=model.device)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)  # shapes are read from the input on every call
        warnings.simplefilter("ignore", DeprecationWarning)  # see FrozenOrderModel
        graph = torch.jit.freeze(torch.jit.trace(model.eval(), example))
    return FrozenOrderModel(config=model.config, device=model.device, graph=graph)
