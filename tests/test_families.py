"""Real DLM families without a model: detection from config.json, the authors' canvases and their commit rules."""

from __future__ import annotations

import pytest
import torch

from spot_dlm.decode import DecodeSettings, _check_passes
from spot_dlm.family_rules import (
    DreamRule,
    FamilyDecoding,
    FastDllmV2Rule,
    LladaRule,
    MaskTokenChosen,
    SdarRule,
    Window,
    dream_commits,
    dream_timesteps,
    linear_schedule,
    make_family_rule,
)
from spot_dlm.models.families import FAMILIES, UnknownFamily, detect_family, id_list
from spot_dlm.models.family_targets import plan_canvas
from spot_dlm.rules import CommitRule

MASK = 5


@pytest.mark.parametrize(
    ("config", "family"),
    [
        ({"model_type": "sdar", "architectures": ["SDARForCausalLM"]}, "sdar"),
        ({"model_type": "trado", "architectures": ["TraDoForCausalLM"]}, "sdar"),
        ({"model_type": "llada", "architectures": ["LLaDAModelLM"]}, "llada"),
        ({"model_type": "Dream", "architectures": ["DreamModel"]}, "dream"),
        ({"model_type": "Fast_dLLM_Qwen", "architectures": ["Fast_dLLM_QwenForCausalLM"]}, "fast_dllm_v2"),
        ({"model_type": "qwen2", "auto_map": {"AutoModelForCausalLM": "modeling.Fast_dLLM_QwenForCausalLM"}}, None),
        ({"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]}, "generic"),
        ({"model_type": "llama"}, "generic"),
    ],
)
def test_families_are_detected_from_config(config: dict, family: str | None) -> None:
    expected = family or "fast_dllm_v2"  # named by its auto_map alone
    assert detect_family(config).name == expected


def test_an_unknown_family_is_a_clear_error_that_lists_the_families() -> None:
    with pytest.raises(UnknownFamily, match="SDAR.*LLaDA.*Dream.*Fast-dLLM v2.*--family generic"):
        detect_family({"model_type": "mystery", "auto_map": {"AutoModel": "modeling_mystery.Model"}})
    with pytest.raises(UnknownFamily, match="choose one of"):
        detect_family({}, declared="gpt")
    assert detect_family({"model_type": "mystery"}, declared="generic").name == "generic"


def test_id_lists() -> None:
    assert id_list([151645, 151643]) == (151645, 151643) and id_list(7) == (7,) and id_list(None) == ()


@pytest.mark.parametrize(("prompt", "gen", "first", "n_blocks", "canvas"), [(10, 8, 8, 3, 20), (8, 8, 8, 2, 16)])
def test_block_causal_families_anchor_blocks_at_zero(prompt, gen, first, n_blocks, canvas) -> None:
    plan = plan_canvas(FAMILIES["sdar"], prompt, gen, 4)
    assert (plan.first_start, plan.n_blocks, plan.canvas_length) == (first, n_blocks, canvas)
    assert plan.tail == prompt - first and plan.canvas_length >= prompt + gen


def test_llada_blocks_start_after_the_prompt_and_dream_is_one_block() -> None:
    plan = plan_canvas(FAMILIES["llada"], 10, 8, 4)
    assert (plan.first_start, plan.n_blocks, plan.canvas_length, plan.tail) == (10, 2, 18, 0)
    with pytest.raises(ValueError, match="multiple of block length"):
        plan_canvas(FAMILIES["llada"], 10, 10, 4)
    dream = plan_canvas(FAMILIES["dream"], 10, 12, 4)
    assert (dream.block_length, dream.n_blocks, dream.canvas_length) == (12, 1, 22)


def test_linear_schedule_spreads_the_remainder_first() -> None:
    assert linear_schedule(10, 4) == (3, 3, 2, 2)
    assert linear_schedule(4, 4) == (1, 1, 1, 1)
    assert linear_schedule(3, 5) == (1, 1, 1, 0, 0)  # LLaDA: passes with a quota of 0 still run


def test_dream_schedule_commits_nothing_first_and_two_last() -> None:
    steps = 32
    timesteps = dream_timesteps(steps)
    counts, masks = [], steps
    for i in range(steps):
        n = dream_commits(masks, i, timesteps)
        counts.append(n)
        masks -= n
    assert counts == [0] + [1] * 30 + [2] and masks == 0
    assert dream_commits(1, 32, timesteps) == 0  # past the last pass (drafted states only)


def _logits(rows: list[list[list[float]]], dtype=torch.float32) -> torch.Tensor:
    return torch.tensor(rows, dtype=dtype)


def test_sdar_commits_by_topk_with_the_pass_schedule() -> None:
    tokens = torch.tensor([[1, MASK, MASK, MASK]])
    logits = torch.zeros(1, 4, 8)
    logits[0, 1, 2] = 3.0  # confident
    logits[0, 2, 3] = 1.0
    logits[0, 3, 4] = 5.0  # most confident
    rule = SdarRule(MASK, schedule=(2, 1, 1))
    result = rule.step(tokens, logits, None, (0,))
    assert result.tokens.tolist() == [[1, 2, MASK, 4]]  # two commits at pass 0
    result = rule.step(tokens, logits, None, (1,))
    assert result.tokens.tolist() == [[1, MASK, MASK, 4]]  # one at pass 1
    dynamic = SdarRule(MASK, schedule=(1, 1, 1), threshold=0.05)
    assert dynamic.step(tokens, logits, None, (0,)).committed.sum() == 3  # all above the threshold


def test_family_rules_keep_the_mask_token_in_the_softmax() -> None:
    tokens = torch.tensor([[MASK, MASK]])
    logits = torch.zeros(1, 2, 8)
    logits[0, 0, 1] = 4.0
    logits[0, 1, 2] = 4.0
    logits[0, 1, MASK] = 3.9  # the mask token takes probability from position 1 only
    result = LladaRule(MASK, schedule=(1, 1)).step(tokens, logits, None, (0,))
    assert result.tokens.tolist() == [[1, MASK]]
    assert result.proposal.confidence[0, 0] > result.proposal.confidence[0, 1]


def test_a_committed_mask_token_stays_masked_and_a_block_left_masked_is_refused() -> None:
    tokens = torch.tensor([[MASK, 1]])
    logits = torch.zeros(1, 2, 8)
    logits[0, 0, MASK] = 9.0
    rule = LladaRule(MASK, schedule=(1,))
    result = rule.step(tokens, logits, None, (0,))
    assert result.tokens.tolist() == [[MASK, 1]] and bool(result.committed[0, 0])  # as the authors' loop writes it
    assert not rule.step(tokens, logits, None, (1,)).committed.any()  # past the schedule: nothing (drafted states)
    settings = DecodeSettings(CommitRule(), 2, 2, family_rule=rule)
    with pytest.raises(MaskTokenChosen, match="not reproduced"):
        _check_passes(settings, 1, 2)


def test_llada_ranks_over_the_whole_canvas_row() -> None:
    tokens = torch.tensor([[MASK, MASK, MASK]])
    logits = torch.zeros(1, 3, 8)
    logits[0, :, 1] = 2.0  # three equal confidences: torch.topk over the canvas row decides
    rule = LladaRule(MASK, schedule=(1, 1, 1))
    committed = rule.step(tokens, logits, None, (0,), Window(offset=7, width=20)).committed
    row = torch.full((1, 20), float("-inf"))
    row[0, 7:10] = torch.softmax(logits[0], -1)[:, 1]
    assert committed.nonzero()[:, 1].tolist() == [int(torch.topk(row, 1).indices[0, 0]) - 7]


def test_fast_dllm_v2_decodes_sub_blocks_left_to_right() -> None:
    tokens = torch.tensor([[1] + [MASK] * 15])
    logits = torch.zeros(1, 16, 8)
    logits[0, 12, 3] = 9.0  # the most confident position is in the second sub-block: not eligible yet
    logits[0, 5, 2] = 2.0
    result = FastDllmV2Rule(MASK, sub_block=8).step(tokens, logits, None, (0,))
    assert result.committed.nonzero()[:, 1].tolist() == [5]
    threshold = FastDllmV2Rule(MASK, threshold=0.0, sub_block=8).step(tokens, logits, None, (0,))
    assert threshold.committed.nonzero()[:, 1].tolist() == list(range(1, 8))  # every eligible one above 0


def test_dream_takes_the_argmax_of_probabilities() -> None:
    tokens = torch.tensor([[MASK, MASK]])
    logits = torch.zeros(1, 2, 8, dtype=torch.bfloat16)
    logits[0, 0, 3] = 30.0
    logits[0, 0, 4] = 30.25  # in bf16 both probabilities round to the same value: max takes the first
    logits[0, 1, 2] = 1.0
    rule = DreamRule(MASK, steps=2, confidence="maskgit_plus")
    result = rule.step(tokens, logits, None, (1,))  # the last pass commits everything left
    probs = torch.softmax(logits[0, 0], -1)
    assert result.tokens[0, 0] == probs.max(-1).indices
    assert result.committed.all()


def test_every_family_rule_samples_from_keyed_noise_at_positive_temperature() -> None:
    tokens = torch.tensor([[MASK, MASK, 1]])
    logits = torch.randn(1, 3, 8, generator=torch.Generator().manual_seed(0))
    gumbel = -torch.log(
        -torch.log(torch.rand(1, 3, 8, generator=torch.Generator().manual_seed(1), dtype=torch.float64))
    )
    rules = [
        SdarRule(MASK, (1, 1), temperature=0.7),
        LladaRule(MASK, (1, 1), temperature=0.7),
        DreamRule(MASK, steps=2, temperature=0.7),
        FastDllmV2Rule(MASK, temperature=0.7),
    ]
    for rule in rules:
        first = rule.step(tokens, logits, gumbel, (1,))
        again = rule.step(tokens, logits, gumbel, (1,))
        assert torch.equal(first.tokens, again.tokens) and first.committed.any()
        with pytest.raises(ValueError, match="noise"):
            rule.step(tokens, logits, None, (1,))


def test_families_refuse_rules_their_authors_do_not_ship() -> None:
    spec = {"mask_id": MASK, "temperature": 0.0, "block_length": 4, "gen_length": 8}
    with pytest.raises(ValueError, match="no threshold rule"):
        make_family_rule(FamilyDecoding("sdar", "threshold", **spec))
    with pytest.raises(ValueError, match="multiple of steps"):
        make_family_rule(FamilyDecoding("sdar", "one", steps=3, **spec))
    with pytest.raises(ValueError, match="multiple of the blocks"):
        make_family_rule(FamilyDecoding("llada", "one", steps=3, **spec))
    assert isinstance(make_family_rule(FamilyDecoding("fast_dllm_v2", "threshold", **spec)), FastDllmV2Rule)
