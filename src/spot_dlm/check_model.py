"""``spot-dlm check-model``: does this checkpoint decode exactly, and how fast, on this machine?

For a real family's checkpoint (or any transformers folder the loader accepts) it decodes a few GSM8K questions with
the family's standard loop and with SPOT in one process and reports: exact match of SPOT against the standard loop
(token for token), of the standard loop against the authors' own generate where the checkpoint ships one (Dream's
``diffusion_generate``), how often a packed or batched verification pass changes what a one-state pass proposes at
the same state (the *flip rate*: accelerator kernels need not give a row the same bits in a batch as alone), and the
passes and tokens/s ratios.

A flip means the two passes' logits differ enough to change a token or the confidence order of the masked
positions. SPOT stays exact with respect to what the loop computes, but the standard loop itself is then not batch
invariant; the remedy is batch-invariant kernels (fixed reduction order per row) or verifying in float32.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from spot_dlm.api import GenerateConfig, generate, load_target
from spot_dlm.models.family_targets import is_family_target


@dataclass
class FlipProbe:
    """Re-scores the first state of every multi-state pass alone and compares what the two passes propose there."""

    target: object
    states: int = 0
    flips: int = 0
    max_logit_gap: float = 0.0
    _busy: bool = field(default=False, repr=False)

    def __call__(self, cache, blocks: torch.Tensor, logits: torch.Tensor) -> None:
        if self._busy or blocks.shape[0] < 2:
            return
        self._busy = True
        passes, tokens = self.target.counter.snapshot()
        try:
            alone = self.target.score(cache, blocks[:1]).logits[0]  # [L, V]
        finally:
            self._busy = False
            self.target.counter.passes, self.target.counter.query_tokens = passes, tokens  # the probe is not a pass
        masked = blocks[0] == self.target.mask_id  # [L]
        packed = logits[0]
        self.states += 1
        self.max_logit_gap = max(self.max_logit_gap, float((packed - alone).abs().max()))
        if bool(masked.any()) and proposal(packed, masked) != proposal(alone, masked):
            self.flips += 1

    @property
    def rate(self) -> float:
        return self.flips / self.states if self.states else 0.0


def proposal(logits: torch.Tensor, masked: torch.Tensor) -> tuple:
    """What a pass proposes at a state: the argmax token of each masked position and the masked positions ordered
    by their softmax confidence. logits [L, V], masked bool [L]"""
    probs = torch.softmax(logits[masked].float(), dim=-1)  # [M, V]
    top = probs.max(-1)
    order = torch.sort(top.values, descending=True, stable=True).indices
    return tuple(top.indices.tolist()), tuple(order.tolist())


@dataclass(frozen=True)
class MethodRun:
    method: str
    target_passes: int
    tokens: int
    seconds: float

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def _run(method: str, prompts, config: GenerateConfig, target, codec) -> tuple[MethodRun, list[list[int]]]:
    outs = generate(prompts, config, target, codec)
    run = MethodRun(
        method,
        sum(o.stats["target_passes"] for o in outs),
        sum(len(o.raw_token_ids) for o in outs),
        sum(o.stats["wall_seconds"] for o in outs),
    )
    return run, [o.raw_token_ids for o in outs]


def authors_generate(target, prompt_ids: torch.Tensor, config: GenerateConfig) -> list[int] | None:
    """The authors' own generate where the checkpoint ships one (Dream's ``diffusion_generate``), at T = 0 with the
    standard loop's settings; None where it ships none (SDAR, LLaDA and Fast-dLLM v2 decode with scripts)."""
    model = getattr(target, "model", None)
    if not is_family_target(target) or target.family.name != "dream" or not hasattr(model, "diffusion_generate"):
        return None
    out = model.diffusion_generate(
        prompt_ids[None].to(target.device),
        max_new_tokens=config.gen_length,
        steps=config.steps or config.gen_length,
        temperature=0.0,
        alg=config.family_alg or "entropy",
        alg_temp=0.0,
        return_dict_in_generate=True,
    )
    sequences = getattr(out, "sequences", out)
    return sequences[0, prompt_ids.shape[0] :].tolist()


def check_model(
    folder: str | Path,
    device: str = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    n_prompts: int = 3,
    gen_length: int = 64,
    budget: int = 8,
    hf_options: dict | None = None,
    progress=print,
) -> dict:
    """Decode ``n_prompts`` GSM8K test questions with the standard loop and SPOT; the report as a dict."""
    from spot_dlm.api import encode_prompt
    from spot_dlm.train.data import load_gsm8k

    if n_prompts < 1 or gen_length < 1 or budget < 2:
        raise ValueError("check-model needs --n-prompts >= 1, --gen-length >= 1 and --budget >= 2")
    target, codec = load_target(folder, dtype=dtype, device=device, hf_options=hf_options)
    prompts = [item["question"] for item in load_gsm8k("test")[:n_prompts]]
    standard_config = GenerateConfig(method="standard", gen_length=gen_length)
    spot_config = GenerateConfig(method="spot", gen_length=gen_length, budget=budget)
    progress(f"check-model: {folder} as {getattr(getattr(target, 'family', None), 'title', 'a built-in target')}")
    _run("standard", prompts[:1], standard_config, target, codec)  # warm-up (kernels, caches)
    standard, standard_ids = _run("standard", prompts, standard_config, target, codec)
    spot, spot_ids = _run("spot", prompts, spot_config, target, codec)
    probe = FlipProbe(target)  # a second SPOT run, apart from the timed one: the probe's own passes take time
    if is_family_target(target):
        target.on_score = probe
        try:
            _run("spot", prompts, spot_config, target, codec)
        finally:
            target.on_score = None
    authors = [
        authors_generate(target, encode_prompt(p, codec, standard_config, target), standard_config) for p in prompts
    ]
    compared = [a for a in authors if a is not None]
    report = {
        "model": str(folder),
        "family": getattr(getattr(target, "family", None), "name", "builtin"),
        "device": str(device),
        "dtype": str(dtype).replace("torch.", ""),
        "n_prompts": n_prompts,
        "gen_length": gen_length,
        "budget": budget,
        "spot_equals_standard": sum(a == b for a, b in zip(spot_ids, standard_ids)) / n_prompts,
        "standard_equals_authors_generate": (
            sum(a == b for a, b in zip(authors, standard_ids) if a is not None) / len(compared) if compared else None
        ),
        "flip_rate": probe.rate,
        "flip_states": probe.states,
        "max_logit_gap": probe.max_logit_gap,
        "passes_ratio": standard.target_passes / spot.target_passes if spot.target_passes else 0.0,
        "tokens_per_second_ratio": (
            spot.tokens_per_second / standard.tokens_per_second if standard.tokens_per_second else 0.0
        ),
        "runs": [asdict(standard), asdict(spot)],
    }
    return report


def format_report(report: dict) -> str:
    """The report as a few lines of text."""
    authors = report["standard_equals_authors_generate"]
    lines = [
        f"family {report['family']}, {report['device']} {report['dtype']}, {report['n_prompts']} prompts, "
        f"gen length {report['gen_length']}, SPOT budget {report['budget']}",
        f"SPOT == standard (token for token): {report['spot_equals_standard']:.2f}",
        "standard == authors' generate: "
        + ("not available (the authors decode with a script)" if authors is None else f"{authors:.2f}"),
        f"flip rate (packed vs one-state pass): {report['flip_rate']:.4f} of {report['flip_states']} states, "
        f"max logit gap {report['max_logit_gap']:.3g}",
    ]
    for run in report["runs"]:
        tps = run["tokens"] / run["seconds"] if run["seconds"] else 0.0
        lines.append(
            f"  {run['method']:<9} {run['target_passes']:>6} passes  {run['seconds']:8.2f} s  {tps:8.1f} tok/s"
        )
    lines.append(
        f"passes ratio {report['passes_ratio']:.2f}x, tokens/s ratio {report['tokens_per_second_ratio']:.2f}x "
        "(standard / SPOT passes; SPOT / standard tokens/s)"
    )
    return "\n".join(lines)


def write_report(report: dict, path: str | Path) -> None:
    Path(path).write_text(json.dumps(report, indent=2) + "\n")
