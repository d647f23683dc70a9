"""Real DLM families end to end, on stand-in checkpoints saved and loaded like the real ones.

The oracle is ``tests/reference_loops.py``: plain transcriptions of each authors' loop (one state per forward, their
numerics), written apart from the adapter. Our ``standard`` must equal it token for token at T = 0 in float32; every
speculative method must equal our ``standard`` at T in {0, 0.7, 1}; and the interface mistakes the generic adapter
makes on these families are shown failing there.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from reference_loops import (  # noqa: E402
    dream_generate,
    fast_dllm_v1_llada_generate,
    fast_dllm_v2_generate,
    llada_generate,
    sdar_generate,
)
from spot_dlm.api import GenerateConfig, generate, load_target, settings_for  # noqa: E402
from spot_dlm.cli import main  # noqa: E402
from spot_dlm.decode import NoDrafter, decode_ids  # noqa: E402
from spot_dlm.models.family_targets import FamilyTarget  # noqa: E402
from spot_dlm.models.hf import HFTarget, additive_mask, load_hf_target  # noqa: E402
from spot_dlm.noise import NoiseKey  # noqa: E402
from spot_dlm.standins import build_standin  # noqa: E402

REMOTE = {"trust_remote_code": True}
GEN = {"sdar": 12, "llada": 16, "dream": 12, "fast_dllm_v2": 64}
# prompt lengths: a multiple of the block and not (SDAR 4, LLaDA 8, v2 32), short and long
PROMPT_LENGTHS = {"sdar": (5, 8, 3), "llada": (5, 8), "dream": (5, 7), "fast_dllm_v2": (20, 40, 64)}


pytestmark = pytest.mark.usefixtures("remote_code_cache")


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, dict[str, Path]]:
    root = tmp_path_factory.mktemp("families")
    built = {}
    for family in GEN:
        built[family] = {
            dtype: build_standin(
                family, root / f"{family}-{dtype}", seed=1, dtype=getattr(torch, dtype), weight_scale=1.5
            )
            for dtype in ("float32", "float64")
        }
    return built


def _prompt(target, length: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(100, 600, (length,), generator=generator)  # ordinary tokens of the stand-in vocabularies


def _ours(target, prompt: torch.Tensor, config: GenerateConfig, key: NoiseKey | None = None):
    settings = settings_for(config, target)
    return decode_ids(target, prompt, settings, NoDrafter(), key or NoiseKey(0, 0))


def _reference(family: str, target: FamilyTarget, prompt: torch.Tensor, gen: int) -> tuple[list[int], int]:
    model, ids, mask = target.model, prompt.tolist(), target.mask_id
    if family == "sdar":
        return sdar_generate(model, ids, gen, 4, 4, mask, list(target.stop_ids))
    if family == "llada":
        return llada_generate(model, ids, gen, 8, gen, mask)
    if family == "dream":
        return dream_generate(model, ids, gen, gen, mask)
    return fast_dllm_v2_generate(model, ids, gen, mask, target.stop_ids[0])


def _config(family: str, gen_length: int | None = None, **kwargs) -> GenerateConfig:
    block = {"llada": 8}.get(family)
    return GenerateConfig(gen_length=gen_length or GEN[family], block_length=block, **kwargs)


@pytest.mark.parametrize("family", list(GEN))
def test_standard_is_the_authors_loop_token_for_token(family: str, folders) -> None:
    target, _ = load_target(folders[family]["float32"], hf_options=REMOTE)
    assert isinstance(target, FamilyTarget) and target.family.name == family
    for seed, length in enumerate(PROMPT_LENGTHS[family]):
        prompt = _prompt(target, length, seed)
        expected, forwards = _reference(family, target, prompt, GEN[family])
        raw = _ours(target, prompt, _config(family))
        assert raw.token_ids.tolist() == expected
        assert raw.stats.target_passes == forwards  # prefill, finish and store passes counted as the authors do


@pytest.mark.parametrize("family", ["sdar", "fast_dllm_v2"])
def test_stopping_is_the_authors(family: str, folders) -> None:
    """A stop token ends decoding after its block as the authors' loop ends it (a token the model does produce is
    made the stop token, the reference told the same)."""
    target, _ = load_target(folders[family]["float32"], hf_options=REMOTE)
    prompt = _prompt(target, PROMPT_LENGTHS[family][0], 7)
    free = _ours(target, prompt, _config(family, stop_at_eos=False)).token_ids.tolist()
    target.stop_ids = (free[len(free) // 3],)
    expected, forwards = _reference(family, target, prompt, GEN[family])
    raw = _ours(target, prompt, _config(family))
    assert raw.token_ids.tolist() == expected and len(expected) < len(free)
    assert raw.stats.target_passes == forwards


@pytest.mark.parametrize(
    ("family", "method"), [("sdar", "dynamic"), ("fast_dllm_v2", "threshold"), ("llada", "threshold")]
)
def test_threshold_rules_are_the_authors(family: str, method: str, folders) -> None:
    target, _ = load_target(folders[family]["float32"], hf_options=REMOTE)
    for seed, length in enumerate(PROMPT_LENGTHS[family][:2]):
        prompt = _prompt(target, length, seed)
        model, ids, mask, gen = target.model, prompt.tolist(), target.mask_id, GEN[family]
        if family == "sdar":
            expected, forwards = sdar_generate(model, ids, gen, 4, 4, mask, list(target.stop_ids), threshold=0.5)
        elif family == "llada":
            expected, forwards = fast_dllm_v1_llada_generate(model, ids, gen, 8, mask, threshold=0.5)
        else:
            expected, forwards = fast_dllm_v2_generate(model, ids, gen, mask, target.stop_ids[0], threshold=0.5)
        raw = _ours(target, prompt, _config(family, method=method, tau=0.5))
        assert raw.token_ids.tolist() == expected and raw.stats.target_passes == forwards
        assert raw.stats.committed_tokens > raw.stats.rule_steps  # some passes committed several positions


SPECULATIVE = ("spot", "stale", "chain", "calibrated")
SPECULATIVE_GEN = {"fast_dllm_v2": 32}  # one block and the store pass's token: every pass scores 32 x 152k logits


@pytest.mark.parametrize("family", list(GEN))
@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.0])
def test_speculative_methods_equal_the_family_standard(family: str, temperature: float, folders) -> None:
    target, codec = load_target(folders[family]["float64"], dtype=torch.float64, hf_options=REMOTE)
    prompts = ["what is 3 + 4 ?", "tom has 5 apples and buys 2 more"][: 1 if family == "fast_dllm_v2" else 2]
    base = {"temperature": temperature, "seed": 3, "apply_template": True}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the shipped drafter's token fits belong to the built-in vocabulary
        standard = generate(
            prompts, _config(family, SPECULATIVE_GEN.get(family), method="standard", **base), target, codec
        )
        accepted = handed_off = 0
        for method in SPECULATIVE:
            config = _config(family, SPECULATIVE_GEN.get(family), method=method, budget=6, **base)
            outs = generate(prompts, config, target, codec)
            for out, ref in zip(outs, standard):
                assert out.raw_token_ids == ref.raw_token_ids, method
                assert out.target_passes <= ref.target_passes
                accepted += sum(n for length, n in out.stats["accepted_lengths"].items() if int(length) > 1)
                handed_off += out.stats["handoff_blocks"]
    assert accepted > 0  # drafts were accepted: the equality was not only ever the root
    if family in ("sdar", "llada"):  # blocks opened by a hand-off (the finish pass and next first pass in one)
        assert handed_off > 0


SETS = {"sdar": ("dynamic", ("spot-sets-dynamic",)), "llada": ("threshold", ("spot-sets", "stale-sets"))}


@pytest.mark.parametrize("family", list(SETS))
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_sets_methods_equal_the_familys_threshold_loop(family: str, temperature: float, folders) -> None:
    target, codec = load_target(folders[family]["float64"], dtype=torch.float64, hf_options=REMOTE)
    rule, methods = SETS[family]
    base = {"temperature": temperature, "seed": 5, "tau": 0.5}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        (reference,) = generate(["what is 3 + 4 ?"], _config(family, method=rule, **base), target, codec)
        for method in methods:
            (out,) = generate(["what is 3 + 4 ?"], _config(family, method=method, budget=6, **base), target, codec)
            assert out.raw_token_ids == reference.raw_token_ids, method
            assert out.target_passes <= reference.target_passes


@pytest.mark.parametrize("family", ["sdar", "llada"])
def test_the_projects_float64_rule_on_a_familys_canvas_is_exact_too(family: str, folders) -> None:
    target, codec = load_target(folders[family]["float64"], dtype=torch.float64, hf_options=REMOTE)
    base = {"temperature": 0.7, "seed": 2, "numerics": "project"}
    assert settings_for(_config(family, **base), target).family_rule is None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        (reference,) = generate(["what is 3 + 4 ?"], _config(family, method="standard", **base), target, codec)
        (spot,) = generate(["what is 3 + 4 ?"], _config(family, method="spot", budget=6, **base), target, codec)
    assert spot.raw_token_ids == reference.raw_token_ids and spot.target_passes <= reference.target_passes
    assert target.mask_id not in reference.raw_token_ids


def test_an_sdar_hand_off_is_the_finish_pass_and_the_next_first_pass(folders) -> None:
    target, _ = load_target(folders["sdar"]["float64"], dtype=torch.float64, hf_options=REMOTE)
    prompt = _prompt(target, 6, 3)
    generator = torch.Generator().manual_seed(4)
    blocks = torch.randint(100, 600, (3, 4), generator=generator)
    blocks[:, ::2] = target.mask_id
    complete = torch.randint(100, 600, (2, 4), generator=generator)
    all_mask = torch.full((1, 4), target.mask_id)
    plan = target.plan(6, 8, 4)
    for m in range(2):
        cache, first = target.open(prompt, plan)
        scored = target.score_handoffs(cache, blocks, complete)
        torch.testing.assert_close(scored.logits, target.score(cache, blocks).logits)
        opened = scored.opening(m)
        apart, _ = target.open(prompt, plan)
        apart, _ = target.finish(apart, complete[m], plan)  # the authors' finish pass
        assert opened.length == apart.length == 8
        for mine, theirs in zip(opened.kv.layers, apart.kv.layers):
            torch.testing.assert_close(mine.keys, theirs.keys)
            torch.testing.assert_close(mine.values, theirs.values)
        torch.testing.assert_close(scored.next_logits[m], target.score(apart, all_mask).logits[0])


# ------------------------------------------------------------------ the generic adapter's mistakes on these families


def test_generic_adapter_inverts_sdars_mask_and_never_writes_its_cache(folders) -> None:
    folder = folders["sdar"]["float32"]
    generic, _ = load_hf_target(folder, trust_remote_code=True)
    assert isinstance(generic, HFTarget) and generic.eos_id == 151643  # the config's EOS, not <|im_end|>
    prompt = _prompt(generic, 8, 0)
    cache = generic.prefill(prompt)
    assert cache.kv.get_seq_length() == 0  # store_kv never reached the layers: the prefill is lost
    family, _ = load_target(folder, hf_options=REMOTE)
    assert family.stop_ids == (151645, 151643)
    causal = torch.ones(8, 8, dtype=torch.bool).tril()
    with torch.no_grad():
        inverted = family.model(input_ids=prompt[None], attention_mask=additive_mask(causal, torch.float32)).logits
        meant = family.model(input_ids=prompt[None], attention_mask=causal[None, None]).logits
    assert not torch.allclose(inverted, meant)  # 0 (attend) became False, the blocked minimum became True
    settings = GenerateConfig(block_length=4, gen_length=12).settings()
    with pytest.raises(RuntimeError):  # the next pass's mask counts cached keys that were never written
        decode_ids(generic, prompt, settings, NoDrafter(), NoiseKey(0, 0))


def test_generic_adapter_packs_fast_dllm_v2_candidates_that_see_each_other(folders) -> None:
    folder = folders["fast_dllm_v2"]["float64"]
    generic, _ = load_hf_target(folder, trust_remote_code=True, dtype=torch.float64)
    family, _ = load_target(folder, dtype=torch.float64, hf_options=REMOTE)
    prompt = _prompt(family, 40, 1)
    blocks = torch.randint(100, 600, (3, 32), generator=torch.Generator().manual_seed(2))
    blocks[:, 1::2] = family.mask_id
    with torch.no_grad():
        together = generic.score(generic.prefill(prompt), blocks).logits
        alone = generic.score(generic.prefill(prompt), blocks[1:2]).logits[0]
        assert not torch.allclose(together[1], alone)  # v2 ignores the mask: candidate 1 saw candidate 0
        plan = family.plan(40, 64, 32)
        cache, _ = family.open(prompt, plan)
        together = family.score(cache, blocks).logits
        for k in range(3):
            torch.testing.assert_close(together[k], family.score(cache, blocks[k : k + 1]).logits[0])


def test_generic_adapter_cannot_call_lladas_forward(folders) -> None:
    generic, _ = load_hf_target(folders["llada"]["float32"], trust_remote_code=True)
    with pytest.raises(TypeError):
        generic.prefill(torch.tensor([100, 101, 102]))  # LLaDA's forward takes no position_ids


# ------------------------------------------------------------------------------------------------- bad input


def test_pickled_weights_and_missing_remote_code_are_clear_errors(folders, tmp_path: Path, capsys) -> None:
    source = folders["sdar"]["float32"]
    for name, drop, fake in (
        ("pickled", "model.safetensors", "pytorch_model.bin"),
        ("no-code", "modeling_sdar.py", ""),
    ):
        folder = tmp_path / name
        folder.mkdir()
        for path in source.iterdir():
            if path.is_file() and path.name != drop:
                (folder / path.name).write_bytes(path.read_bytes())
        if fake:
            (folder / fake).write_bytes(b"not loaded")
        code = main(["generate", "--model", str(folder), "--trust-remote-code", "--prompt", "hi", "--gen-length", "8"])
        assert code == 2
    err = capsys.readouterr().err
    assert "pickled weights are not loaded" in err and "pytorch_model.bin" in err
    assert "lacks the SDAR / TraDo modeling code" in err and "modeling_sdar.py" in err


def test_remote_code_needs_consent_and_known_families_take_no_generic_flags(folders, capsys) -> None:
    folder = str(folders["dream"]["float32"])
    assert main(["generate", "--model", folder, "--prompt", "hi", "--gen-length", "8"]) == 2
    assert main(["generate", "--model", folder, "--trust-remote-code", "--mask-id", "3", "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert "--trust-remote-code" in err and "--mask-id are for generic models" in err


def test_block_length_and_context_checks(folders, capsys) -> None:
    target, codec = load_target(folders["sdar"]["float32"], hf_options=REMOTE)
    with pytest.warns(UserWarning, match="differs from the 4 this SDAR / TraDo checkpoint was trained with"):
        generate(["hi"], GenerateConfig(block_length=8, gen_length=8), target, codec)
    folder = str(folders["fast_dllm_v2"]["float32"])
    base = ["generate", "--model", folder, "--trust-remote-code", "--prompt", "hi"]
    assert main([*base, "--block-length", "16", "--gen-length", "32"]) == 2
    assert main([*base, "--gen-length", "4096"]) == 2
    err = capsys.readouterr().err
    assert "not defined for its loop" in err and "context" in err


def test_cli_generates_with_a_family_checkpoint(folders, capsys) -> None:
    folder = str(folders["llada"]["float32"])
    base = ["generate", "--model", folder, "--trust-remote-code", "--prompt", "what is 3 + 4?", "--gen-length", "16"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert main([*base, "--block-length", "8", "--json"]) == 0
        assert main([*base, "--block-length", "8", "--json", "--method", "spot", "--budget", "4"]) == 0
    standard, spot = (json.loads(line) for line in capsys.readouterr().out.splitlines())
    assert spot["token_ids"] == standard["token_ids"] and spot["target_passes"] <= standard["target_passes"]


def test_check_model_runs_on_a_stand_in(folders, tmp_path: Path, capsys) -> None:
    report = tmp_path / "check.json"
    args = ["check-model", str(folders["sdar"]["float32"]), "--trust-remote-code", "--dtype", "float32"]
    assert main([*args, "--n-prompts", "1", "--gen-length", "8", "--budget", "4", "--json", str(report)]) == 0
    out = capsys.readouterr().out
    assert "SPOT == standard (token for token): 1.00" in out and "flip rate" in out
    assert report.is_file()
