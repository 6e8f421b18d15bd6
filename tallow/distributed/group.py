"""The tensor-parallel process group: set-up, tear-down, and the collectives the model uses.

Two torch.distributed groups span the same ranks:

- the device group (the default group): NCCL on CUDA, gloo on the CPU, with a timeout of
  a few tens of seconds. The model's all-reduces and the logits gather run on it.
- the control group: gloo over CPU tensors, with a timeout of a year. Rank 0 broadcasts each
  step's inputs on it (tallow/distributed/step_channel.py); a worker waits there while the
  engine is idle, however long, and fails at once when rank 0's sockets close.

A process holds one tensor-parallel group at a time (torch.distributed's default group).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from tallow.errors import TallowError

# Every process that joins a group gets these: NVLink multicast (NVLS) stays off.
PROCESS_ENV = {"NCCL_NVLS_ENABLE": "0"}
CONTROL_TIMEOUT = timedelta(days=365)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_device(device: torch.device, rank: int) -> torch.device:
    """The device of a rank: cuda:<first + rank> on CUDA, the CPU otherwise."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


@dataclass
class ParallelContext:
    """This process's place in the tensor-parallel group, and the collectives over it."""

    rank: int
    world_size: int
    device: torch.device
    group: dist.ProcessGroup  # the device group
    control_group: dist.ProcessGroup  # gloo, CPU tensors

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of x over the ranks, in place."""
        dist.all_reduce(x, group=self.group)
        return x

    def gather_columns(self, x: torch.Tensor, width: int) -> torch.Tensor | None:
        """Rank 0 gets the ranks' [N, k] slices side by side, cut to `width` columns (the
        vocabulary without its padding); the other ranks get None."""
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)] if self.is_first else None
        dist.gather(x, parts, dst=0, group=self.group)
        return torch.cat(parts, dim=-1)[:, :width] if self.is_first else None


def init_parallel(rank: int, world_size: int, port: int, device: torch.device, timeout_s: float) -> ParallelContext:
    """Join the group of world_size processes that rank 0 hosts on 127.0.0.1:port (blocks
    until every rank has joined, at most timeout_s)."""
    if dist.is_initialized():
        raise TallowError("this process already belongs to a tensor-parallel group: shut the other "
                          "engine down first", param="tensor_parallel_size")
    os.environ.update(PROCESS_ENV)
    device = rank_device(device, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    return ParallelContext(rank, world_size, device, dist.group.WORLD, control)


def destroy_parallel() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
