"""Tensor-parallel workers: one process per rank > 0; rank 0 is the engine process itself.

Rank 0 (TensorParallelWorkers) spawns the workers (torch.multiprocessing, spawn context) and
joins the group with them. Every rank loads its own shard of the model; rank 0 then sizes
the KV cache and sends the block count, and from there each step's inputs
(tallow/distributed/step_channel.py). A worker loads as rank 0 does (load_engine_model in
tallow/models/engine_model.py) and builds its step runner with the factory rank 0 hands it
(EngineCore passes ModelRunner.for_engine: the engine sits above this package), then runs the
same execute() as rank 0 on each step's inputs (its shard of every layer, its slice of the LM
head) but never samples. It stops on rank 0's shutdown header, and exits on its own when
rank 0 goes away: its pending broadcast fails when rank 0's sockets close, and a watchdog
thread checks the parent's pid.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Protocol

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tallow.config import EngineConfig
from tallow.distributed.group import PROCESS_ENV, destroy_parallel, free_port, init_parallel
from tallow.distributed.step_channel import StepChannel, StepInputs
from tallow.errors import TallowError
from tallow.models.engine_model import EngineModel, load_engine_model, resolve_device

log = logging.getLogger(__name__)

_JOIN_TIMEOUT_S = 10.0


class StepRunner(Protocol):
    def execute(self, inputs: StepInputs) -> object: ...


# (the rank's EngineModel, the config, the KV block count, parallel=the rank's context) -> its
# runner. Picklable (a module-level function or a class's method): the workers are spawned.
RunnerFactory = Callable[..., StepRunner]


class TensorParallelWorkers:
    """Rank 0's side: start the workers and join their group (the constructor), hand them
    the KV block count once every rank has loaded (wait_ready), stop them (shutdown)."""

    def __init__(self, config: EngineConfig, device: torch.device, make_runner: RunnerFactory):
        self.timeout_s = config.distributed_timeout_s
        port = free_port()
        os.environ.update(PROCESS_ENV)  # the spawned workers inherit it
        context = mp.get_context("spawn")
        started = [context.Event() for _ in range(1, config.tensor_parallel_size)]
        self.processes = [
            context.Process(target=run_worker, args=(rank, port, config, make_runner, os.getpid(), started[rank - 1]),
                            name=f"tallow-tp{rank}", daemon=True)
            for rank in range(1, config.tensor_parallel_size)
        ]
        for p in self.processes:
            p.start()
        try:
            self._wait_started(started)
            self.parallel = init_parallel(0, config.tensor_parallel_size, port, device, self.timeout_s)
        except BaseException:
            self._kill()
            raise

    def _wait_started(self, started: list) -> None:
        """Wait until every worker is about to join the group; fail at once if one exits before
        (e.g. a script without `if __name__ == "__main__":`, which spawned processes re-import)."""
        for p, event in zip(self.processes, started):
            while not event.wait(0.05):
                if not p.is_alive():
                    raise TallowError(f"tensor-parallel worker {p.name} exited while starting (exit code "
                                      f"{p.exitcode}); see its error above", status=500, type="server_error",
                                      param="tensor_parallel_size")

    def wait_ready(self, num_blocks: int) -> None:
        """Wait until every worker has loaded its shard (at most the distributed timeout after
        rank 0 has), then send them the KV block count."""
        status = torch.ones(1, dtype=torch.int64)
        work = dist.all_reduce(status, op=dist.ReduceOp.MIN, group=self.parallel.control_group, async_op=True)
        deadline = time.monotonic() + self.timeout_s
        while not work.is_completed():
            dead = [p.name for p in self.processes if not p.is_alive()]
            if dead or time.monotonic() > deadline:
                problem = f"exited ({', '.join(dead)})" if dead else f"not ready after {self.timeout_s:.0f} s"
                raise TallowError(f"tensor-parallel workers {problem} while loading the model", status=500,
                                  type="server_error", param="tensor_parallel_size")
            time.sleep(0.01)
        work.wait()
        if status.item() != 1:
            raise TallowError("a tensor-parallel worker could not load its shard of the model (see its log)",
                              status=500, type="server_error", param="tensor_parallel_size")
        dist.broadcast(torch.tensor([num_blocks]), 0, group=self.parallel.control_group)

    def shutdown(self, graceful: bool = True) -> None:
        """Stop and join the workers, then leave the group. graceful: send the shutdown header
        first (only when no step is in flight); workers still alive after the join timeout
        are killed."""
        if graceful and all(p.is_alive() for p in self.processes):
            try:
                StepChannel(self.parallel.control_group).shutdown()
            except RuntimeError:
                log.warning("could not send the shutdown header to the tensor-parallel workers")
            for p in self.processes:
                p.join(_JOIN_TIMEOUT_S)
        self._kill()
        destroy_parallel()

    def _kill(self) -> None:
        for p in self.processes:
            if p.is_alive():
                p.kill()
            p.join(_JOIN_TIMEOUT_S)


def run_worker(rank: int, port: int, config: EngineConfig, make_runner: RunnerFactory, parent_pid: int,
               started) -> None:
    """The worker process: join the group, load this rank's shard, then run the steps rank 0 sends."""
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s %(levelname)s tp{rank} %(name)s: %(message)s")
    _exit_with(parent_pid)
    torch.manual_seed(config.seed)
    device = resolve_device(config.device)
    started.set()
    parallel = init_parallel(rank, config.tensor_parallel_size, port, device, config.distributed_timeout_s)
    try:
        model: EngineModel | None = load_engine_model(config, parallel.device, parallel=parallel)
    except Exception:
        log.exception("rank %d could not load its shard", rank)
        model = None
    status = torch.tensor([int(model is not None)])
    dist.all_reduce(status, op=dist.ReduceOp.MIN, group=parallel.control_group)
    if status.item() != 1:
        destroy_parallel()
        return
    num_blocks = torch.zeros(1, dtype=torch.int64)
    dist.broadcast(num_blocks, 0, group=parallel.control_group)
    runner = make_runner(model, config, int(num_blocks), parallel=parallel)
    channel = StepChannel(parallel.control_group)
    while (inputs := channel.recv()) is not None:
        runner.execute(inputs)
    destroy_parallel()


def _exit_with(parent_pid: int) -> None:
    """Exit this process as soon as its parent is gone (a daemon thread polls the parent pid)."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="tallow-parent-watch", daemon=True).start()
