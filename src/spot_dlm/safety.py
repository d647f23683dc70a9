"""Checks made before any work starts, and writes that never leave a half-written file.

Bounds on inputs that no later step would catch in time (a draft budget whose verification pass cannot fit in
memory, a training time of NaN), and output paths: a file or folder that holds a result is only replaced with
``--force``, and a path that cannot be written is refused before a long run, not after it.
"""

from __future__ import annotations

import math
import numbers
import os
from collections.abc import Callable
from pathlib import Path

MAX_DRAFT_TOKENS = 1 << 14  # block tokens one verification pass may score: budget x block length


def check_draft_budget(budget: int, block_length: int) -> None:
    """A draft budget whose verification pass (``budget`` block states of ``block_length`` tokens) fits in memory."""
    if budget * block_length > MAX_DRAFT_TOKENS:
        raise ValueError(
            f"budget {budget} x block length {block_length} = {budget * block_length} tokens scored per pass, more "
            f"than the {MAX_DRAFT_TOKENS} a pass may hold: give a budget of at most {MAX_DRAFT_TOKENS // block_length}"
        )


def check_minutes(minutes: float, option: str = "--minutes") -> None:
    """A training time: a finite number of minutes > 0."""
    if not isinstance(minutes, numbers.Real) or not math.isfinite(minutes) or minutes <= 0:
        raise ValueError(f"{option} must be a finite number > 0, got {minutes}")


def _nearest_existing(path: Path) -> Path:
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_writable_parent(path: Path, option: str) -> None:
    """The folder ``path`` would be created in can be created and written (its nearest existing ancestor is a
    writable folder)."""
    base = _nearest_existing(Path(path).parent)
    if not base.is_dir():
        raise ValueError(f"{option} {path}: {base} is a file, not a folder")
    if not os.access(base, os.W_OK | os.X_OK):
        raise ValueError(f"{option} {path}: cannot write in {base}")


def check_new_file(path: Path | str | None, force: bool, option: str) -> None:
    """An output file: not a folder, writable, and not already there unless ``force``."""
    if path is None:
        return
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{option} {path} is a folder; give a file name")
    check_writable_parent(path, option)
    if path.exists() and not force:
        raise ValueError(f"{option} {path} exists: give --force to replace it, or another name")
    if path.exists() and not os.access(path, os.W_OK):
        raise ValueError(f"{option} {path}: cannot write it")


def check_output_folder(path: Path | str | None, force: bool, option: str, results: tuple[str, ...]) -> None:
    """An output folder: not a file, writable, and holding none of ``results`` (file names) unless ``force``."""
    if path is None:
        return
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{option} {path} is a file, not a folder")
    check_writable_parent(path / "x", option)
    held = [name for name in results if (path / name).exists()]
    if held and not force:
        raise ValueError(f"{option} {path} already holds {', '.join(held)}: give --force to replace them")


def write_atomic(path: Path, write: Callable[[Path], object]) -> None:
    """``write(name)`` to a temporary name beside ``path``, then rename it into place (readers see the old file or
    the new one, never half of one)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    os.replace(tmp, path)


def write_text_atomic(path: Path, text: str) -> None:
    write_atomic(path, lambda tmp: tmp.write_text(text))


def check_generate_config(config) -> None:
    """What ``GenerateConfig`` cannot see by its own fields: the seed's range (the noise key's 64 bits), the draft
    budget against the block (memory), and a drafter folder given by the user against the method (its model kind,
    and the small order model or token LM asked for)."""
    from spot_dlm.drafters.folder import check_drafter_folder
    from spot_dlm.noise import check_seed

    check_seed(config.seed)
    if config.budget is not None:
        check_draft_budget(config.budget, config.resolved_block_length)
    token_lm = config.token_lm and config.neighbour_tokens  # the LM is read only with neighbour tokens on
    check_drafter_folder(config.method, config.drafter, config.order_model, token_lm)
