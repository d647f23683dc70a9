"""Several processes under ``torchrun``: rank, world, the process group, and gathering results on every rank.

``torchrun --nproc-per-node N -m spot_dlm bench ...`` starts N processes with ``RANK``, ``WORLD_SIZE`` and
``LOCAL_RANK`` set. Each takes every N-th prompt (``Group.share``); the results are gathered and put back in prompt
order (``interleave``), and rank 0 alone prints and writes. The group uses gloo on the CPU and nccl on CUDA, where
each process decodes on ``cuda:LOCAL_RANK``. Without those variables (or with a world of one) nothing here starts a
process group and every helper is the single-process identity.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import TypeVar

import torch

T = TypeVar("T")

# How long a rank waits at a gather for the slowest one (shares are balanced, but a long benchmark's shares may end
# far apart); a rank that fails reports it at the gather, and torchrun stops the others when one exits.
GATHER_TIMEOUT = timedelta(hours=12)


@dataclass(frozen=True)
class Group:
    """This process's place among the processes decoding one job (one process: rank 0 of 1)."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        """Rank 0: the one process that prints, writes files and shows progress."""
        return self.rank == 0

    def share(self, n: int) -> range:
        """The indices of ``n`` items this rank takes: ``rank, rank + world, ...``."""
        return range(self.rank, n, self.world)


def launched_group(environ: Mapping[str, str] = os.environ) -> Group | None:
    """The group torchrun describes in ``environ`` (None when not launched by it: the three variables are not all
    set); a malformed one is a ValueError."""
    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
    if not all(name in environ for name in names):
        return None
    try:
        rank, world, local_rank = (int(environ[name]) for name in names)
    except ValueError:
        raise ValueError(f"torchrun variables {', '.join(names)} must all be whole numbers") from None
    if world < 1 or not 0 <= rank < world or local_rank < 0:
        raise ValueError(f"torchrun variables out of range: RANK {rank}, WORLD_SIZE {world}, LOCAL_RANK {local_rank}")
    return Group(rank, world, local_rank)


def current_group() -> Group:
    """The running process group (``torch.distributed`` initialised), else a single process."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return Group()
    launched = launched_group()
    return Group(dist.get_rank(), dist.get_world_size(), launched.local_rank if launched else 0)


def local_device(name: str | torch.device) -> torch.device:
    """The device this rank decodes on: ``cuda`` (or ``auto`` on a CUDA machine) means ``cuda:LOCAL_RANK`` under
    torchrun; any other name resolves as in a single process."""
    from spot_dlm.api import resolve_device

    device = resolve_device(name)
    launched = launched_group()
    if device.type == "cuda" and device.index is None and launched is not None:
        return resolve_device(f"cuda:{launched.local_rank}")
    return device


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def check_rank_device(device: torch.device, group: Group) -> None:
    """Under torchrun each rank owns one GPU, ``cuda:LOCAL_RANK``: a ``cuda:N`` naming another (every rank on one
    GPU, which nccl refuses) is a ValueError."""
    if device.type == "cuda" and group.world > 1 and device.index not in (None, group.local_rank):
        raise ValueError(
            f"under torchrun give --device cuda (rank {group.rank} decodes on cuda:{group.local_rank}), not {device}"
        )


@contextmanager
def process_group(device: str | torch.device = "cpu") -> Iterator[Group]:
    """Join torchrun's process group for the block (gloo on the CPU, nccl on CUDA) and leave it after; a single
    process (no torchrun, or a world of one) yields its group without starting one."""
    import torch.distributed as dist

    launched = launched_group()
    if dist.is_available() and dist.is_initialized():  # joined already (by the caller)
        yield current_group()
        return
    if launched is None or launched.world == 1:
        yield launched or Group()
        return
    device = local_device(device)
    check_rank_device(device, launched)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend_for(device), timeout=GATHER_TIMEOUT)
    try:
        yield launched
    finally:
        dist.destroy_process_group()


class RankFailed(RuntimeError):
    """Another rank failed; its message is this one's."""


def gather(value: T, group: Group | None = None) -> list[T]:
    """``value`` from every rank, in rank order, on every rank (one process: ``[value]``)."""
    group = group or current_group()
    if group.world == 1:
        return [value]
    import torch.distributed as dist

    gathered: list = [None] * group.world
    dist.all_gather_object(gathered, value)
    return gathered


def gather_outcomes(work: Callable[[], T], group: Group | None = None) -> list[T]:
    """Run ``work`` on every rank and gather its results. A failure on any rank is raised on every rank after the
    gather, so none waits for a rank that stopped: the failing rank re-raises its own exception, the others a
    ValueError (FileNotFoundError) with its message when it was one, else ``RankFailed``."""
    group = group or current_group()
    if group.world == 1:
        return [work()]
    try:
        outcome = (None, work())
    except Exception as err:
        gather((type(err).__name__, str(err)), group)
        raise
    outcomes = gather(outcome, group)
    failed = [(rank, kind, message) for rank, (kind, message) in enumerate(outcomes) if kind is not None]
    if failed:
        rank, kind, message = failed[0]
        errors = {"ValueError": ValueError, "FileNotFoundError": FileNotFoundError}
        raise errors.get(kind, RankFailed)(message if kind in errors else f"rank {rank} failed: {kind}: {message}")
    return [value for _, value in outcomes]


def from_main(work: Callable[[], T], group: Group | None = None) -> T:
    """Run ``work`` on rank 0 only and hand its result to every rank (its failure is raised on every rank)."""
    group = group or current_group()
    return gather_outcomes(lambda: work() if group.is_main else None, group)[0]


def interleave(parts: Sequence[Sequence[T]]) -> list[T]:
    """Items shared out ``rank::world`` put back in order: item ``i`` is ``parts[i % world][i // world]``, up to
    the first item missing (a rank interrupted early ends the list there)."""
    world = len(parts)
    items = []
    for index in range(sum(map(len, parts))):
        rank, position = index % world, index // world
        if position >= len(parts[rank]):
            break
        items.append(parts[rank][position])
    return items
