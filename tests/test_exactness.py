"""Exactness: speculative decoding yields token for token what the drafter-free loop yields (DESIGN.md section 7).

For every drafter (oracle, random, stale-confidence, SPOT with a random or a briefly trained order model), every
temperature, both scoring modes of the built-in target and the one-commit, threshold and dynamic rules,
``decode_ids(..., drafter)`` must return the same tokens *and* the same commit trajectory (``commit_step``) as
``decode_ids(..., NoDrafter())`` under the same ``CommitRule`` and ``NoiseKey``.

Targets are tiny random ``BlockDiffusionLM`` models in float64. A freshly initialised one has tiny logits, so its
stale guesses are rarely accepted at T = 0 and the property would hold trivially; the "peaky", "deep" and "sharp"
variants scale attention and output weights so that stale guesses often survive and trees are accepted several
nodes deep (asserted below). A negative control (verifying with the noise of the wrong step) shows that the checks
can fail.

One module, longer than most: every drafter is checked against the same cases, targets and rules, and the drafter
table (``make_drafter``) is read best in one place.
"""

from __future__ import annotations

import functools
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import spot_dlm.decode as decode_module
from draft_contexts import ORDER_TOP_K, random_order_model
from spot_dlm.decode import (
    ROUND_ENDINGS,
    DecodeSettings,
    DecodeStats,
    DraftContext,
    NoDrafter,
    RawGeneration,
    decode_ids,
)
from spot_dlm.drafters.guesses import StaleGuesses
from spot_dlm.drafters.neighbours import BigramTable, NeighbourTokens
from spot_dlm.drafters.order_net import OrderModel, OrderModelConfig
from spot_dlm.drafters.sets import SetsDrafter, StaleSetsDrafter
from spot_dlm.drafters.simple import OracleDrafter, RandomDrafter, StaleConfidenceDrafter, true_states
from spot_dlm.drafters.spot import SpotDrafter
from spot_dlm.drafters.token_lm import TokenLM
from spot_dlm.drafters.token_survival import SurvivalBucket, TokenSurvival
from spot_dlm.models.builtin import BuiltinTarget
from spot_dlm.models.transformer import BlockDiffusionLM, ModelConfig
from spot_dlm.noise import NoiseKey
from spot_dlm.rules import CommitRule
from spot_dlm.tree import TreeBuilder

torch.set_num_threads(1)

TEMPERATURES = (0.0, 0.7, 1.0, 1.5)
SCORINGS = ("batched", "packed")
DRAFTERS = ("oracle", "random", "stale", "spot-init", "spot-trained")
SURVIVAL = TokenSurvival(
    greedy=(SurvivalBucket(0.3, 0.05), SurvivalBucket(1.0, 0.2)),
    sampled=(SurvivalBucket(2.0, 0.3), SurvivalBucket(0.5, 0.0), SurvivalBucket(5.0, 0.6)),
)
SET_DRAFTERS = ("oracle", "random", "stale", "stale-sets", "spot-sets", "spot-sets-nb", "spot-sets-lm")  # threshold
THRESHOLD_RULES = {
    "threshold-0.3": {"kind": "threshold", "tau": 0.3},
    "threshold-0.6": {"kind": "threshold", "tau": 0.6},
    "dynamic-0.5-k2": {"kind": "dynamic", "tau": 0.5, "k": 2},
}
MASK_ID, EOS_ID = 2, 1

# Weight surgery on a fresh model: (qkv scale, attention-output scale, MLP-output scale, final-norm scale, EOS boost).
# "flat" is the plain initialisation (logits ~ 0.1: near-uniform). The others let attention over the context
# dominate the residual stream and scale the logits up, so a commit moves the other positions' logits only a little:
# stale tokens and confidence orders often survive and trees are accepted deep. The EOS boost makes EOS stops happen.
TARGET_KINDS = {
    "flat": (1.0, 1.0, 1.0, 1.0, 2.0),
    "peaky": (20.0, 50.0, 1.0, 10.0, 2.0),
    "deep": (1.0, 300.0, 50.0, 10.0, 2.0),
    "sharp": (5.0, 100.0, 1.0, 30.0, 2.0),  # confident: threshold rules often commit several positions per pass
}
VOCABS = (12, 24, 40)


@dataclass(frozen=True)
class Case:
    """One decoding problem: a target, a prompt, the block layout, and the noise key."""

    vocab: int
    kind: str
    model_seed: int
    block_length: int
    gen_length: int
    stop_at_eos: bool
    prompt_seed: int
    prompt_length: int
    seed: int
    request: int
    budget: int
    depth: int
    use_cache: bool = True  # False: the target recomputes the prefix on every pass

    @property
    def key(self) -> NoiseKey:
        return NoiseKey(self.seed, self.request)

    def prompt(self) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.prompt_seed)
        return torch.randint(3, self.vocab, (self.prompt_length,), generator=generator)

    def settings(self, rule: CommitRule) -> DecodeSettings:
        return DecodeSettings(
            rule=rule, block_length=self.block_length, gen_length=self.gen_length, stop_at_eos=self.stop_at_eos
        )


def make_case(seed: int, **overrides) -> Case:
    """A deterministic mix of settings per seed (different fields cycle with different periods)."""
    rng = np.random.default_rng(seed)
    block_length = (4, 8)[seed % 2]
    gen_choices = (16, 20, 24, 28, 32) if block_length == 4 else (16, 24, 32)
    fields = {
        "vocab": VOCABS[(seed // 2) % 3],
        "kind": tuple(TARGET_KINDS)[seed % 4],
        "model_seed": (seed // 6) % 3,
        "block_length": block_length,
        "gen_length": gen_choices[int(rng.integers(len(gen_choices)))],
        "stop_at_eos": bool((seed // 4) % 2),
        "prompt_seed": seed,
        "prompt_length": int(rng.integers(2, 11)),
        "seed": seed,
        "request": seed % 3,
        "budget": (4, 8, 16)[(seed // 3) % 3],
        "depth": (2, 4, 8)[(seed // 5) % 3],
        "use_cache": seed % 7 != 6,
    }
    fields.update(overrides)
    return Case(**fields)


@functools.cache
def exact_model(vocab: int, kind: str, model_seed: int) -> BlockDiffusionLM:
    qkv, attn_out, mlp_out, final, eos = TARGET_KINDS[kind]
    torch.manual_seed(1000 * model_seed + vocab)
    config = ModelConfig(
        vocab_size=vocab, d_model=32, n_layers=2, n_heads=2, max_seq_len=128, eos_id=EOS_ID, mask_id=MASK_ID
    )
    model = BlockDiffusionLM(config).to(torch.float64).eval()
    with torch.no_grad():
        for layer in model.layers:
            layer.attn.qkv.weight.mul_(qkv)
            layer.attn.out.weight.mul_(attn_out)
            layer.mlp[2].weight.mul_(mlp_out)
        model.final_norm.weight.mul_(final)
        model.embed.weight[EOS_ID].mul_(eos)
    return model


def target_for(case: Case, scoring: str) -> BuiltinTarget:
    model = exact_model(case.vocab, case.kind, case.model_seed)
    return BuiltinTarget(model, scoring=scoring, use_cache=case.use_cache)


_REFERENCES: dict[tuple, RawGeneration] = {}


def reference(case: Case, rule: CommitRule, scoring: str) -> RawGeneration:
    """The drafter-free run (standard or threshold decoding), cached: several drafters compare against it."""
    cache_key = (case, rule, scoring)
    if cache_key not in _REFERENCES:
        target = target_for(case, scoring)
        _REFERENCES[cache_key] = decode_ids(target, case.prompt(), case.settings(rule), NoDrafter(), case.key)
    return _REFERENCES[cache_key]


@functools.cache
def markov_bigram(vocab: int, seed: int) -> BigramTable:
    """Bigram counts of a skewed random Markov chain over the vocabulary: strong, arbitrary neighbour preferences,
    so the neighbour correction often overturns stale guesses."""
    rng = np.random.default_rng(seed)
    transition = rng.dirichlet(np.full(vocab, 0.2), size=vocab)  # [V, V], each row peaked on a few tokens
    stream = [int(rng.integers(vocab))]
    for _ in range(4000):
        stream.append(int(rng.choice(vocab, p=transition[stream[-1]])))
    return BigramTable.from_stream(np.asarray(stream), vocab)


def neighbour_tokens(case: Case) -> NeighbourTokens:
    return NeighbourTokens(markov_bigram(case.vocab, case.seed % 3), weight_greedy=2.0, weight_sampled=1.5)


def token_lm(case: Case, with_bigram: bool = False) -> TokenLM:
    """Another random model of the case's vocabulary as the small LM (a short window, so the cut is exercised),
    with the made-up bigram's correction added when asked."""
    other = ("peaky", "sharp", "deep")[case.seed % 3]
    model = BuiltinTarget(exact_model(case.vocab, other, (case.model_seed + 1) % 3), scoring="batched")
    bigram = neighbour_tokens(case) if with_bigram else None
    return TokenLM(model, weight_greedy=2.0, weight_sampled=1.5, window=5, bigram=bigram)


def make_drafter(name: str, case: Case, rule: CommitRule, scoring: str, trained: OrderModel | None, salt: int = 0):
    if name in ("oracle", "order-oracle", "order-oracle-nb"):
        ref = reference(case, rule, scoring)
        stale_tokens = name != "oracle"
        neighbours = neighbour_tokens(case) if name == "order-oracle-nb" else None
        return OracleDrafter(
            {case.request: ref}, case.block_length, case.budget, case.depth, stale_tokens, name, neighbours
        )
    if name == "random":
        return RandomDrafter(budget=case.budget, depth=case.depth, token_noise=0.3, salt=salt)
    if name == "stale":
        return StaleConfidenceDrafter(budget=case.budget, depth=case.depth)
    if name == "spot-init":
        return SpotDrafter(
            random_order_model(case.seed % 2), budget=case.budget, depth=case.depth, confidence_prior=0.0
        )
    if name == "spot-trained":  # the order model alone, no confidence prior
        assert trained is not None
        return SpotDrafter(trained, budget=case.budget, depth=case.depth, confidence_prior=0.0)
    if name == "spot-prior3":  # the stale-confidence prior added to the order logits
        model = trained if trained is not None else random_order_model(case.seed % 2)
        return SpotDrafter(model, budget=case.budget, depth=case.depth, confidence_prior=3.0)
    if name == "spot-ts":  # tokens weighed by a (made-up, lopsided) token-survival fit
        model = trained if trained is not None else random_order_model(case.seed % 2)
        return SpotDrafter(model, budget=case.budget, depth=case.depth, token_survival=SURVIVAL)
    if name == "spot-nb-corrected":  # the order model reads the neighbour-corrected confidence as an input
        torch.manual_seed(case.seed % 2)
        config = OrderModelConfig(top_k=ORDER_TOP_K, d_model=32, n_layers=1, n_heads=2, corrected_feature=True)
        model = OrderModel(config).eval()
        return SpotDrafter(model, budget=case.budget, depth=case.depth, neighbours=neighbour_tokens(case))
    if name in ("spot-nb", "spot-nb-ts", "spot-nb-prior"):  # tokens re-ranked by fresh neighbours (made up)
        model = trained if trained is not None else random_order_model(case.seed % 2)
        extra = {"token_survival": SURVIVAL} if name == "spot-nb-ts" else {}
        if name == "spot-nb-prior":  # the confidence prior reads the corrected confidence too
            extra = {"confidence_prior": 3.0, "neighbour_prior": True}
        return SpotDrafter(model, budget=case.budget, depth=case.depth, neighbours=neighbour_tokens(case), **extra)
    if name == "spot-none-nb-ts":  # no order model: the neighbour-corrected stale confidence ranks positions alone
        extra = {"token_survival": SURVIVAL, "confidence_prior": 3.0}
        return SpotDrafter(None, budget=case.budget, depth=case.depth, neighbours=neighbour_tokens(case), **extra)
    if name in ("spot-lm", "spot-lm-ts-prior"):  # tokens re-ranked by a small LM's change of belief (+ bigram)
        model = trained if trained is not None else random_order_model(case.seed % 2)
        extra = {}
        if name == "spot-lm-ts-prior":
            extra = {"token_survival": SURVIVAL, "confidence_prior": 3.0, "neighbour_prior": True}
        neighbours = token_lm(case, with_bigram=bool(extra))
        return SpotDrafter(model, budget=case.budget, depth=case.depth, neighbours=neighbours, **extra)
    if name == "stale-sets":
        return StaleSetsDrafter(budget=case.budget, depth=case.depth)
    if name == "spot-sets":
        return SetsDrafter(random_order_model(case.seed % 2), budget=case.budget, depth=case.depth)
    if name == "spot-sets-nb":  # members' tokens re-ranked by the parent's fresh neighbours (made-up bigram)
        model = random_order_model(case.seed % 2)
        return SetsDrafter(model, budget=case.budget, depth=case.depth, neighbours=neighbour_tokens(case))
    if name == "spot-sets-lm":  # members' tokens re-ranked by a small LM (another random model)
        model = random_order_model(case.seed % 2)
        return SetsDrafter(model, budget=case.budget, depth=case.depth, neighbours=token_lm(case))
    raise ValueError(name)


def check_stats_consistent(raw: RawGeneration, block_length: int) -> None:
    """Bookkeeping of one run: every rule step, commit and pass is accounted for."""
    stats: DecodeStats = raw.stats
    n_blocks = raw.token_ids.shape[0] // block_length
    n_verify = sum(stats.accepted_lengths.values())
    accepted = sum(k * v for k, v in stats.accepted_lengths.items())
    assert raw.token_ids.shape[0] % block_length == 0
    assert stats.committed_tokens == raw.token_ids.shape[0]
    assert stats.rule_steps == accepted + n_blocks  # each block: one free commit after its last verify pass
    assert 0 <= stats.handoff_blocks < max(n_blocks, 1)  # the first block never opens by a hand-off
    # each block's first pass (the first one prefills the prompt; none for a block a hand-off opened), verify passes
    assert stats.target_passes == n_blocks - stats.handoff_blocks + n_verify
    # every verify pass's walk stopped for one reason; each hand-off ending opened the next block
    assert sum(stats.round_endings.values()) == n_verify and set(stats.round_endings) <= set(ROUND_ENDINGS)
    assert stats.round_endings["hand-off"] == stats.handoff_blocks
    assert not bool((raw.token_ids == MASK_ID).any())
    assert bool((raw.commit_step >= 0).all())


def block_steps(raw: RawGeneration, block_length: int) -> list[int]:
    """Rule steps per decoded block (block length for one-commit decoding)."""
    steps = raw.commit_step.view(-1, block_length)
    return [int(s.max()) + 1 for s in steps]


def oracle_verify_lengths(n_steps: int, budget: int, depth: int) -> list[int]:
    """Accepted lengths (free commit included) of the oracle's verify passes on a block of ``n_steps`` rule steps:
    each pass scores the true chain from the root (<= min(depth, budget - 1) more states, the complete state only
    as a hand-off) and accepts all of it."""
    lengths, root = [], 1
    while root < n_steps:
        extra = min(depth, budget - 1, n_steps - 1 - root)
        lengths.append(extra + 1)
        root += extra + 1
    return lengths


def oracle_hands_off(n_steps: int, budget: int, depth: int) -> bool:
    """Whether the oracle's last verify pass of a block also holds the complete block as a hand-off: the chain's
    last node is one step before it, and one more edge fits the depth and one more row the budget."""
    lengths = oracle_verify_lengths(n_steps, budget, depth)
    return bool(lengths) and lengths[-1] <= depth and lengths[-1] + 1 <= budget


def assert_exact(case: Case, rule: CommitRule, scoring: str, drafter) -> tuple[RawGeneration, RawGeneration]:
    """Speculative run == reference run, token for token and step for step; returns (reference, speculative)."""
    ref = reference(case, rule, scoring)
    out = decode_ids(target_for(case, scoring), case.prompt(), case.settings(rule), drafter, case.key)
    where = f"{case} rule={rule} scoring={scoring} drafter={drafter.name}"
    assert torch.equal(out.token_ids, ref.token_ids), f"tokens differ: {where}\n{ref.token_ids}\n{out.token_ids}"
    assert torch.equal(out.commit_step, ref.commit_step), f"trajectories differ: {where}"
    assert out.stats.rule_steps == ref.stats.rule_steps, where
    assert out.stats.committed_tokens == ref.stats.committed_tokens, where
    assert out.stats.target_passes <= ref.stats.target_passes, where
    check_stats_consistent(ref, case.block_length)
    check_stats_consistent(out, case.block_length)
    assert set(ref.stats.accepted_lengths) <= {1}  # the drafter-free loop never accepts a drafted node
    assert set(ref.stats.round_endings) <= {"leaf", "block end"}  # nor drafts any
    if drafter.name.startswith("order-oracle"):  # the true order: a walk never stops at a wrong position
        assert "wrong position" not in out.stats.round_endings, where
    if drafter.name == "oracle":
        lengths = [oracle_verify_lengths(n, case.budget, case.depth) for n in block_steps(ref, case.block_length)]
        assert out.stats.accepted_lengths == Counter(n for block in lengths for n in block), where
        handing_off = [oracle_hands_off(n, case.budget, case.depth) for n in block_steps(ref, case.block_length)[:-1]]
        assert out.stats.handoff_blocks == sum(handing_off), where
        assert set(out.stats.round_endings) <= {"leaf", "hand-off", "block end"}, where  # nothing drafted is wrong
        if rule.kind == "one" and case.block_length >= 4 and case.budget >= 3 and case.depth >= 1:
            assert out.stats.target_passes < ref.stats.target_passes, where
    return ref, out


# ---------------------------------------------------------------------------------------------- trained drafter


@functools.cache
def collect_and_train(steps: int = 40) -> tuple[OrderModel, float, float]:
    """Log standard-decoding trajectories with TrajectoryLog, train a tiny order model for a few dozen steps.

    Returns (model, first loss, mean of the last 5 losses)."""
    from spot_dlm.train.collect import TrajectoryLog
    from spot_dlm.train.drafter import batch_tensors, build_examples, masked_logits

    depth = 4
    log = TrajectoryLog(depth=depth)
    block_offset = 0
    for prompt_id in range(6):
        case = make_case(prompt_id, vocab=40, kind=("peaky", "deep")[prompt_id % 2], block_length=8, gen_length=24)
        rule = CommitRule("one", temperature=0.0 if prompt_id < 3 else 1.0)
        target = target_for(case, "batched")
        key = NoiseKey(case.seed, prompt_id)
        observer = log.observer(key, case.settings(rule), MASK_ID, prompt_id, block_offset)
        raw = decode_ids(target, case.prompt(), case.settings(rule), NoDrafter(), key, observer)
        block_offset += raw.token_ids.shape[0] // case.block_length
    data = log.arrays()
    data["top"] = data["top"][..., :ORDER_TOP_K]
    cum = np.concatenate([np.zeros((1, data["committed"].shape[1]), np.int32), np.cumsum(data["committed"], 0)])
    examples = build_examples(data, depth, np.arange(len(data["block_id"])))
    model = random_order_model(7).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    rng = np.random.default_rng(0)
    losses = []
    for _ in range(steps):
        index = rng.integers(0, len(examples.row), size=64)
        features, allowed, target_pos = batch_tensors(data, cum, examples, index)
        if target_pos.dtype == torch.bool:  # the set committed at step i + d (one position for these examples)
            target_pos = target_pos.float().argmax(-1)
        loss = F.cross_entropy(masked_logits(model, features, allowed), target_pos)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return model.eval(), losses[0], float(np.mean(losses[-5:]))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_features_at_decode_time_equal_the_features_trained_on(temperature: float) -> None:
    """No train/serve skew: the order model's input for a round's root node, built from the live DraftContext,
    equals the depth-1 training example of the stale state's logged row (float16 in shards: atol 1e-3)."""
    from spot_dlm.drafters.guesses import StaleGuesses
    from spot_dlm.drafters.order_features import StaleView
    from spot_dlm.train.collect import TrajectoryLog
    from spot_dlm.train.drafter import Examples, batch_tensors

    config = OrderModelConfig(top_k=ORDER_TOP_K, temperature_feature=True, previous_feature=True)
    case = make_case(1, vocab=40, kind="deep", block_length=8, gen_length=24, stop_at_eos=False)
    rule = CommitRule("one", temperature=temperature)
    contexts: list[DraftContext] = []

    class Recorder(NoDrafter):
        def propose(self, context: DraftContext):
            contexts.append(context)
            return super().propose(context)

    log = TrajectoryLog(depth=3, tau=rule.tau, temperature=temperature)
    observer = log.observer(case.key, case.settings(rule), MASK_ID, 0, 0)
    decode_ids(target_for(case, "batched"), case.prompt(), case.settings(rule), Recorder(), case.key, observer)
    data = log.arrays()
    data["top"] = data["top"][..., :ORDER_TOP_K]
    cum = np.concatenate([np.zeros((1, data["committed"].shape[1]), np.int32), np.cumsum(data["committed"], 0)])
    assert len(contexts) == 3 * (8 - 1)  # every state but the all-mask one and the complete one
    for ctx in contexts:
        (row,) = np.flatnonzero((data["block_id"] == ctx.block_index) & (data["step"] == ctx.root_step - 1))
        logged, _, _ = batch_tensors(data, cum, Examples(row=np.array([row]), depth=np.array([1])), [0], config)
        coupled = StaleGuesses(ctx).at(ctx.root_step).confidence.clamp_min(0)  # [L]
        live = StaleView.of(ctx, config).features(ctx.root[None], coupled[None])  # [1, L, F]
        assert live.shape == logged.shape
        torch.testing.assert_close(live, logged, atol=1e-3, rtol=0)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("seed", range(3))
def test_each_round_hands_the_drafter_the_rules_own_proposal(temperature: float, seed: int) -> None:
    """``DraftContext.proposal`` is the rule's proposal at the stale state under the free commit's noise, whichever
    node was accepted last (at T = 0 drafters take their stale guesses from it instead of recomputing them)."""
    from spot_dlm.rules import propose

    case = make_case(seed, kind="deep", block_length=8, gen_length=24, budget=6, depth=4)
    rule = CommitRule("one", temperature=temperature)
    inner, contexts = make_drafter("stale", case, rule, "batched", None), []

    class Recorder:
        name = "recorder"

        def propose(self, context: DraftContext):
            contexts.append(context)
            return inner.propose(context)

    decode_ids(target_for(case, "batched"), case.prompt(), case.settings(rule), Recorder(), case.key)
    deep = 0
    for ctx in contexts:
        noise = ctx.gumbel(ctx.root_step - 1, ctx.parent == MASK_ID)[None] if temperature > 0 else None
        expected = propose(ctx.parent[None], ctx.stale_logits[None], noise, rule, MASK_ID)
        assert torch.equal(ctx.proposal.tokens, expected.tokens[0])
        assert torch.equal(ctx.proposal.confidence, expected.confidence[0])
        deep += ctx.root_step > 1 and int((ctx.parent != MASK_ID).sum()) > 0
    assert deep > 0  # rounds after accepted drafts were checked too


@pytest.fixture(scope="module")
def trained() -> OrderModel:
    return collect_and_train()[0]


def test_order_model_training_learns():
    _, first, last = collect_and_train()
    assert last < first


# ---------------------------------------------------------------------------------------------- the property


@pytest.mark.parametrize("scoring", SCORINGS)
@pytest.mark.parametrize("drafter_name", DRAFTERS)
@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_speculative_equals_standard(temperature, drafter_name, scoring, trained):
    rule = CommitRule("one", temperature=temperature)
    t_index = TEMPERATURES.index(temperature)
    for seed in range(3 * t_index, 3 * t_index + 3):
        case = make_case(seed)
        salts = (seed, seed + 100) if drafter_name == "random" else (0,)
        for salt in salts:
            assert_exact(case, rule, scoring, make_drafter(drafter_name, case, rule, scoring, trained, salt))


@pytest.mark.parametrize("scoring", SCORINGS)
@pytest.mark.parametrize(
    "drafter_name",
    ("spot-prior3", "spot-ts", "order-oracle", "spot-nb"),
)
@pytest.mark.parametrize("temperature", (0.0, 1.0))
def test_drafter_variants_equal_standard(temperature, drafter_name, scoring, trained):
    """The confidence prior, token-survival weights, the order oracle and neighbour tokens change only what is
    drafted."""
    rule = CommitRule("one", temperature=temperature)
    for seed in range(20, 23):
        case = make_case(seed, kind="deep") if seed % 2 else make_case(seed)
        assert_exact(case, rule, scoring, make_drafter(drafter_name, case, rule, scoring, trained))


@pytest.mark.parametrize("scoring", SCORINGS)
@pytest.mark.parametrize(
    "drafter_name",
    (
        "spot-nb",
        "spot-nb-ts",
        "spot-nb-prior",
        "spot-nb-corrected",
        "spot-none-nb-ts",
        "order-oracle-nb",
        "spot-lm",
        "spot-lm-ts-prior",
    ),
)
@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_neighbour_tokens_equal_standard(temperature, drafter_name, scoring, trained):
    """Tokens re-ranked by the branch's fresh neighbours (bigram) or by a small LM's change of belief change only
    what is drafted, at every temperature."""
    rule = CommitRule("one", temperature=temperature)
    t_index = TEMPERATURES.index(temperature)
    for seed in range(30 + 3 * t_index, 33 + 3 * t_index):
        case = make_case(seed, kind=("deep", "peaky", "sharp")[seed % 3])
        assert_exact(case, rule, scoring, make_drafter(drafter_name, case, rule, scoring, trained))


@pytest.mark.parametrize("drafter_name", SET_DRAFTERS)
@pytest.mark.parametrize("rule_name", tuple(THRESHOLD_RULES))
def test_threshold_rules_speculative_equals_plain(rule_name, drafter_name):
    for seed in range(50, 50 + 2 * len(TEMPERATURES)):
        rule = CommitRule(temperature=TEMPERATURES[seed % 4], **THRESHOLD_RULES[rule_name])
        case, scoring = make_case(seed), SCORINGS[(seed // 4) % 2]
        assert_exact(case, rule, scoring, make_drafter(drafter_name, case, rule, scoring, None, salt=seed))


def test_threshold_rules_commit_several_per_pass():
    """The threshold cases are not one-commit decoding in disguise: some passes commit several positions, and the
    oracle's trees of commit *sets* are accepted deep."""
    for params in THRESHOLD_RULES.values():
        several, oracle = 0, DecodeStats()
        for temperature in (0.0, 1.0):
            rule = CommitRule(temperature=temperature, **params)
            for seed in range(3, 7):
                case = make_case(seed, kind="sharp", block_length=8, gen_length=16, stop_at_eos=False)
                ref, out = assert_exact(case, rule, "batched", make_drafter("oracle", case, rule, "batched", None))
                several += sum(steps < case.block_length for steps in block_steps(ref, case.block_length))
                oracle.merge(out.stats)
        assert several > 0, params
        assert oracle.mean_accepted > 1.5, (params, oracle.to_dict())


@pytest.mark.parametrize("scoring", SCORINGS)
def test_peaky_targets_accept_deep(scoring):
    """On peaky targets stale guesses are accepted several nodes deep, so the property is not trivially true."""
    for temperature in (0.0, 1.0):
        rule = CommitRule("one", temperature=temperature)
        totals = {"stale": DecodeStats(), "oracle": DecodeStats(), "random": DecodeStats()}
        for seed in range(3):
            case = make_case(seed, kind="deep", block_length=8, gen_length=24, budget=16, depth=8, stop_at_eos=False)
            for name, stats in totals.items():
                _, out = assert_exact(case, rule, scoring, make_drafter(name, case, rule, scoring, None, salt=seed))
                stats.merge(out.stats)
        assert totals["stale"].mean_accepted > 1.5, (temperature, totals["stale"].to_dict())
        assert max(totals["stale"].accepted_lengths) >= 3, (temperature, totals["stale"].to_dict())
        assert totals["oracle"].mean_accepted > 1.5
        assert totals["random"].mean_accepted >= 1.0


@dataclass
class TreeRecorder:
    """Wraps a drafter and keeps every (context, tree) it proposed."""

    inner: object
    name: str = "recorder"
    trees: list = field(default_factory=list)

    def propose(self, context: DraftContext):
        self.trees.append((context, self.inner.propose(context)))
        return self.trees[-1][1]


@pytest.mark.parametrize("temperature", (0.0, 1.0))
def test_order_oracle_drafts_the_true_order_with_stale_tokens(temperature):
    """Each tree is one chain: edge k commits the position the true step commits, with the stale coupled guess;
    the chain stops after its first node off the true trajectory. It never beats the full oracle, and on a peaky
    target its guesses often hold."""
    rule = CommitRule("one", temperature=temperature)
    off_trajectory, passes = 0, {"oracle": 0, "order-oracle": 0}
    for seed in range(4):
        case = make_case(seed, kind="deep", block_length=8, gen_length=24, budget=16, depth=8, stop_at_eos=False)
        ref = reference(case, rule, "batched")
        recorder = TreeRecorder(make_drafter("order-oracle", case, rule, "batched", None))
        assert_exact(case, rule, "batched", recorder)
        for context, tree in recorder.trees:
            truth = true_states(ref, context.block_index, case.block_length, MASK_ID)
            guesses = StaleGuesses(context)
            for node in range(1, len(tree)):
                assert tree.parents[node] == node - 1
                step = context.root_step + node - 1
                position = truth[step + 1] != truth[step]
                changed = tree.states[node] != tree.states[node - 1]
                assert torch.equal(changed, position & (guesses.at(step).tokens != MASK_ID))
                assert torch.equal(tree.states[node][position], guesses.at(step).tokens[position])
                on_trajectory = torch.equal(tree.states[node], truth[step + 1])
                assert on_trajectory or node == len(tree) - 1
                off_trajectory += not on_trajectory
        for name in passes:
            out = assert_exact(case, rule, "batched", make_drafter(name, case, rule, "batched", None))[1]
            passes[name] += out.stats.target_passes
    assert off_trajectory > 0
    assert passes["order-oracle"] >= passes["oracle"]


def test_eos_stop_is_exercised():
    """Some sweep cases stop early at EOS (so ``stop_at_eos=True`` is really tested against the reference)."""
    stopped = 0
    for seed in range(4, 40, 8):
        case = make_case(seed, stop_at_eos=True, gen_length=32)
        rule = CommitRule("one", temperature=1.0)
        ref, _ = assert_exact(case, rule, "batched", make_drafter("stale", case, rule, "batched", None))
        stopped += ref.token_ids.shape[0] < case.gen_length
    assert stopped > 0


@dataclass
class RecordingDrafter:
    """Wraps a drafter and keeps every tree it proposes."""

    inner: object
    trees: list = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.inner.name

    def propose(self, context):
        self.trees.append(self.inner.propose(context))
        return self.trees[-1]


def test_a_block_that_ends_decoding_is_never_handed_off():
    """Under ``stop_at_eos`` a complete block holding EOS has no next block: the oracle, which hands off every true
    complete block it can, hands off none holding EOS there; without the stop it does, and both stay exact."""
    rule = CommitRule("one", temperature=1.0)
    holding_eos = {}
    for stop in (True, False):
        count = 0
        for seed in range(4, 40, 8):
            case = make_case(seed, gen_length=32, budget=16, depth=8, stop_at_eos=stop)
            drafter = RecordingDrafter(make_drafter("oracle", case, rule, "batched", None))
            assert_exact(case, rule, "batched", drafter)
            count += sum(int((t.handoffs == EOS_ID).any(-1).sum()) for t in drafter.trees if t.n_handoffs)
        holding_eos[stop] = count
    assert holding_eos[True] == 0 and holding_eos[False] > 0


# ---------------------------------------------------------------------------------------------- merged states


def test_tree_merges_identical_states_and_walk_finds_them():
    """Committing a then b, or b then a, reaches one state: it is stored (and scored) once and found by lookup."""
    mask, a, b = MASK_ID, 7, 9
    root = torch.full((4,), mask, dtype=torch.int64)
    builder = TreeBuilder(root=root, root_step=3, mask_id=mask, max_nodes=16)
    state_a = root.clone()
    state_a[0] = a
    state_b = root.clone()
    state_b[2] = b
    state_ab = state_a.clone()
    state_ab[2] = b
    node_a = builder.add(0, state_a)
    node_ab = builder.add(node_a, state_ab.clone())
    node_b = builder.add(0, state_b)
    node_ba = builder.add(node_b, state_ab.clone())  # same state, same step index: merged
    assert node_ba == node_ab
    tree = builder.build()
    assert len(tree) == 4 and tree.states.shape == (4, 4)
    assert sum(torch.equal(s, state_ab) for s in tree.states) == 1
    assert tree.steps[node_ab] == 5 and tree.parents[node_ab] == node_a
    assert tree.lookup(state_ab, 5) == node_ab
    assert tree.lookup(state_ab, 4) is None  # a node is a state *and* its rule-step index
    assert tree.lookup(state_a, 4) == node_a and tree.lookup(state_b, 4) == node_b
    assert tree.lookup(root, 3) == 0

    # the same state reached by a different number of rule steps (threshold decoding) is a different node
    builder2 = TreeBuilder(root=root, root_step=0, mask_id=mask, max_nodes=16)
    n1 = builder2.add(0, state_a)
    n2 = builder2.add(n1, state_ab)
    n_set = builder2.add(0, state_ab)  # one set commit a and b together: step 1, not 2
    assert n_set not in (None, n2)
    assert builder2.build().lookup(state_ab, 1) == n_set

    # the acceptance walk follows the true trajectory root -> b -> ab through the merged node
    complete = torch.tensor([a, 5, b, 6])
    next_states = torch.stack([state_b, state_ab, complete, complete])  # indexed by node: 0, a, ab, b
    next_states[node_b] = state_ab
    next_states[node_ab] = complete
    next_states[node_a] = complete
    assert decode_module._accept(tree, next_states) == [0, node_b, node_ab]


# ---------------------------------------------------------------------------------------------- negative control


def test_negative_control_wrong_step_noise(monkeypatch):
    """Verifying drafted nodes with the noise of the wrong rule step breaks exactness at T > 0: the property test
    above would catch such a bug (it has power). At T = 0 there is no noise, so the same bug is invisible."""
    runs = []
    for temperature in (0.0, 1.0):
        rule = CommitRule("one", temperature=temperature)
        for seed in range(4):
            case = make_case(seed, kind="deep", block_length=8, gen_length=24, budget=16, depth=8)
            ref, _ = assert_exact(case, rule, "batched", make_drafter("stale", case, rule, "batched", None))
            runs.append((case, rule, ref))  # unpatched: exact

    original = decode_module.step_noise

    def shifted(block_noise, steps, rule, states, mask_id):
        return original(block_noise, steps[:1] + tuple(s + 1 for s in steps[1:]), rule, states, mask_id)

    monkeypatch.setattr(decode_module, "step_noise", shifted)
    differ = {0.0: 0, 1.0: 0}
    for case, rule, ref in runs:
        target, settings = target_for(case, "batched"), case.settings(rule)
        # the drafter-free loop only ever scores roots: the patch does not touch the reference
        again = decode_ids(target, case.prompt(), settings, NoDrafter(), case.key)
        assert torch.equal(again.token_ids, ref.token_ids) and torch.equal(again.commit_step, ref.commit_step)
        out = decode_ids(target, case.prompt(), settings, make_drafter("stale", case, rule, "batched", None), case.key)
        same = torch.equal(out.token_ids, ref.token_ids) and torch.equal(out.commit_step, ref.commit_step)
        differ[rule.temperature] += not same
    assert differ[1.0] > 0
    assert differ[0.0] == 0


# ---------------------------------------------------------------------------------------------- the large sweep


@pytest.mark.slow
@pytest.mark.parametrize("scoring", SCORINGS)
@pytest.mark.parametrize("rule_name", ("one", *THRESHOLD_RULES))
def test_exactness_sweep(rule_name, scoring, trained):
    params = {"kind": "one"} if rule_name == "one" else THRESHOLD_RULES[rule_name]
    drafters = (*DRAFTERS, "stale-sets") if rule_name == "one" else SET_DRAFTERS
    n_seeds = 16 if rule_name == "one" else 8
    for temperature in TEMPERATURES:
        rule = CommitRule(temperature=temperature, **params)
        for seed in range(1000, 1000 + n_seeds):
            case = make_case(seed)
            for name in drafters:
                assert_exact(case, rule, scoring, make_drafter(name, case, rule, scoring, trained, salt=seed))


# ---------------------------------------------------------------------------------------------- edge settings

EDGE_RULES = (
    CommitRule("dynamic", 1.0, k=2, tau=1.0),  # nothing above tau: the two most confident
    CommitRule("one", 0.7, confidence="margin"),
    CommitRule("one", 1.0, confidence="neg_entropy"),
    CommitRule("one", 1.5, confidence="tempered"),
    CommitRule("threshold", 1.0, confidence="tempered", tau=0.2),
    CommitRule("dynamic", 0.0, tau=0.9, k=3),
)


def edge_case(seed: int) -> Case:
    """Short and odd blocks, generation lengths that are not a multiple of the block, budgets down to 1."""
    return make_case(
        seed,
        block_length=(1, 2, 3, 5, 6)[seed % 5],
        gen_length=(7, 12, 13)[seed % 3],
        budget=(1, 2, 3)[seed % 3],
        depth=(1, 2, 5)[(seed // 3) % 3],
    )


def test_edge_settings_exact():
    for seed, rule in zip(range(6), EDGE_RULES):
        case = edge_case(seed)
        for name in ("oracle", "stale"):
            assert_exact(case, rule, SCORINGS[seed % 2], make_drafter(name, case, rule, SCORINGS[seed % 2], None))


@pytest.mark.slow
@pytest.mark.parametrize("rule", EDGE_RULES, ids=lambda r: f"{r.kind}-{r.confidence}-T{r.temperature:g}")
def test_edge_settings_sweep(rule):
    for seed in range(40):
        case, scoring = edge_case(seed), SCORINGS[seed % 2]
        for name in ("oracle", "random", "stale", "spot-init", "stale-sets"):
            assert_exact(case, rule, scoring, make_drafter(name, case, rule, scoring, None, salt=seed))


# ---------------------------------------------------------------------------------------------- found bugs


def test_random_drafter_token_noise_rate_at_t0():
    """RandomDrafter replaces a drafted token by a random one with probability ``token_noise`` at every T.

    (Exactness does not depend on it; the drafter's acceptance rate, as a baseline, does.)"""
    from spot_dlm.decode import DraftContext
    from spot_dlm.drafters.guesses import StaleGuesses

    case = make_case(1, vocab=40, block_length=8)
    target = target_for(case, "batched")
    state = torch.full((8,), MASK_ID)
    logits = target.score(target.prefill(case.prompt()), state[None]).logits[0]
    rates = {}
    for temperature in (1.0, 0.0):
        rule = CommitRule("one", temperature)
        swapped = total = 0
        for salt in range(25):
            context = DraftContext(state, state, logits, 0, 0, NoiseKey(salt), rule, MASK_ID)
            tree = RandomDrafter(budget=16, depth=8, token_noise=0.3, salt=salt).propose(context)
            guesses = StaleGuesses(context)
            for node in range(1, len(tree)):
                parent = tree.parents[node]
                position = int((tree.states[node] != tree.states[parent]).nonzero()[0, 0])
                swapped += int(tree.states[node][position] != guesses.at(tree.steps[parent]).tokens[position])
                total += 1
        rates[temperature] = swapped / total
    assert 0.2 < rates[1.0] < 0.4, rates
    assert 0.2 < rates[0.0] < 0.4, rates


def test_sets_drafters_accept_commit_sets():
    """SPOT-Sets trees are accepted deep too, including nodes that commit several positions at once (under the
    dynamic rule with k = 2 every pass commits >= 2 positions, so any acceptance is of a multi-commit set)."""
    for params, floor in ((THRESHOLD_RULES["threshold-0.3"], 1.5), (THRESHOLD_RULES["dynamic-0.5-k2"], 1.0)):
        rule, stats = CommitRule(temperature=1.0, **params), DecodeStats()
        for seed in range(3, 7):
            case = make_case(seed, kind="deep", block_length=8, gen_length=16, stop_at_eos=False, budget=16, depth=8)
            _, out = assert_exact(case, rule, "batched", make_drafter("stale-sets", case, rule, "batched", None))
            stats.merge(out.stats)
        assert stats.mean_accepted > floor, (params, stats.to_dict())


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("seed", range(6))
def test_draft_context_previous_logits_are_the_states_one_commit_earlier(temperature: float, seed: int) -> None:
    """Every context's ``previous_logits`` are the target's logits at the state one rule step before ``parent``
    (None at a block's first state), also after multi-node acceptance; checked against the drafter-free run."""
    case = make_case(seed, kind="deep", budget=8, depth=4)
    rule = CommitRule("one", temperature=temperature)
    steps: list = []
    decode_ids(target_for(case, "batched"), case.prompt(), case.settings(rule), NoDrafter(), case.key, steps.append)
    by_block_step = {(r.block_index, r.step_index): r for r in steps}
    contexts: list[DraftContext] = []
    inner = make_drafter("oracle", case, rule, "batched", None)

    class Spy:
        name = "spy"

        def propose(self, context: DraftContext):
            contexts.append(context)
            return inner.propose(context)

    out = decode_ids(target_for(case, "batched"), case.prompt(), case.settings(rule), Spy(), case.key)
    assert max(out.stats.accepted_lengths) > 1  # the oracle accepts several nodes per pass
    for context in contexts:
        parent_step = context.root_step - 1
        record = by_block_step[(context.block_index, parent_step)]
        assert torch.equal(record.state, context.parent)
        if parent_step == 0:
            assert context.previous_logits is None
            continue
        before = by_block_step[(context.block_index, parent_step - 1)]
        assert torch.equal(before.next_state, context.parent)
        assert torch.allclose(context.previous_logits, before.logits, atol=1e-9, rtol=0)
