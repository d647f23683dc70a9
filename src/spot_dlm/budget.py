"""``budget auto``: the draft-tree budget that decodes fastest here, for this target.

Fewer passes are not faster when drafting and scoring more nodes costs more than the passes saved: on a small
target on a CPU one extra node costs nearly as much as a pass. ``spot-dlm calibrate`` measures it: it decodes a few
held-out questions with standard decoding and with SPOT at each candidate budget, interleaved in one process, and
keeps the budget with the most tokens per second per temperature kind (greedy, sampled). The choice is cached per
(device, target) in the user cache folder (``$SPOT_DLM_CACHE``, else ``~/.cache/spot-dlm``). Without a measurement
the budget is the prior: the one measured fastest for the built-in target on that kind of device
(``docs/results.md``: budget 2 on a 2-core CPU and on an H200).
"""

from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import torch

CANDIDATES = (2, 3, 4, 8, 16)
PRIOR = {"cpu": 2, "cuda": 2}
CACHE_ENV = "SPOT_DLM_CACHE"
CACHE_FILE = "budget_auto.json"


@dataclass(frozen=True)
class BudgetChoice:
    budget: int
    reason: str  # "measured" or "prior"
    device: str
    target: str

    def describe(self) -> str:
        source = "measured here" if self.reason == "measured" else "prior; spot-dlm calibrate measures this machine"
        return f"budget auto -> {self.budget} ({self.device}, {self.target}; {source})"


def cache_path() -> Path:
    root = os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "spot-dlm"
    return Path(root) / CACHE_FILE


def device_name(target) -> str:
    """The device decoding runs on, as cost depends on it: the GPU's name, else the CPU and its core count."""
    device = getattr(target, "device", torch.device("cpu"))
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu {platform.machine()} x{os.cpu_count()} threads {torch.get_num_threads()}"


def target_name(target) -> str:
    """The target's identity for the cache: its name, vocabulary and parameter count."""
    model = getattr(target, "model", None)
    parameters = sum(p.numel() for p in model.parameters()) if model is not None else 0
    return f"{getattr(target, 'name', 'target')} v{target.vocab_size} p{parameters}"


def temperature_kind(temperature: float) -> str:
    return "greedy" if temperature == 0 else "sampled"


def _read_cache() -> dict:
    path = cache_path()
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return {}  # an unreadable cache is measured again, not an error
    return value if isinstance(value, dict) else {}


def _cache_key(target) -> str:
    return f"{device_name(target)} | {target_name(target)}"


def choose_budget(target, temperature: float) -> BudgetChoice:
    """The cached measurement for this device and target, else the device kind's prior."""
    device_type = getattr(target, "device", torch.device("cpu")).type
    measured = _read_cache().get(_cache_key(target), {}).get(temperature_kind(temperature))
    target_label = getattr(target, "name", "target")
    if isinstance(measured, dict) and measured.get("budget") in CANDIDATES:
        return BudgetChoice(int(measured["budget"]), "measured", device_type, target_label)
    return BudgetChoice(PRIOR.get(device_type, PRIOR["cpu"]), "prior", device_type, target_label)


def store_measurement(target, temperature: float, table: dict[int, float]) -> int:
    """Cache the fastest budget of ``table`` (budget -> tokens/s ratio to standard) for this device and target;
    written to a temporary file and renamed, so an interrupted write leaves the old cache whole."""
    best = max(table, key=table.get)
    cache = _read_cache()
    entry = cache.setdefault(_cache_key(target), {})
    entry[temperature_kind(temperature)] = {
        "budget": best,
        "tokens_per_second_ratio": {str(b): round(r, 4) for b, r in sorted(table.items())},
        "measured_at": time.strftime("%Y-%m-%d %H:%M"),
    }
    path = cache_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(cache, indent=2) + "\n")
    partial.replace(path)
    return best


def calibrate(
    target,
    codec,
    prompts: list[str],
    temperature: float,
    gen_length: int = 64,
    candidates: tuple[int, ...] = CANDIDATES,
    progress=None,
) -> dict[int, float]:
    """Tokens/s of SPOT at each candidate budget as a ratio to standard decoding's, measured interleaved (prompt
    by prompt, every setting in turn, after a warm-up); the fastest is cached. -> {budget: ratio}"""
    from spot_dlm.api import GenerateConfig, generate

    if not prompts:
        raise ValueError("calibration needs at least one prompt")
    if any(b < 1 for b in candidates) or not candidates:
        raise ValueError(f"candidate budgets must be >= 1, got {candidates}")
    settings = {None: GenerateConfig(method="standard", gen_length=gen_length, temperature=temperature)}
    settings.update(
        {
            b: GenerateConfig(method="spot", gen_length=gen_length, temperature=temperature, budget=b)
            for b in candidates
        }
    )
    tokens = dict.fromkeys(settings, 0)
    seconds = dict.fromkeys(settings, 0.0)
    for config in settings.values():
        generate(prompts[:1], config, target, codec)  # warm-up: kernels, drafter loading
    for index, prompt in enumerate(prompts):
        for budget, config in settings.items():
            (out,) = generate([prompt], config, target, codec, first_request=index)
            tokens[budget] += len(out.raw_token_ids)
            seconds[budget] += out.stats["wall_seconds"]
        if progress is not None:
            progress(index + 1, len(prompts))
    rate = {budget: tokens[budget] / seconds[budget] for budget in settings if seconds[budget] > 0}
    table = {b: rate[b] / rate[None] for b in candidates}
    store_measurement(target, temperature, table)
    return table
