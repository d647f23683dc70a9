"""``spot-dlm verify-cost``: what one verification pass over K draft nodes costs, relative to one plain pass.

SPOT trades passes for wider passes. Whether fewer passes mean more tokens/s depends on how the cost of scoring
K candidate blocks grows with K on the hardware at hand: on a 2-core CPU it grows almost linearly; on a GPU a
large target is bound by reading its weights, so K blocks cost about what one does until the batch fills the chip.
This measures that curve for the built-in target and for randomly initialised models of the same architecture at
larger shapes (the cost of a pass does not depend on the weights' values), at a given prefix length and block
length, with the prefix cache built as decoding builds it.
"""

from __future__ import annotations

import re
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from spot_dlm.bench.plots import save_figure
from spot_dlm.models.builtin import BuiltinTarget
from spot_dlm.models.transformer import BlockDiffusionLM, ModelConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_SHAPE = re.compile(r"^d(\d+)-l(\d+)-h(\d+)-v(\d+)(?:-m(\d+))?$")


def parse_shape(text: str) -> ModelConfig | None:
    """'builtin' -> None (the shipped checkpoint); 'dD-lN-hH-vV[-mM]' -> a config of width D, N layers, H heads,
    vocabulary V and MLP ratio M (default 4), e.g. d4096-l36-h32-v151936-m3 (about SDAR-8B's size)."""
    if text == "builtin":
        return None
    match = _SHAPE.match(text)
    if match is None:
        raise ValueError(f"unknown model shape {text!r}: use 'builtin' or dD-lN-hH-vV[-mM], e.g. d1024-l24-h16-v32768")
    d_model, n_layers, n_heads, vocab, mlp = (int(g) if g else None for g in match.groups())
    return ModelConfig(vocab_size=vocab, d_model=d_model, n_layers=n_layers, n_heads=n_heads, mlp_ratio=mlp or 4)


@dataclass(frozen=True)
class VerifyCostConfig:
    shapes: tuple[str, ...] = ("builtin",)
    nodes: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    prefix_length: int = 256
    block_length: int = 32
    repeats: int = 10
    device: str = "cpu"
    dtype: str = "float32"
    scoring: str = "batched"

    def __post_init__(self) -> None:
        for shape in self.shapes:
            parse_shape(shape)
        if not self.nodes or min(self.nodes) < 1:
            raise ValueError("node counts must be >= 1")
        if self.prefix_length < 1 or self.block_length < 1 or self.repeats < 1:
            raise ValueError("prefix length, block length and repeats must be >= 1")
        if self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; choose one of {', '.join(DTYPES)}")


def build_target(shape: str, config: VerifyCostConfig, device: torch.device) -> BuiltinTarget:
    """The shipped target, or a random one of the given shape built directly on ``device``."""
    from spot_dlm.models.builtin import load_builtin_target

    dtype = DTYPES[config.dtype]
    model_config = parse_shape(shape)
    if model_config is None:
        return load_builtin_target(scoring=config.scoring, dtype=dtype, device=device)[0]
    needed = config.prefix_length + config.block_length
    model_config = ModelConfig(**{**asdict(model_config), "max_seq_len": max(needed, 1024)})
    torch.manual_seed(0)
    with torch.device(device):
        model = BlockDiffusionLM(model_config).to(dtype).eval()
    return BuiltinTarget(model=model, scoring=config.scoring, name=shape)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_score(target: BuiltinTarget, cache, n_nodes: int, block_length: int, repeats: int) -> list[float]:
    """Seconds per ``score`` of n_nodes half-masked candidate blocks, one warm-up call first."""
    device = target.device
    generator = torch.Generator().manual_seed(n_nodes)
    blocks = torch.randint(3, target.vocab_size, (n_nodes, block_length), generator=generator)
    blocks[:, block_length // 2 :] = target.mask_id
    blocks = blocks.to(device)
    target.score(cache, blocks)
    times = []
    for _ in range(repeats):
        _synchronize(device)
        start = time.perf_counter()
        target.score(cache, blocks)
        _synchronize(device)
        times.append(time.perf_counter() - start)
    return times


def measure_verify_cost(config: VerifyCostConfig, progress: bool = True) -> dict:
    """Median milliseconds per verification pass for every shape x node count, and the ratio to one node."""
    from spot_dlm.api import resolve_device
    from spot_dlm.bench.output import machine_description

    device = resolve_device(config.device)
    rows = []
    bar = tqdm(total=len(config.shapes) * len(config.nodes), desc="verify cost", disable=not progress)
    for shape in config.shapes:
        target = build_target(shape, config, device)
        generator = torch.Generator().manual_seed(0)
        prompt = torch.randint(3, target.vocab_size, (config.prefix_length,), generator=generator)  # [P]
        cache = target.prefill(prompt)
        per_node = {}
        for n_nodes in config.nodes:
            times = time_score(target, cache, n_nodes, config.block_length, config.repeats)
            per_node[n_nodes] = 1000 * statistics.median(times)
            bar.update(1)
        base = per_node.get(1)
        for n_nodes, ms in per_node.items():
            rows.append(
                {
                    "shape": shape,
                    "parameters": target.model.num_parameters(),
                    "nodes": n_nodes,
                    "ms_per_pass": ms,
                    "cost_vs_one_node": ms / base if base else None,
                }
            )
        del target, cache
        if device.type == "cuda":
            torch.cuda.empty_cache()
    bar.close()
    return {"config": asdict(config), "machine": machine_description(device), "results": rows}


def format_verify_table(report: dict) -> str:
    header = f"{'shape':<28}{'params':>9}{'nodes':>7}{'ms/pass':>10}{'x one node':>12}"
    lines = [header, "-" * len(header)]
    for r in report["results"]:
        ratio = "-" if r["cost_vs_one_node"] is None else f"{r['cost_vs_one_node']:.2f}"
        lines.append(
            f"{r['shape']:<28}{r['parameters'] / 1e6:>8.1f}M{r['nodes']:>7}{r['ms_per_pass']:>10.2f}{ratio:>12}"
        )
    return "\n".join(lines)


def plot_verify_cost(report: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for shape in dict.fromkeys(r["shape"] for r in report["results"]):
        rows = [r for r in report["results"] if r["shape"] == shape and r["cost_vs_one_node"] is not None]
        if rows:
            label = f"{shape} ({rows[0]['parameters'] / 1e6:.0f}M)"
            ax.plot([r["nodes"] for r in rows], [r["cost_vs_one_node"] for r in rows], marker="o", label=label)
    nodes = sorted({r["nodes"] for r in report["results"]})
    ax.plot(nodes, nodes, color="grey", linestyle=":", label="linear (K passes)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("draft nodes scored in one pass (K)")
    ax.set_ylabel("pass time / one-node pass time")
    ax.set_title(f"Verification cost, {report['machine'].split('decoding on ')[-1]}", fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(True, which="both", alpha=0.3)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return save_figure(fig, path, dpi=120)
