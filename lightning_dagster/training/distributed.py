"""Data-parallel training with torch.distributed, and the launcher of `train --nproc N`. Rank 0 drives; the
other ranks wait in `follow` and run each step on their share. Rows are shared out by rollout, so only the
step's totals need an all_reduce and the loss weights are exactly the single-process ones."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from lightning_dagster.training.loss import LossParts
from lightning_dagster.training.transitions import Row

if TYPE_CHECKING:
    from lightning_dagster.training.trainer import Trainer


class DistributedError(RuntimeError):
    """A process group that cannot be used (a world size below 1, NCCL without CUDA)."""


@dataclass(frozen=True)
class Group:
    """This process's place in the default process group."""

    rank: int
    world_size: int
    local_rank: int
    backend: str

    @property
    def leader(self) -> bool:
        return self.rank == 0


def launched_world_size() -> int:
    """The world size `torchrun` gave this process (1 outside torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def join(device: torch.device) -> Group:
    """Join the process group `torchrun` describes in the environment: NCCL on CUDA, else gloo."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    backend = "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        dist.init_process_group(backend=backend)
    return Group(dist.get_rank(), dist.get_world_size(), local_rank, backend)


def rank_device(device: torch.device, group: Group | None) -> torch.device:
    """A CUDA rank trains on the GPU of its local rank; CPU stays CPU."""
    if device.type == "cuda" and group is not None:
        return torch.device("cuda", group.local_rank)
    return device


def shard(rows: Sequence[Row], group: Group) -> list[Row]:
    """This rank's rows: rollouts in order of first appearance, dealt round-robin, each rollout whole."""
    order: dict[str, int] = {}
    for r in rows:
        order.setdefault(r.rollout_id, len(order))
    return [r for r in rows if order[r.rollout_id] % group.world_size == group.rank]


def _all_reduce(values: list[float], op: Any, group: Group) -> list[float]:
    device = torch.device("cuda", group.local_rank) if group.backend == "nccl" else torch.device("cpu")
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=op)
    return t.tolist()


def step_totals(rows: Sequence[Row], group: Group) -> tuple[int, int]:
    """Trained tokens and rollouts of the whole step, from each rank's share."""
    tokens = sum(r.trained_tokens for r in rows)
    rollouts = len({r.rollout_id for r in rows})
    total_tokens, total_rollouts = _all_reduce([tokens, rollouts], dist.ReduceOp.SUM, group)
    return int(total_tokens), int(total_rollouts)


SUMMED_PARTS = ("tokens", "clipped", "kl_sum", "is_ratio_sum", "is_capped", "abs_log_ratio_sum")


def reduce_parts(parts: LossParts, group: Group) -> LossParts:
    """The step's loss sums over every rank: sums added, extremes taken."""
    summed = [float(parts.loss.detach()), *(getattr(parts, name) for name in SUMMED_PARTS)]
    sums = _all_reduce(summed, dist.ReduceOp.SUM, group)
    highs = [parts.is_ratio_max, parts.abs_log_ratio_max, -parts.is_ratio_min]
    high, log_high, low = _all_reduce(highs, dist.ReduceOp.MAX, group)  # the min as the max of negatives
    extremes = {"is_ratio_max": high, "abs_log_ratio_max": log_high, "is_ratio_min": -low}
    return LossParts(loss=torch.tensor(sums[0]), **dict(zip(SUMMED_PARTS, sums[1:], strict=True)), **extremes)


def broadcast(value: Any, group: Group) -> Any:
    """Rank 0's `value` on every rank (pickled)."""
    box = [value if group.leader else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def follow(trainer: Trainer) -> int:
    """A non-zero rank's whole run: each step rank 0 sends, until it calls `release`; returns the steps."""
    group = trainer.group
    if group is None or group.leader:
        raise DistributedError("follow() runs on ranks 1.. of a process group; rank 0 drives the steps")
    steps = 0
    while (message := broadcast(None, group)) is not None:
        rows, advantages, extra = message
        trainer.step(rows, advantages, extra)
        steps += 1
    return steps


def release(group: Group) -> None:
    """Rank 0: no more steps; every `follow` returns."""
    broadcast(None, group)


def command(nproc: int, module: str, *argv: str) -> list[str]:
    """`python -m MODULE ARGV`, as `nproc` ranks under `torch.distributed.run` on this machine when > 1."""
    if nproc < 1:
        raise DistributedError(f"nproc must be >= 1, got {nproc}")
    python = [sys.executable, "-m", module, *argv]
    if nproc == 1:
        return python
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            "--no-python", *python]  # fmt: skip


def launch(argv: Sequence[str], nproc: int) -> int:
    """Run `lightning-dagster ARGV` as `nproc` ranks; returns its exit status. Only rank 0 prints."""
    return subprocess.run(command(nproc, "lightning_dagster.cli", *argv), check=False).returncode
