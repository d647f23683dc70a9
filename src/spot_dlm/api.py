"""The Python API: load a target, pick a method, generate from a list of prompts.

from spot_dlm import GenerateConfig, generate, load_target
target, codec = load_target()                      # the built-in model
outs = generate(["What is 3 + 4?"], GenerateConfig(method="standard"), target, codec)
outs[0].text, outs[0].token_ids, outs[0].stats["target_passes"]

The whole public surface is here (a module longer than most, so that one file answers "how do I call it"): the
config, the method registry and its drafter factories, loading a target, and ``generate``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from spot_dlm.decode import DecodeSettings, Drafter, NoDrafter, decode_ids
from spot_dlm.drafters.folder import DrafterFolder
from spot_dlm.drafters.spot import DEFAULT_CONFIDENCE_PRIOR
from spot_dlm.models.base import Codec, Target
from spot_dlm.noise import NoiseKey
from spot_dlm.rules import CONFIDENCE_KINDS, CommitRule
from spot_dlm.tree import DEFAULT_DEPTH


def neighbour_fit(config: GenerateConfig, target: Target, folder: DrafterFolder):
    """The token correction and its survival fit from a drafter folder, or None (turned off, or no fit there): the
    folder's small LM (``token_lm/``, see ``drafters/token_lm.py``) when ``token_lm`` and it has one, else its
    bigram (``drafters/neighbours.py``). The LM is opt-in: it saves passes in deep trees, but on a CPU its passes
    cost more time than they save (docs/experiments/token-lm.md).

    A folder given with ``drafter`` must fit the target (a table of another vocabulary is a ValueError); the shipped
    fit belongs to the built-in target, so for a target of another vocabulary it is left out with a warning."""
    from spot_dlm.drafters.neighbours import load_neighbour_fit
    from spot_dlm.drafters.token_lm import TOKEN_LM_FIT_FILE, load_token_lm

    if not config.neighbour_tokens:
        return None
    if config.token_lm and (folder.fits / TOKEN_LM_FIT_FILE).is_file():
        try:
            return load_token_lm(folder.fits, target, folder.device)
        except ValueError as err:
            if folder.given:
                raise
            warnings.warn(f"{err}: re-ranking drafted tokens by the bigram instead", stacklevel=3)
    fit = load_neighbour_fit(folder.fits)
    if fit is None or fit[0].table.vocab_size == target.vocab_size:
        return fit
    message = f"the bigram table in {folder.fits} was counted over {fit[0].table.vocab_size} tokens; the target has "
    if folder.given:
        raise ValueError(f"{message}{target.vocab_size}")
    hint = "drafting plain stale tokens (spot-dlm fit-bigram makes one for it)"
    warnings.warn(f"{message}{target.vocab_size}: {hint}", stacklevel=3)
    return None


ORDER_MODEL_SIZES = ("auto", "paper", "small", "none")
NUMERICS = ("authors", "project")
DEFAULT_BLOCK_LENGTH = 32
FAST_DLLM_V2_SUB_BLOCK = 8


def uses_small_order_model(config: GenerateConfig, target: Target, folder: DrafterFolder) -> bool:
    """Whether SPOT's order model is the folder's ``small/`` one rather than the folder's own (the paper's size).

    ``auto`` takes the small one for a target on the CPU when the folder has one: there the order model's compute
    is a visible share of each round next to a small target, while on a GPU both sizes cost about one launch
    sequence and the larger one predicts better."""
    if config.order_model == "small":
        folder.require_small_order_model()
        return True
    return config.order_model == "auto" and target.device.type == "cpu" and folder.has_small_order_model()


def runs_order_model(config: GenerateConfig, target: Target, corrected: bool) -> bool:
    """Does SPOT run an order model? Not with ``none``, and not with ``auto`` for a one-node draft (budget 2) of a
    target on the CPU when the drafter corrects the stale confidence for fresh neighbours (``corrected``): there the
    corrected confidence alone picks the drafted position as well as the model (50 GSM8K prompts: 3733 vs 3771
    passes at T = 0, 3797 vs 3747 at T = 1) and the round skips the model's features and forward (tokens/s 1.13x vs
    1.04x standard decoding at T = 0, 1.04x vs 1.00x at T = 1; docs/experiments/cpu-speed.md). Deeper trees need the
    model."""
    if config.order_model == "none":
        return False
    one_node = config.budget <= 2 and config.confidence_prior > 0 and corrected
    return not (config.order_model == "auto" and one_node and target.device.type == "cpu")


def _spot_drafter(config: GenerateConfig, target: Target) -> Drafter:
    from spot_dlm.drafters.spot import SpotDrafter

    folder = DrafterFolder.for_method(config.drafter, config.method, target.device)
    survival = folder.token_survival() if config.token_survival else None
    fit = neighbour_fit(config, target, folder)
    neighbours = None
    if fit is not None:  # the corrected guesses come with the survival fitted on them
        neighbours, survival = fit[0], (fit[1] if config.token_survival else None)
    model = None  # the confidence prior ranks positions alone
    if runs_order_model(config, target, neighbours is not None):
        model = folder.order_model(small=uses_small_order_model(config, target, folder))
    return SpotDrafter(
        model,
        budget=config.budget,
        depth=config.depth,
        confidence_prior=config.confidence_prior,
        token_survival=survival,
        neighbours=neighbours,
        neighbour_prior=config.neighbour_prior,
    )


def _stale_drafter(config: GenerateConfig, target: Target) -> Drafter:
    from spot_dlm.drafters.simple import StaleConfidenceDrafter

    return StaleConfidenceDrafter(budget=config.budget, depth=config.depth)


def _chain_drafter(config: GenerateConfig, target: Target) -> Drafter:
    from spot_dlm.drafters.simple import ChainDrafter

    return ChainDrafter(budget=config.budget, depth=config.depth)


def _calibrated_drafter(config: GenerateConfig, target: Target) -> Drafter:
    from spot_dlm.drafters.simple import CalibratedDrafter

    folder = DrafterFolder.for_method(config.drafter, config.method, target.device)
    return CalibratedDrafter(folder.rank_paths(config.budget, config.depth), budget=config.budget)


def _sets_drafter(config: GenerateConfig, target: Target) -> Drafter:
    from spot_dlm.drafters.sets import SetsDrafter

    folder = DrafterFolder.for_method(config.drafter, config.method, target.device)
    fit = neighbour_fit(config, target, folder)
    neighbours = None if fit is None else fit[0]
    return SetsDrafter(folder.order_model(), budget=config.budget, depth=config.depth, neighbours=neighbours)


def _stale_sets_drafter(config: GenerateConfig, target: Target) -> Drafter:
    from spot_dlm.drafters.sets import StaleSetsDrafter

    return StaleSetsDrafter(budget=config.budget, depth=config.depth)


# method name -> commit rule kind; methods with a drafter factory are speculative (and exact)
@dataclass(frozen=True)
class Method:
    """A decoding method: the commit rule it decodes by and, for a speculative method, the drafter that proposes
    its trees. A speculative method is token-identical to the drafter-free method of its rule (``exact_to``)."""

    rule: str  # CommitRule kind: one, threshold, dynamic
    drafter: Callable[[GenerateConfig, Target], Drafter] | None = None  # None: the rule decodes alone

    @property
    def exact_to(self) -> str:
        return RULE_METHODS[self.rule]


RULE_METHODS = {"one": "standard", "threshold": "threshold", "dynamic": "dynamic"}  # each rule's drafter-free method
METHODS: dict[str, Method] = {
    "standard": Method("one"),
    "threshold": Method("threshold"),
    "dynamic": Method("dynamic"),
    "spot": Method("one", _spot_drafter),
    "stale": Method("one", _stale_drafter),
    "chain": Method("one", _chain_drafter),
    "calibrated": Method("one", _calibrated_drafter),
    "spot-sets": Method("threshold", _sets_drafter),
    "spot-sets-dynamic": Method("dynamic", _sets_drafter),
    "stale-sets": Method("threshold", _stale_sets_drafter),
}


def is_speculative(method: str) -> bool:
    """Whether a method drafts (and so has a budget)."""
    return method in METHODS and METHODS[method].drafter is not None


def resolve_device(name: str | torch.device = "cpu") -> torch.device:
    """'cpu', 'cuda', 'cuda:N' or 'auto' (CUDA when available) -> a device that exists here, else ValueError."""
    if str(name) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"unknown device {str(name)!r}; use cpu, cuda, cuda:N or auto") from err
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise ValueError(f"unsupported device {str(name)!r}; use cpu, cuda, cuda:N or auto")
    if not torch.cuda.is_available():
        raise ValueError(f"device {str(name)!r} asked for, but this torch ({torch.__version__}) sees no CUDA device")
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(f"device {str(name)!r} asked for, but only {torch.cuda.device_count()} CUDA device(s) exist")
    return device


@dataclass(frozen=True)
class GenerateConfig:
    method: str = "standard"
    block_length: int | None = None  # None: the model's own (a family checkpoint's trained block; else 32)
    gen_length: int = 256
    temperature: float = 0.0
    seed: int = 0
    confidence: str = "prob"
    tau: float = 0.9  # threshold / dynamic rules
    min_commits: int = 1  # dynamic rule: commit at least this many per pass
    stop_at_eos: bool = True
    # speculative methods: draft-tree nodes scored per pass (root included); None: auto, the budget measured fastest
    # for this device and target (``budget.py``; without a measurement the device kind's prior)
    budget: int | None = None
    depth: int = DEFAULT_DEPTH  # speculative methods: maximum draft depth
    confidence_prior: float = DEFAULT_CONFIDENCE_PRIOR  # spot: weight of log(stale coupled confidence) in the order
    token_survival: bool = True  # spot: weigh drafted tokens by the drafter folder's token_survival.json, if any
    neighbour_tokens: bool = True  # spot, spot-sets: re-rank drafted tokens by fresh neighbours (bigram fit), if any
    neighbour_prior: bool = True  # spot: the confidence prior reads the neighbour-corrected confidence (with them)
    token_lm: bool = False  # spot, spot-sets: re-rank by the drafter folder's small LM (token_lm/) and its bigram
    handoffs: bool = True  # speculative methods: a round may also do the next block's first pass (targets that can)
    # spot: paper (0.6M), small (the folder's small/), none (the confidence prior alone ranks positions), auto (on a
    # CPU: none at budget 2, else small if there is one; see runs_order_model)
    order_model: str = "auto"
    apply_template: bool = True
    drafter: str | None = None  # drafter checkpoint folder (default: the one shipped for the built-in target)
    # real families (SDAR, LLaDA, Dream, Fast-dLLM v2): their authors' numerics ("authors") or the project's float64
    # rule on their canvas ("project"); ``steps``: SDAR passes per block, LLaDA / Dream passes in all (None: the
    # authors' default: one commit per pass); ``family_alg``: Dream's confidence (entropy, maskgit_plus, topk_margin)
    numerics: str = "authors"
    steps: int | None = None
    family_alg: str | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"unknown method {self.method!r}; choose one of {', '.join(sorted(METHODS))}")
        if self.block_length is not None and self.block_length < 1:
            raise ValueError(f"block length must be >= 1, got {self.block_length}")
        if self.gen_length < 1:
            raise ValueError(f"gen length must be >= 1, got {self.gen_length}")
        if self.block_length is not None and self.gen_length % self.block_length:
            raise ValueError(f"gen length {self.gen_length} is not a multiple of block length {self.block_length}")
        if self.numerics not in NUMERICS:
            raise ValueError(f"unknown numerics {self.numerics!r}; choose one of {', '.join(NUMERICS)}")
        if self.steps is not None and self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")
        if self.confidence not in CONFIDENCE_KINDS:
            raise ValueError(f"unknown confidence {self.confidence!r}; choose one of {', '.join(CONFIDENCE_KINDS)}")
        if self.budget is not None and self.budget < 1:
            raise ValueError(f"budget (draft nodes per pass) must be >= 1, got {self.budget}")
        if self.depth < 1:
            raise ValueError(f"depth must be >= 1, got {self.depth}")
        if not self.confidence_prior >= 0:  # also rejects NaN
            raise ValueError(f"confidence_prior must be >= 0, got {self.confidence_prior}")
        if self.order_model not in ORDER_MODEL_SIZES:
            raise ValueError(f"unknown order model {self.order_model!r}; choose one of {', '.join(ORDER_MODEL_SIZES)}")
        from spot_dlm.safety import check_generate_config  # seed range, budget x block, the drafter folder's kind

        check_generate_config(self)
        self.rule()  # validates temperature, tau, min_commits

    def rule(self) -> CommitRule:
        return CommitRule(
            kind=METHODS[self.method].rule,
            temperature=self.temperature,
            confidence=self.confidence,
            k=self.min_commits,
            tau=self.tau,
        )

    @property
    def resolved_block_length(self) -> int:
        return DEFAULT_BLOCK_LENGTH if self.block_length is None else self.block_length

    def settings(self) -> DecodeSettings:
        """Decoding settings for the built-in or a generic target (a family target: ``settings_for``)."""
        block = self.resolved_block_length
        if self.gen_length % block:
            raise ValueError(f"gen length {self.gen_length} is not a multiple of block length {block}")
        return DecodeSettings(self.rule(), block, self.gen_length, self.stop_at_eos, self.handoffs)


def family_block_length(config: GenerateConfig, target) -> int:
    """The block length a family decodes with: the user's, else the checkpoint's trained one, else the family's
    default; Dream has no blocks (the whole generation is one). A length other than the trained one is warned about."""
    family = target.family
    if family.grid == "whole":
        if config.block_length not in (None, config.gen_length):
            raise ValueError(
                f"{family.title} decodes the whole generation as one canvas: leave the block length unset"
            )
        return config.gen_length
    trained = target.trained_block_length
    length = config.block_length or trained or family.default_block_length
    if trained is not None and length != trained:
        warnings.warn(
            f"block length {length} differs from the {trained} this {family.title} checkpoint was trained with: "
            "its outputs there are not what its authors evaluate",
            stacklevel=3,
        )
    if family.name == "fast_dllm_v2" and length % FAST_DLLM_V2_SUB_BLOCK:
        raise ValueError(f"Fast-dLLM v2 decodes sub-blocks of {FAST_DLLM_V2_SUB_BLOCK}: block length {length} is not")
    return length


def settings_for(config: GenerateConfig, target) -> DecodeSettings:
    """Decoding settings for this target: a real family's own rule and block length, else ``config.settings()``."""
    from spot_dlm.family_rules import FamilyDecoding, make_family_rule
    from spot_dlm.models.family_targets import is_family_target

    if not is_family_target(target):
        return config.settings()
    length = family_block_length(config, target)
    family_rule = None
    if config.numerics == "authors":
        spec = FamilyDecoding(
            family=target.family.name,
            kind=METHODS[config.method].rule,
            mask_id=target.mask_id,
            temperature=config.temperature,
            block_length=length,
            gen_length=config.gen_length,
            tau=config.tau,
            steps=config.steps,
            confidence=config.family_alg,
        )
        family_rule = make_family_rule(spec)
    rule = config.rule()
    return DecodeSettings(rule, length, config.gen_length, config.stop_at_eos, config.handoffs, family_rule)


@dataclass(frozen=True)
class Generation:
    method: str
    prompt: str
    token_ids: list[int]  # generated tokens only, cut before the first EOS
    text: str
    stats: dict
    raw_token_ids: list[int] = field(repr=False)  # every decoded block (EOS and after included)
    commit_step: list[int] = field(repr=False)  # per raw position: rule step inside its block
    commit_pass: list[int] = field(repr=False)  # per raw position: target passes made before its commit

    @property
    def target_passes(self) -> int:
        return self.stats["target_passes"]


def load_target(
    name: str | Path | None = None,
    scoring: str = "batched",
    dtype: torch.dtype = torch.float32,
    hf_options: dict | None = None,
    device: str | torch.device = "cpu",
):
    """``None`` or ``"builtin"``: the shipped model; a folder of the built-in architecture; or a ``transformers``
    checkpoint folder (config.json with a ``model_type``; see ``models/hf.py``), which always scores packed;
    ``hf_options`` go to ``load_hf_target`` (shifted_logits, mask_id, trust_remote_code, family; device_map, e.g.
    "auto": accelerate spreads the layers over the GPUs in place of ``device``). ``device``: cpu, cuda, cuda:N or
    auto; drafters made for the target run on the same device (a placed target's first layer's)."""
    from spot_dlm.models.builtin import builtin_dir, load_builtin_target
    from spot_dlm.models.hf import is_hf_checkpoint

    device = resolve_device(device)
    builtin = name is None or str(name) == "builtin"
    path = builtin_dir() if builtin else Path(name)
    if not path.exists():
        raise ValueError(f"unknown model {str(name)!r}: not 'builtin' and no checkpoint folder at {path}")
    if not path.is_dir():
        raise ValueError(f"--model {path} is a file; give the checkpoint's folder")
    if is_hf_checkpoint(path):
        return load_transformers_target(path, dtype, device, dict(hf_options or {}))
    if (hf_options or {}).get("device_map") is not None:
        raise ValueError("a device map places the layers of a transformers checkpoint; this model is not one")
    return load_builtin_target(path, scoring=scoring, dtype=dtype, device=device)


def load_transformers_target(path: Path, dtype: torch.dtype, device: torch.device, options: dict):
    """A transformers checkpoint folder: a real family (``models/families.py``) through its authors' interface, or
    a stock body as a generic block-diffusion target (``models/hf.py``; ``family="generic"`` forces it)."""
    from spot_dlm.models.families import detect_family, read_json
    from spot_dlm.models.family_targets import load_family_target
    from spot_dlm.models.hf import load_hf_target

    if not any(path.glob("*.safetensors")):
        pickled = sorted(p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt"))
        found = f" (found {', '.join(pickled)})" if pickled else ""
        raise ValueError(f"no safetensors weights in {path}{found}: pickled weights are not loaded, they can run code")
    config = read_json(path / "config.json")
    family = detect_family(config, options.pop("family", None))
    if family.name == "generic":
        return load_hf_target(path, dtype=dtype, device=device, **options)
    given = [f"--{key.replace('_', '-')}" for key in ("shifted_logits", "mask_id") if options.get(key)]
    if given:
        raise ValueError(f"{' and '.join(given)} are for generic models; a {family.title} checkpoint names its own")
    trusted = bool(options.get("trust_remote_code"))
    return load_family_target(path, family, config, dtype, device, trusted, options.get("device_map"))


def with_budget(config: GenerateConfig, target: Target) -> GenerateConfig:
    """The config with ``budget`` auto (None) resolved for this target and device (``budget.choose_budget``)."""
    from dataclasses import replace

    from spot_dlm.budget import choose_budget

    if config.budget is not None:
        return config
    return replace(config, budget=choose_budget(target, config.temperature).budget)


def make_drafter(config: GenerateConfig, target: Target) -> Drafter:
    config = with_budget(config, target)
    factory = METHODS[config.method].drafter
    return NoDrafter() if factory is None else factory(config, target)


def encode_prompt(prompt: str, codec: Codec, config: GenerateConfig, target: Target) -> torch.Tensor:
    if not prompt or not prompt.strip():
        raise ValueError("empty prompt")
    ids = codec.encode_prompt(prompt) if config.apply_template else codec.encode(prompt)
    if len(ids) + config.gen_length > target.max_length:
        raise ValueError(
            f"prompt of {len(ids)} tokens + gen length {config.gen_length} exceeds the model's "
            f"{target.max_length}-token context"
        )
    if callable(getattr(target, "plan", None)):  # a family's canvas: its grid may add to it, or refuse the length
        target.plan(len(ids), config.gen_length, family_block_length(config, target))
    return torch.tensor(ids, dtype=torch.int64)


def cut_at_eos(ids: list[int], eos_id: int) -> list[int]:
    return ids[: ids.index(eos_id)] if eos_id in ids else ids


def cut_at_stop(ids: list[int], stop_ids) -> list[int]:
    """The ids before the first stop token."""
    stops = set(stop_ids)
    return next((ids[:i] for i, token in enumerate(ids) if token in stops), ids)


def generate(
    prompts: Sequence[str],
    config: GenerateConfig,
    target: Target,
    codec: Codec,
    drafter: Drafter | None = None,
    progress: bool = False,
    first_request: int = 0,
) -> list[Generation]:
    """Decode every prompt (request ``first_request + i`` in the noise key) with the configured method."""
    if isinstance(prompts, str):
        prompts = [prompts]
    config = with_budget(config, target)
    encoded = [encode_prompt(p, codec, config, target) for p in prompts]  # validate all before decoding any
    drafter = drafter if drafter is not None else make_drafter(config, target)
    settings = settings_for(config, target)
    results = []
    for index, (prompt, ids) in enumerate(tqdm(list(zip(prompts, encoded)), disable=not progress, desc=config.method)):
        raw = decode_ids(target, ids, settings, drafter, NoiseKey(config.seed, first_request + index))
        raw_ids = raw.token_ids.tolist()
        token_ids = cut_at_stop(raw_ids, getattr(target, "stop_ids", (target.eos_id,)))
        results.append(
            Generation(
                method=config.method,
                prompt=prompt,
                token_ids=token_ids,
                text=codec.decode(token_ids),
                stats=raw.stats.to_dict(),
                raw_token_ids=raw_ids,
                commit_step=raw.commit_step.tolist(),
                commit_pass=raw.commit_pass.tolist(),
            )
        )
    return results
