"""The built-in target: scoring modes, the prefix cache, and pass accounting of the decoding loop."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from spot_dlm.decode import DecodeSettings, DraftContext, NoDrafter, StepRecord, decode_ids
from spot_dlm.models.base import ScoreResult, Target, scores_handoffs
from spot_dlm.models.builtin import BuiltinTarget, PrefixCache
from spot_dlm.models.transformer import BlockDiffusionLM
from spot_dlm.noise import NoiseKey
from spot_dlm.rules import CommitRule
from spot_dlm.tree import DraftTree

ATOL = 1e-10
MODES = [("batched", True), ("packed", True), ("batched", False), ("packed", False)]

MakeTarget = Callable[..., BuiltinTarget]


def random_ids(generator: torch.Generator, *shape: int, vocab: int = 40) -> torch.Tensor:
    """Random real token ids (never the mask id 2)."""
    ids = torch.randint(3, vocab, shape, generator=generator)
    return ids


def candidate_blocks(generator: torch.Generator, n_rows: int, length: int, mask_id: int) -> torch.Tensor:
    blocks = random_ids(generator, n_rows, length)
    blocks[torch.rand(n_rows, length, generator=generator) < 0.5] = mask_id
    blocks[0] = mask_id  # the all-mask state is always among the candidates
    blocks[1, -2] = 3  # and a state that differs from it
    return blocks


def assert_caches_equal(a: PrefixCache, b: PrefixCache) -> None:
    assert torch.equal(a.tokens, b.tokens)
    torch.testing.assert_close(a.last_hidden, b.last_hidden, atol=ATOL, rtol=0)
    if a.kv is not None and b.kv is not None:
        for x, y in zip(a.kv, b.kv, strict=True):
            torch.testing.assert_close(x.keys, y.keys, atol=ATOL, rtol=0)
            torch.testing.assert_close(x.values, y.values, atol=ATOL, rtol=0)


def test_builtin_target_satisfies_protocol(make_target: MakeTarget) -> None:
    target = make_target()
    assert isinstance(target, Target)
    assert (target.vocab_size, target.mask_id, target.eos_id) == (40, 2, 1)


def test_unknown_scoring_mode(tiny_model: BlockDiffusionLM) -> None:
    with pytest.raises(ValueError, match="scoring"):
        BuiltinTarget(model=tiny_model, scoring="sequential")


@pytest.mark.parametrize("with_finished", [False, True])
def test_scoring_modes_agree(make_target: MakeTarget, with_finished: bool) -> None:
    """packed == batched == one state at a time == uncached, with and without a finished block in the pass."""
    generator = torch.Generator().manual_seed(0)
    prompt = random_ids(generator, 5)
    finished = random_ids(generator, 4) if with_finished else None
    blocks = candidate_blocks(generator, 5, 4, mask_id=2)
    results: dict[tuple[str, bool], ScoreResult] = {}
    for scoring, use_cache in MODES:
        target = make_target(scoring, use_cache)
        results[scoring, use_cache] = target.score(target.prefill(prompt), blocks, finished)
    reference = results["batched", True]
    assert reference.logits.shape == (5, 4, 40)
    assert reference.logits.dtype == torch.float64
    for mode, result in results.items():
        torch.testing.assert_close(result.logits, reference.logits, atol=ATOL, rtol=0, msg=str(mode))
        assert_caches_equal(result.cache, reference.cache)
    # one state at a time
    target = make_target()
    cache = target.prefill(prompt)
    for row in range(blocks.shape[0]):
        single = target.score(cache, blocks[row : row + 1], finished)
        torch.testing.assert_close(single.logits[0], reference.logits[row], atol=ATOL, rtol=0)
    # position 0 is predicted by the last clean token, the same for every row; the later positions depend on the
    # row's own block (the comparison would be vacuous if the block contents were ignored)
    torch.testing.assert_close(reference.logits[:, 0], reference.logits[:1, 0].expand(5, -1), atol=ATOL, rtol=0)
    assert (reference.logits[0, 1:] - reference.logits[1, 1:]).abs().max() > 1e-3


@pytest.mark.parametrize(("scoring", "use_cache"), MODES)
def test_finished_in_score_equals_separate_write(make_target: MakeTarget, scoring: str, use_cache: bool) -> None:
    generator = torch.Generator().manual_seed(1)
    prompt, finished = random_ids(generator, 4), random_ids(generator, 3)
    blocks = candidate_blocks(generator, 3, 3, mask_id=2)
    target = make_target(scoring, use_cache)
    cache = target.prefill(prompt)
    together = target.score(cache, blocks, finished)
    written = target.write(cache, finished)
    apart = target.score(written, blocks)
    torch.testing.assert_close(together.logits, apart.logits, atol=ATOL, rtol=0)
    assert_caches_equal(together.cache, written)
    assert apart.cache is written  # scoring without a finished block leaves the cache as it is


@pytest.mark.parametrize(("scoring", "use_cache"), MODES)
@pytest.mark.parametrize("n_blocks", [1, 2, 3])
def test_a_hand_off_is_the_next_blocks_first_pass(
    make_target: MakeTarget, scoring: str, use_cache: bool, n_blocks: int
) -> None:
    generator = torch.Generator().manual_seed(13)
    prompt = random_ids(generator, 5)
    blocks = candidate_blocks(generator, 3, 4, mask_id=2)[:n_blocks]
    complete = torch.stack([random_ids(generator, 4) for _ in range(2)])  # [M, L]
    target = make_target(scoring, use_cache)
    cache = target.prefill(prompt)
    passes = target.counter.passes
    scored = target.score_handoffs(cache, blocks, complete)
    assert target.counter.passes == passes + 1
    assert scores_handoffs(target)
    torch.testing.assert_close(scored.logits, target.score(cache, blocks).logits, atol=ATOL, rtol=0)
    all_mask = torch.full((1, 4), 2)
    for m in range(2):
        first = target.score(cache, all_mask, complete[m])  # the next block's first pass, written apart
        torch.testing.assert_close(scored.next_logits[m], first.logits[0], atol=ATOL, rtol=0)
        opened = scored.opening(m)
        assert_caches_equal(opened, first.cache)
        after = target.score(opened, blocks).logits  # the opened cache serves the next block's rounds
        torch.testing.assert_close(after, target.score(first.cache, blocks).logits, atol=ATOL, rtol=0)


def manual_reference_logits(model: BlockDiffusionLM, prefix: torch.Tensor, block: torch.Tensor) -> torch.Tensor:
    """Logits of ``block`` after ``prefix`` from one uncached forward with a hand-built mask.

    Clean prefix tokens are causal; block tokens see the whole prefix and the whole block. Output is shifted: the
    hidden state of position p predicts position p + 1.
    """
    n_prefix, length = prefix.shape[0], block.shape[0]
    total = n_prefix + length
    mask = torch.zeros(total, total, dtype=torch.bool)
    mask[:n_prefix, :n_prefix] = torch.tril(torch.ones(n_prefix, n_prefix, dtype=torch.bool))
    mask[n_prefix:, :] = True
    ids = torch.cat([prefix, block])[None]
    hidden, _ = model(ids, torch.arange(total)[None], mask[None])
    return model.logits(hidden[0, n_prefix - 1 : total - 1])


@pytest.mark.parametrize(("scoring", "use_cache"), MODES)
def test_logits_match_hand_built_attention(
    make_target: MakeTarget, tiny_model: BlockDiffusionLM, scoring: str, use_cache: bool
) -> None:
    generator = torch.Generator().manual_seed(2)
    prompt, finished = random_ids(generator, 6), random_ids(generator, 4)
    blocks = candidate_blocks(generator, 3, 4, mask_id=2)
    target = make_target(scoring, use_cache)
    logits = target.score(target.prefill(prompt), blocks, finished).logits
    prefix = torch.cat([prompt, finished])
    with torch.no_grad():
        for row in range(blocks.shape[0]):
            expected = manual_reference_logits(tiny_model, prefix, blocks[row])
            torch.testing.assert_close(logits[row], expected, atol=ATOL, rtol=0)


def test_candidate_blocks_do_not_change_the_cache(make_target: MakeTarget) -> None:
    generator = torch.Generator().manual_seed(3)
    prompt, finished = random_ids(generator, 4), random_ids(generator, 4)
    target = make_target()
    cache = target.prefill(prompt)
    a = target.score(cache, candidate_blocks(generator, 2, 4, mask_id=2), finished).cache
    b = target.score(cache, candidate_blocks(generator, 4, 4, mask_id=2), finished).cache
    assert_caches_equal(a, b)


@pytest.mark.parametrize("use_cache", [True, False])
def test_cache_grows_by_block_length(make_target: MakeTarget, use_cache: bool) -> None:
    generator = torch.Generator().manual_seed(4)
    target = make_target("batched", use_cache)
    cache = target.prefill(random_ids(generator, 5))
    assert cache.length == 5
    for index in range(3):
        blocks = candidate_blocks(generator, 2, 4, mask_id=2)
        cache = target.score(cache, blocks, random_ids(generator, 4)).cache
        assert cache.length == 5 + 4 * (index + 1)
        if use_cache:
            assert all(kv.keys.shape[:3] == (1, 2, cache.length) for kv in cache.kv)
        else:
            assert cache.kv is None
    cache = target.write(cache, random_ids(generator, 4))
    assert cache.length == 5 + 4 * 4


def test_prefill_rejects_empty_and_2d_prompts(make_target: MakeTarget) -> None:
    target = make_target()
    with pytest.raises(ValueError, match="non-empty"):
        target.prefill(torch.zeros(0, dtype=torch.int64))
    with pytest.raises(ValueError, match="1-D"):
        target.prefill(torch.ones(1, 3, dtype=torch.int64))


def test_counter_records_passes_and_query_tokens(make_target: MakeTarget) -> None:
    generator = torch.Generator().manual_seed(5)
    prompt, finished = random_ids(generator, 5), random_ids(generator, 4)
    blocks = candidate_blocks(generator, 3, 4, mask_id=2)
    expected_tokens = {
        # prefill 5; score 3 candidates of 4 with a finished block of 4 written in the same pass
        ("batched", True): 5 + 3 * (4 + 4),  # every batch row carries the finished block
        ("packed", True): 5 + 4 + 3 * 4,
        ("batched", False): 5 + 3 * (5 + 4 + 4),  # the prefix is recomputed
        ("packed", False): 5 + (5 + 4) + 3 * 4,
    }
    for (scoring, use_cache), tokens in expected_tokens.items():
        target = make_target(scoring, use_cache)
        target.score(target.prefill(prompt), blocks, finished)
        assert target.counter.snapshot() == (2, tokens), (scoring, use_cache)


# --------------------------------------------------------------------------------------------- decoding


def decode(target, prompt: torch.Tensor, temperature: float, block_length: int, gen_length: int, seed: int, **kwargs):
    rule = kwargs.pop("rule", CommitRule(temperature=temperature))
    settings = DecodeSettings(rule, block_length, gen_length, stop_at_eos=kwargs.pop("stop_at_eos", False))
    return decode_ids(target, prompt, settings, NoDrafter(), NoiseKey(seed=seed, request=0), **kwargs)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("block_length", [2, 4])
def test_decoding_identical_across_cache_and_scoring_modes(
    make_target: MakeTarget, temperature: float, block_length: int
) -> None:
    generator = torch.Generator().manual_seed(6)
    prompt = random_ids(generator, 5)
    outputs = []
    for seed in range(3):
        reference = decode(make_target(), prompt, temperature, block_length, 8, seed).token_ids
        for scoring, use_cache in MODES[1:]:
            other = decode(make_target(scoring, use_cache), prompt, temperature, block_length, 8, seed).token_ids
            assert torch.equal(other, reference), (seed, scoring, use_cache)
        outputs.append(reference)
    assert all(out.shape == (8,) for out in outputs)
    assert 2 not in torch.cat(outputs).tolist()  # the mask id never survives in the output
    if temperature > 0:  # different seeds give different samples (else the keyed noise is not used)
        assert len({tuple(out.tolist()) for out in outputs}) > 1


@pytest.mark.parametrize("block_length", [1, 2, 4])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_standard_decoding_pass_count(make_target: MakeTarget, block_length: int, temperature: float) -> None:
    """Per block 1 pass on the all-mask state (the first one prefills the prompt too) + L - 1 passes (the last commit
    is free) = G."""
    gen_length, prompt_length = 8, 5
    target = make_target()
    prompt = random_ids(torch.Generator().manual_seed(7), prompt_length)
    raw = decode(target, prompt, temperature, block_length, gen_length, seed=3)
    stats = raw.stats
    assert stats.target_passes == gen_length
    assert target.counter.passes == stats.target_passes
    assert stats.rule_steps == gen_length
    assert stats.committed_tokens == gen_length
    n_blocks, length = gen_length // block_length, block_length
    # block b: first pass (the prompt P when b = 0, else the finished block of L) + L, then L - 1 passes of L
    assert stats.query_tokens == prompt_length + n_blocks * length * length + (n_blocks - 1) * length
    # every position is committed once, at steps 0..L-1 of its block, after 1 + b L + step passes
    steps = raw.commit_step.view(n_blocks, length)
    assert all(sorted(row.tolist()) == list(range(length)) for row in steps)
    expected_pass = 1 + torch.arange(n_blocks)[:, None] * length + steps
    assert torch.equal(raw.commit_pass.view(n_blocks, length), expected_pass)


def test_uncached_decoding_counts_recomputed_prefix(make_target: MakeTarget) -> None:
    prompt_length, block_length, gen_length = 5, 4, 8
    target = make_target("batched", use_cache=False)
    raw = decode(target, random_ids(torch.Generator().manual_seed(8), prompt_length), 1.0, block_length, gen_length, 0)
    n_blocks = gen_length // block_length
    expected = sum(block_length * (prompt_length + (b + 1) * block_length) for b in range(n_blocks))
    assert raw.stats.target_passes == gen_length
    assert raw.stats.query_tokens == expected


def test_threshold_decoding_passes_equal_rule_steps(make_target: MakeTarget) -> None:
    prompt = random_ids(torch.Generator().manual_seed(9), 5)
    rule_steps = {}
    for tau in (0.01, 0.05, 0.5):
        target = make_target()
        rule = CommitRule(kind="threshold", tau=tau, temperature=1.0)
        raw = decode(target, prompt, 1.0, 4, 16, seed=1, rule=rule)
        assert raw.stats.target_passes == raw.stats.rule_steps  # the first pass prefills the prompt too
        assert raw.stats.committed_tokens == 16
        assert raw.token_ids.shape == (16,)
        assert 2 not in raw.token_ids.tolist()
        rule_steps[tau] = raw.stats.rule_steps
    # the lower tau, the more positions commit per pass (these trajectories are fixed by model and seed)
    assert rule_steps[0.01] < rule_steps[0.05] < 16
    assert rule_steps[0.01] >= 4


def test_observer_sees_every_step(make_target: MakeTarget) -> None:
    records: list[StepRecord] = []
    prompt = random_ids(torch.Generator().manual_seed(10), 4)
    raw = decode(make_target(), prompt, 1.0, 4, 8, seed=2, observer=records.append)
    assert len(records) == raw.stats.rule_steps == 8
    assert [(r.block_index, r.step_index) for r in records] == [(b, s) for b in range(2) for s in range(4)]
    for record in records:
        changed = record.state != record.next_state
        assert changed.sum() == 1
        assert (record.state[changed] == 2).all()


def test_drafters_read_the_prefix_and_one_memo_per_block(make_target: MakeTarget) -> None:
    contexts: list[DraftContext] = []

    class Recording(NoDrafter):
        def propose(self, context: DraftContext) -> DraftTree:
            contexts.append(context)
            return super().propose(context)

    prompt = random_ids(torch.Generator().manual_seed(12), 5)
    settings = DecodeSettings(CommitRule(temperature=1.0), 4, 12, stop_at_eos=False)
    raw = decode_ids(make_target(), prompt, settings, Recording(), NoiseKey(seed=3, request=0))
    assert len(contexts) == 3 * 3  # the last commit of a block needs no draft
    memos = [c.block_memo for c in contexts]
    for block in range(3):
        rounds = contexts[3 * block : 3 * block + 3]
        assert {c.block_index for c in rounds} == {block}
        assert all(memo is memos[3 * block] for memo in memos[3 * block : 3 * block + 3])
        assert all(torch.equal(c.prefix, torch.cat([prompt, raw.token_ids[: 4 * block]])) for c in rounds)
    assert memos[0] is not memos[3] and memos[3] is not memos[6]


class EosTarget:
    """Wraps a target so that EOS has by far the largest logit at block position 1."""

    def __init__(self, inner: BuiltinTarget) -> None:
        self.inner = inner
        self.name, self.vocab_size, self.mask_id = inner.name, inner.vocab_size, inner.mask_id
        self.eos_id, self.max_length, self.counter = inner.eos_id, inner.max_length, inner.counter
        self.device = inner.device

    def prefill(self, prompt_ids: torch.Tensor) -> PrefixCache:
        return self.inner.prefill(prompt_ids)

    def score(self, cache: PrefixCache, blocks: torch.Tensor, finished: torch.Tensor | None = None) -> ScoreResult:
        result = self.inner.score(cache, blocks, finished)
        logits = result.logits.clone()
        logits[:, 1, self.eos_id] = 100.0
        return ScoreResult(logits=logits, cache=result.cache)

    def write(self, cache: PrefixCache, finished: torch.Tensor) -> PrefixCache:
        return self.inner.write(cache, finished)


def test_decoding_stops_after_block_with_eos(make_target: MakeTarget) -> None:
    target = EosTarget(make_target())
    prompt = random_ids(torch.Generator().manual_seed(11), 4)
    raw = decode(target, prompt, 1.0, 4, 16, seed=0, stop_at_eos=True)
    assert raw.token_ids.shape == (4,)
    assert raw.token_ids[1].item() == target.eos_id
    assert raw.stats.target_passes == 4
    full = decode(EosTarget(make_target()), prompt, 1.0, 4, 16, seed=0, stop_at_eos=False)
    assert full.token_ids.shape == (16,)
    assert torch.equal(full.token_ids[:4], raw.token_ids)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_decoding_on_cuda_matches_cpu(model_factory: Callable[..., BlockDiffusionLM]) -> None:
    """The decoding loop runs with the target on a GPU (the commit trace must live on the target's device)."""
    model = model_factory()
    prompt = random_ids(torch.Generator().manual_seed(12), 5)
    cpu = decode(BuiltinTarget(model=model), prompt, 1.0, 4, 8, seed=0)
    gpu = decode(BuiltinTarget(model=model_factory().to("cuda")), prompt, 1.0, 4, 8, seed=0)
    assert torch.equal(gpu.token_ids.cpu(), cpu.token_ids)
    assert torch.equal(gpu.commit_step.cpu(), cpu.commit_step)
