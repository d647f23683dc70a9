"""The main job: decode one held-out question on the built-in target and show how the block was filled."""

from __future__ import annotations

import json
from pathlib import Path

from spot_dlm.api import GenerateConfig, Generation, generate, load_target
from spot_dlm.models.checkpoint import load_training_state

DEMO_QUESTION = (
    "A baker makes 24 muffins in the morning and 18 muffins in the afternoon. "
    "She sells 30 muffins. How many muffins does she have left?"
)


def commit_order_grid(generation: Generation, block_length: int) -> list[list[int]]:
    """Rule step at which each position was committed, one row per block (-1: not decoded)."""
    steps = generation.commit_step
    return [steps[i : i + block_length] for i in range(0, len(steps), block_length)]


def render_grid(grid: list[list[int]]) -> str:
    """Terminal picture: each cell is the step (inside its block) that filled the position."""
    width = len(str(max(max(row) for row in grid)))
    header = "block | position 0 → " + str(len(grid[0]) - 1)
    lines = [header]
    for index, row in enumerate(grid):
        lines.append(f"{index:5d} | " + " ".join(f"{s:>{width}d}" for s in row))
    return "\n".join(lines)


def plot_commit_order(generations: list[Generation], block_length: int, path: Path, tokens_text) -> Path:
    """PNG heat map per method: blocks x positions coloured by commit step, annotated with the tokens."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(generations), 1, figsize=(max(8, block_length * 0.45), 1.2 + 2.2 * len(generations)))
    axes = [axes] if len(generations) == 1 else list(axes)
    for ax, gen in zip(axes, generations):
        grid = commit_order_grid(gen, block_length)
        image = ax.imshow(grid, cmap="viridis", aspect="auto", vmin=0, vmax=block_length - 1)
        for b, row in enumerate(grid):
            for j, _ in enumerate(row):
                token = tokens_text(gen.raw_token_ids[b * block_length + j])
                ax.text(j, b, token[:4], ha="center", va="center", fontsize=6, color="white")
        ax.set_title(f"{gen.method}: commit step per position ({gen.target_passes} target passes)")
        ax.set_xlabel("position in block")
        ax.set_ylabel("block")
        ax.set_yticks(range(len(grid)))
        fig.colorbar(image, ax=ax, label="commit step")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def run_demo(
    model: str | None,
    methods: list[str],
    block_length: int,
    gen_length: int,
    temperature: float,
    seed: int,
    plot_path: Path | None,
    device: str = "cpu",
    budget: int = 16,
) -> None:
    folder = Path(model) if model not in (None, "builtin") else _builtin_folder()
    if not (folder / "model.safetensors").is_file() and model in (None, "builtin"):
        target, codec = _random_builtin(folder)
        print("NOTE: no trained built-in checkpoint is shipped yet: this demo runs a RANDOMLY INITIALISED model.")
    else:
        target, codec = load_target(model, device=device)
    state = load_training_state(folder)
    if not state:
        print("NOTE: this checkpoint carries no training record; outputs may come from an untrained model.")
    else:
        print(
            f"target: {target.name}, {target.model.num_parameters() / 1e6:.2f}M parameters, "
            f"trained: {json.dumps(state.get('tokens_seen', {}))} tokens (ar = autoregressive, bd = block diffusion)"
        )
    generations = []
    from spot_dlm.api import DRAFTER_FACTORIES

    for method in list(methods):
        if method in DRAFTER_FACTORIES and not _drafter_available(method, target):
            print(f"NOTE: skipping {method}: no drafter is shipped for it yet")
            methods.remove(method)
    for method in methods:
        config = GenerateConfig(
            method=method,
            block_length=block_length,
            gen_length=gen_length,
            temperature=temperature,
            seed=seed,
            budget=budget,
        )
        generations.append(generate([DEMO_QUESTION], config, target, codec)[0])
    print(f"\nQuestion: {DEMO_QUESTION}\n")
    for gen in generations:
        s = gen.stats
        print(f"--- {gen.method} (block {block_length}, T={temperature}) ---")
        print(gen.text)
        print(
            f"[{len(gen.token_ids)} tokens, {s['target_passes']} target passes, {s['query_tokens']} query tokens, "
            f"{s['committed_tokens'] / max(s['target_passes'], 1):.2f} commits/pass, {s['wall_seconds']:.2f} s]"
        )
        print("commit order (the step inside each block at which a position was filled):")
        print(render_grid(commit_order_grid(gen, block_length)))
        print()
    if len(generations) > 1:
        same = all(g.raw_token_ids == generations[0].raw_token_ids for g in generations)
        print(f"all methods produced identical tokens: {same}")
    if plot_path is not None:
        plot_commit_order(generations, block_length, plot_path, lambda i: codec.decode([i]).strip() or "·")
        print(f"commit-order picture: {plot_path}")


def _drafter_available(method: str, target) -> bool:
    from spot_dlm.api import make_drafter

    try:
        make_drafter(GenerateConfig(method=method), target)
    except (FileNotFoundError, ValueError):
        return False
    return True


def _random_builtin(folder: Path):
    import torch

    from spot_dlm.models.builtin import BuiltinTarget
    from spot_dlm.models.tokenizer import TextCodec
    from spot_dlm.models.transformer import BlockDiffusionLM, ModelConfig

    codec = TextCodec.from_file(folder / "tokenizer.json")
    torch.manual_seed(0)
    model = BlockDiffusionLM(ModelConfig(vocab_size=codec.vocab_size)).eval()
    return BuiltinTarget(model=model, name="builtin-random-init"), codec


def _builtin_folder() -> Path:
    from spot_dlm.models.builtin import builtin_dir

    return builtin_dir()
