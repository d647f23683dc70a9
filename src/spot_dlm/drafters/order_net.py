"""SPOT's order model: which masked position does the target commit next, read from stale distributions only.

Per block position the model sees the stale top-32 probabilities (sorted), whether the position was masked in the
stale state, whether this tree branch has already committed it, the stale confidence of its noise-coupled token
for the step being predicted, and its position inside the block. No token ids, so one drafter serves any target
and vocabulary. A 3-layer bidirectional transformer (width 128, 8 heads, ~0.6M parameters) gives one logit per
position; a softmax over the positions still masked on the branch is the next-commit distribution.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from spot_dlm.decode import DraftContext
from spot_dlm.drafters.base import (
    TOP_K_FEATURES,
    StaleGuesses,
    grow_tree,
    largest_values,
    masked_log_normalise,
)
from spot_dlm.drafters.neighbours import NeighbourTokens
from spot_dlm.drafters.token_survival import TokenSurvival
from spot_dlm.models.checkpoint import check_state_dict, load_weights
from spot_dlm.tree import DEFAULT_DEPTH, DraftTree

N_FLAG_FEATURES = 3  # stale-masked, branch-committed, coupled confidence
DEFAULT_CONFIDENCE_PRIOR = 3.0  # measured: T = 1 passes 1.96x vs 1.69x without it at budget 4; neutral at T = 0


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


def stale_top_probs(
    stale_logits: torch.Tensor, mask_id: int, top_k: int = TOP_K_FEATURES, log_normaliser: torch.Tensor | None = None
) -> torch.Tensor:
    """Sorted top-k probabilities of the stale distributions (mask token excluded). [L, V] -> float32 [L, k]

    Only the k largest logits are exponentiated, against the log-normaliser (``log_normaliser`` [L] when
    already known: ``stale_log_normaliser``); float32 is ample (shards store these features in float16)."""
    z = stale_logits.to(torch.float32, copy=True)
    z[..., mask_id] = float("-inf")
    if log_normaliser is None:
        log_normaliser = torch.logsumexp(z, dim=-1)
    return (largest_values(z, top_k) - log_normaliser[..., None].to(torch.float32)).exp()


def order_features(
    top_probs: torch.Tensor,
    stale_masked: torch.Tensor,
    branch_committed: torch.Tensor,
    coupled_conf: torch.Tensor,
    extra_inputs: list | tuple = (),
) -> torch.Tensor:
    """Drafter input. top_probs [..., L, k]; stale_masked, branch_committed bool [..., L];
    coupled_conf [..., L] (stale confidence of the coupled token for the predicted step); extra_inputs: one column
    each, a scalar, per-example [...] or per-position [..., L] (see ``OrderModelConfig.extra_inputs``)
    -> float32 [..., L, k + 3 + len(extra_inputs)]
    """
    coupled = torch.where(
        stale_masked & ~branch_committed, coupled_conf.float(), torch.zeros_like(coupled_conf).float()
    )
    flags = torch.stack([stale_masked.float(), branch_committed.float(), coupled], dim=-1)  # [..., L, 3]
    columns = [top_probs.float(), flags]
    for value in extra_inputs:
        value = torch.as_tensor(value, dtype=torch.float32, device=flags.device)
        if value.dim() == flags.dim() - 1:  # per position [..., L]
            value = value[..., None]
        else:  # scalar or per example [...]
            value = value.reshape(*value.shape, *([1] * (flags.dim() - value.dim())))
        columns.append(value.expand(*flags.shape[:-1], 1))
    return torch.cat(columns, dim=-1)


@dataclass(frozen=True)
class StaleView:
    """What an order model reads of one round's stale pass, computed once per round and shared by every node."""

    top_probs: torch.Tensor  # float32 [L, k]
    stale_masked: torch.Tensor  # bool [L]
    previous_top1: torch.Tensor | None  # [L]: top-1 stale probability one commit earlier; None if not read
    has_previous: float  # 0 at a block's first state
    tau: float
    temperature: float
    mask_id: int
    config: OrderModelConfig

    @classmethod
    def of(
        cls, context: DraftContext, config: OrderModelConfig, log_normaliser: torch.Tensor | None = None
    ) -> StaleView:
        """The trend inputs are only computed when the model reads them (a softmax over the vocabulary).
        ``log_normaliser``: the stale pass's, when known ([L], ``StaleGuesses.log_normaliser``)."""
        previous, has_previous = None, 0.0
        if config.previous_feature and context.previous_logits is not None:
            previous, has_previous = stale_top_probs(context.previous_logits, context.mask_id, 1)[:, 0], 1.0
        elif config.previous_feature:
            previous = torch.zeros(context.root.shape[0], device=context.root.device)
        return cls(
            top_probs=stale_top_probs(context.stale_logits, context.mask_id, config.top_k, log_normaliser),
            stale_masked=context.parent == context.mask_id,
            previous_top1=previous,
            has_previous=has_previous,
            tau=context.rule.tau,
            temperature=context.rule.temperature,
            mask_id=context.mask_id,
            config=config,
        )

    def features(
        self, states: torch.Tensor, coupled_conf: torch.Tensor, corrected: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Model input for B nodes. states int64 [B, L] (their masks), coupled_conf [B, L], corrected [B, L] (the
        neighbour-corrected confidence; only read by models with ``corrected_feature``) -> float32 [B, L, F]"""
        n_nodes = states.shape[0]
        previous = None if self.previous_top1 is None else self.previous_top1.expand(n_nodes, -1)
        if corrected is not None:
            corrected = corrected.clamp_min(0) * (states == self.mask_id)  # 0 where nothing is left to commit
        return order_features(
            self.top_probs.expand(n_nodes, -1, -1),
            self.stale_masked.expand_as(states),
            self.stale_masked & (states != self.mask_id),
            coupled_conf,
            self.config.extra_inputs(self.tau, self.temperature, previous, self.has_previous, corrected),
        )


DRAFTER_WEIGHTS_FILE = "drafter.safetensors"
DRAFTER_CONFIG_FILE = "drafter_config.json"
DRAFTER_METRICS_FILE = "drafter_metrics.json"
SETS_METHODS = ("spot-sets", "spot-sets-dynamic")  # methods whose drafter folder holds a sets model (tau input)


def save_order_model(model: OrderModel, folder: Path, metrics: dict | None = None) -> None:
    """Write weights, config and metrics, each to a temporary name renamed into place (an interrupted save leaves
    every file whole)."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    metadata = {"config": json.dumps(asdict(model.config))}
    weights = folder / DRAFTER_WEIGHTS_FILE
    save_file(tensors, str(weights) + ".tmp", metadata=metadata)
    os.replace(str(weights) + ".tmp", weights)
    _write_text(folder / DRAFTER_CONFIG_FILE, json.dumps(asdict(model.config), indent=2))
    if metrics is not None:
        _write_text(folder / DRAFTER_METRICS_FILE, json.dumps(metrics, indent=2))


def _write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def is_sets_model(config: OrderModelConfig) -> bool:
    """A SPOT-Sets model reads the threshold rule's tau; SPOT's order model does not."""
    return config.threshold_feature


def read_drafter_config(folder: Path) -> OrderModelConfig | None:
    """The order model config a folder holds (None: no drafter_config.json there)."""
    path = Path(folder) / DRAFTER_CONFIG_FILE
    if not path.is_file():
        return None
    try:
        return OrderModelConfig(**json.loads(path.read_text()))
    except (json.JSONDecodeError, TypeError, ValueError) as err:
        raise ValueError(f"invalid drafter config {path}: {err}") from err


def check_drafter_kind(config: OrderModelConfig, sets: bool, source: Path | str) -> None:
    """A SPOT-Sets model where SPOT's order model is wanted (or the reverse) is a ValueError naming both."""
    if is_sets_model(config) != sets:
        found = "a SPOT-Sets model (spot-sets)" if is_sets_model(config) else "a SPOT order model (spot)"
        wanted = "a SPOT-Sets model (train-drafter --sets)" if sets else "a SPOT order model (train-drafter)"
        raise ValueError(f"{source} holds {found}; this needs {wanted}")


def check_drafter_folder(method: str, folder: str | Path | None, order_model: str = "auto", token_lm: bool = False):
    """The parts a speculative method reads from a drafter folder given by the user, checked before any work: the
    folder exists, holds the model kind the method needs, and the small order model or token LM asked for.
    ``folder`` None (the shipped drafters) and methods without a drafter folder pass."""
    from spot_dlm.drafters.token_lm import TOKEN_LM_FIT_FILE

    if folder is None or method not in ("spot", "calibrated", *SETS_METHODS):
        return
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"drafter folder not found: {folder}")
    if method == "calibrated":
        return
    sets = method in SETS_METHODS
    for place in (folder, folder / "small"):
        config = read_drafter_config(place)
        if config is not None:
            check_drafter_kind(config, sets, place)
    if order_model == "small" and not (folder / "small" / DRAFTER_CONFIG_FILE).is_file():
        raise ValueError(f"no small order model in {folder} (expected {folder / 'small' / DRAFTER_CONFIG_FILE})")
    if token_lm and not (folder / TOKEN_LM_FIT_FILE).is_file():
        raise ValueError(
            f"--token-lm: {folder} has no token LM ({TOKEN_LM_FIT_FILE}; spot-dlm fit-token-survival --token-lm "
            "installs one)"
        )


def _check_config_metadata(path: Path, config: OrderModelConfig) -> None:
    """The weights record the config they were trained with; a config file that disagrees is rejected."""
    from safetensors import safe_open

    with safe_open(str(path), "pt") as handle:
        recorded = (handle.metadata() or {}).get("config")
    if recorded is not None and OrderModelConfig(**json.loads(recorded)) != config:  # absent keys: defaults
        raise ValueError(f"drafter config does not match the config recorded in {path}: {recorded}")


def load_order_model(folder: Path) -> OrderModel:
    folder = Path(folder)
    config = read_drafter_config(folder)
    if config is None:
        raise FileNotFoundError(f"drafter config not found: {folder / DRAFTER_CONFIG_FILE}")
    weights = load_weights(folder / DRAFTER_WEIGHTS_FILE)
    _check_config_metadata(folder / DRAFTER_WEIGHTS_FILE, config)
    model = OrderModel(config)
    check_state_dict(model.state_dict(), weights, folder / DRAFTER_WEIGHTS_FILE)
    model.load_state_dict(weights)
    return model.eval()


@dataclass(frozen=True)
class SpotDrafter:
    """SPOT: best-first tree over the order model's next-commit distributions.

    ``confidence_prior`` = w adds ``w * log(stale confidence of the coupled token)`` to the order logits: the
    stale estimate of the very score the one-commit rule ranks positions by. It matters most at T > 0, where
    that score belongs to a noise-coupled sample the order model (which has no temperature input) reads poorly.

    ``token_survival`` multiplies each edge's position probability by the fitted probability that its stale coupled
    token is still the target's choice, so the budget goes to branches whose tokens are likely to hold.

    ``neighbours`` re-ranks each drafted token by the tokens its branch committed beside it since the stale pass
    (``drafters/neighbours.py``); ``token_survival`` must then be the fit of those corrected guesses. With
    ``neighbour_prior`` the confidence prior reads the corrected guess's confidence at those positions (their
    confidence moves with their neighbours, and the rule ranks positions by it).

    Without an order model (``model`` None) the prior ranks positions alone: each node's next-commit distribution is
    the (corrected) stale coupled confidence to the power w, renormalised. One drafted node deep that is as good a
    guess as the model's on the built-in target, and it skips the model's features and forward (see README).
    """

    model: OrderModel | FrozenOrderModel | None  # None: the confidence prior alone ranks positions
    budget: int = 16
    depth: int = DEFAULT_DEPTH
    confidence_prior: float = DEFAULT_CONFIDENCE_PRIOR
    token_survival: TokenSurvival | None = None  # scores each drafted token by how likely it survives (None: not)
    neighbours: NeighbourTokens | None = None  # re-ranks drafted tokens by the branch's fresh neighbours (None: not)
    neighbour_prior: bool = True  # the confidence prior reads the corrected confidence where neighbours moved
    name: str = "spot"

    def __post_init__(self) -> None:
        if self.model is not None:
            check_drafter_kind(self.model.config, False, "the order model given to SPOT")
        if self.model is None and not self.confidence_prior > 0:
            raise ValueError("without an order model the confidence prior ranks positions alone: it must be > 0")
        if self.model is not None and self.model.config.corrected_feature and self.neighbours is None:
            raise ValueError(
                "this order model reads the neighbour-corrected confidence: it needs the drafter folder's bigram fit "
                "(neighbour tokens on)"
            )

    @torch.no_grad()
    def propose(self, context: DraftContext) -> DraftTree:
        guesses = StaleGuesses(context, self.neighbours)
        view = None if self.model is None else StaleView.of(context, self.model.config, guesses.log_normaliser)
        reads_corrected = self.model is not None and self.model.config.corrected_feature

        def coupled_confidence(steps: list[int]) -> torch.Tensor:
            """Stale confidence of each position's coupled token under each node's step noise. -> float64 [B, L]"""
            return torch.stack([guesses.at(s).confidence for s in steps])  # -inf where stale-committed

        def model_logits(states: torch.Tensor, coupled: torch.Tensor, corrected: torch.Tensor | None) -> torch.Tensor:
            """states int64 [B, L], coupled [B, L] (coupled_confidence of their steps), corrected [B, L] or None
            -> logits [B, L]"""
            features = view.features(states, coupled.clamp_min(0), corrected)  # [B, L, F]
            return self.model(features.to(self.model.device)).to(states.device)  # [B, L]

        def order_logits(states: torch.Tensor, coupled: torch.Tensor, corrected: torch.Tensor | None) -> torch.Tensor:
            """The order model's logits for B nodes, float64 [B, L]; zeros without a model (the confidence prior then
            ranks positions alone)."""
            if self.model is None:
                return torch.zeros(states.shape, dtype=torch.float64, device=states.device)
            return model_logits(states, coupled, corrected).to(torch.float64)

        def scorer(states: torch.Tensor, steps: list[int]) -> torch.Tensor:
            coupled = coupled_confidence(steps)  # [B, L]
            corrected = None  # [B, L]: the neighbour-corrected confidence, when the model or the prior reads it
            if self.neighbours is not None and (reads_corrected or (self.confidence_prior and self.neighbour_prior)):
                corrected = guesses.node_confidence(coupled, steps, states.cpu().numpy()).to(states.device)
            logits = order_logits(states, coupled, corrected)  # [B, L]
            if self.confidence_prior:
                prior = corrected if self.neighbour_prior and corrected is not None else coupled
                logits = logits + self.confidence_prior * prior.to(logits.device).clamp_min(1e-12).log()
            return masked_log_normalise(logits, states == context.mask_id)

        return grow_tree(context, self.budget, self.depth, scorer, guesses, token_survival=self.token_survival)
