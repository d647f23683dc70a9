"""The main job: decode held-out questions on the built-in target with standard decoding and SPOT, show how the
first question's blocks were filled, and compare passes and wall time over all of them."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from spot_dlm.api import GenerateConfig, Generation, generate, load_target
from spot_dlm.models.checkpoint import load_training_state

DEMO_QUESTIONS = 4  # the demo question and three GSM8K test questions: wall time over one is noise
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
    budget: int | None = None,
    n_questions: int = DEMO_QUESTIONS,
) -> None:
    """Decode the demo question and ``n_questions - 1`` GSM8K test questions with each method, interleaved; print
    the first question's generations and commit order, then every method's passes and wall time over all of them."""
    from spot_dlm.budget import choose_budget
    from spot_dlm.train.data import load_gsm8k

    folder = Path(model) if model not in (None, "builtin") else _builtin_folder()
    target, codec = load_target(model, device=device)
    state = load_training_state(folder)
    if state:
        print(
            f"target: {target.name}, {target.model.num_parameters() / 1e6:.2f}M parameters, "
            f"trained: {json.dumps(state.get('tokens_seen', {}))} tokens (ar = autoregressive, bd = block diffusion)"
        )
    if budget is None and any(m != "standard" for m in methods):
        print(choose_budget(target, temperature).describe())
    questions = [DEMO_QUESTION] + [item["question"] for item in load_gsm8k("test")[: max(n_questions - 1, 0)]]
    configs = [
        GenerateConfig(
            method=m,
            block_length=block_length,
            gen_length=gen_length,
            temperature=temperature,
            seed=seed,
            budget=budget,
        )
        for m in methods
    ]
    for config in configs:  # warm-up: kernels and drafters loaded before anything is timed
        generate([questions[0]], replace(config, gen_length=block_length), target, codec)
    runs: dict[str, list[Generation]] = {m: [] for m in methods}
    for index, question in enumerate(questions):  # interleaved: each question by every method in turn
        for config in configs:
            runs[config.method] += generate([question], config, target, codec, first_request=index)
    first = [runs[m][0] for m in methods]
    print(f"\nQuestion: {DEMO_QUESTION}\n")
    for gen in first:
        print(f"--- {gen.method} (block {block_length}, T={temperature}) ---")
        print(gen.text)
        print("commit order (the step inside each block at which a position was filled):")
        print(render_grid(commit_order_grid(gen, block_length)))
        print()
    print(summary_lines(runs, len(questions)))
    if plot_path is not None:
        plot_commit_order(first, block_length, plot_path, lambda i: codec.decode([i]).strip() or "·")
        print(f"commit-order picture: {plot_path}")


def summary_lines(runs: dict[str, list[Generation]], n_questions: int) -> str:
    """Per method: passes, tokens and wall time over all questions, as ratios to the first method's."""
    totals = {
        method: (
            sum(g.target_passes for g in gens),
            sum(len(g.raw_token_ids) for g in gens),
            sum(g.stats["wall_seconds"] for g in gens),
        )
        for method, gens in runs.items()
    }
    base_method = next(iter(runs))
    base_passes, _, base_seconds = totals[base_method]
    lines = [f"{n_questions} questions, decoded interleaved in this process:"]
    for method, (passes, tokens, seconds) in totals.items():
        lines.append(
            f"  {method:<10} {passes:>6} target passes  {seconds:7.2f} s  {tokens / seconds:7.1f} tokens/s"
            f"  ({base_passes / passes:.2f}x fewer passes, {base_seconds / seconds:.2f}x faster than {base_method})"
        )
    reference = runs[base_method]
    same = all(g.raw_token_ids == r.raw_token_ids for gens in runs.values() for g, r in zip(gens, reference))
    lines.append(f"every method produced the same tokens as {base_method}: {same}")
    return "\n".join(lines)


def _builtin_folder() -> Path:
    from spot_dlm.models.builtin import builtin_dir

    return builtin_dir()
