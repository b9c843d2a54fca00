"""The peer: a parameter server built the way the GEM authors' reference code works.

torch.distributed with the gloo backend on localhost; rank 0 is the server, ranks 1..n the
workers. The server serves one request at a time, in arrival order (FIFO): a worker's
``pull`` gets the central variable, its ``commit`` adds the worker's update to it and gets
the new central variable back. GEM runs on the worker, as in the paper: after computing
delta = -lr g on its copy s, the worker pulls theta, computes
pi = clip((kappa |m| - |theta - s|) / (|delta| + eps), 0, pi_max) and commits pi * delta.
Fixed world size, nothing survives a crash: a measuring stick, not a product feature.
Written for this benchmark from that description.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

PULL, COMMIT = 0.0, 1.0
GO, STOP = 0.0, -1.0
SNAPSHOT_EVERY_S = 0.2


@dataclass(frozen=True)
class PSConfig:
    workers: int
    batch_size: int
    budget_updates: int
    port: int
    lr: float = 0.05
    momentum: float = 0.9
    kappa: float = 1.0
    pi_max: float = 5.0
    eps: float = 1e-12
    seed: int = 0


def _init(config: PSConfig, rank: int) -> Any:
    import torch
    import torch.distributed as dist

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{config.port}", rank=rank,
                            world_size=config.workers + 1)
    return dist


def _model(seed: int) -> Any:
    import torch

    from gemq.training.models import PaperCNN

    torch.manual_seed(seed)  # the same initial parameters as a gemq run with this seed
    return PaperCNN()


def server(config: PSConfig, out: str) -> None:
    """Serve pulls and commits FIFO until the budget is spent and every worker is told; the
    snapshots taken on the way go to ``out`` (npz)."""
    dist = _init(config, 0)
    times: list[float] = []
    versions: list[int] = []
    snapshots: list[np.ndarray] = []
    t0 = last = time.monotonic()

    def record(updates: int, theta: Any, done: bool) -> None:
        nonlocal last
        final = done and (not versions or versions[-1] != updates)
        if time.monotonic() - last >= SNAPSHOT_EVERY_S or final:
            last = time.monotonic()
            times.append(last - t0)
            versions.append(updates)
            snapshots.append(theta.numpy().copy())

    updates = serve(config, dist, record)
    elapsed = time.monotonic() - t0
    np.savez(out, times=np.array(times), versions=np.array(versions),
             params=np.stack(snapshots), elapsed=elapsed, updates=updates)
    dist.destroy_process_group()


def serve(config: PSConfig, dist: Any, record: Callable[[int, Any, bool], None]) -> int:
    """The server's loop: FIFO pulls and commits on the seeded parameters until the budget
    is spent and every worker is told, calling ``record(updates, theta, done)`` after each
    reply; returns the updates applied."""
    import torch

    theta = torch.nn.utils.parameters_to_vector(_model(config.seed).parameters()).detach()
    request, update = torch.zeros(1), torch.zeros_like(theta)
    reply = torch.zeros(1 + theta.numel())
    updates = stopped = 0
    while stopped < config.workers:
        src = dist.recv(request)  # from any worker: whoever comes first is served first
        if request.item() == COMMIT:
            dist.recv(update, src=src)
            if updates < config.budget_updates:
                theta += update
                updates += 1
        done = updates >= config.budget_updates
        reply[0] = STOP if done else GO
        reply[1:] = theta
        dist.send(reply, dst=src)
        stopped += int(done)
        record(updates, theta, done)
    return updates


def worker(config: PSConfig, rank: int) -> None:
    """Pull, compute a gradient, pull again, scale it by GEM's pi, commit; until told to stop."""
    import torch

    from gemq.training.data import load_dataset, minibatches, worker_seed

    data = load_dataset("mnist5k")
    dist = _init(config, rank)
    model = _model(config.seed).train()
    batches = minibatches(data.train, config.batch_size, worker_seed(config.seed, f"ps-{rank}"))
    reply = torch.zeros(1 + sum(p.numel() for p in model.parameters()))
    moment = torch.zeros(reply.numel() - 1)
    s = _call(dist, PULL, reply)
    while s is not None:
        torch.nn.utils.vector_to_parameters(s, model.parameters())
        x, y = next(batches)
        model.zero_grad(set_to_none=True)
        torch.nn.functional.nll_loss(model(x), y).backward()
        delta = torch.cat([p.grad.reshape(-1) for p in model.parameters()]) * -config.lr
        moment.mul_(config.momentum).add_(delta)
        theta = _call(dist, PULL, reply)
        if theta is None:
            break
        pi = (config.kappa * moment.abs() - (theta - s).abs()) / (delta.abs() + config.eps)
        s = _call(dist, COMMIT, reply, pi.clamp_(0, config.pi_max).mul_(delta))
    dist.destroy_process_group()


def _call(dist: Any, kind: float, reply: Any, update: Any = None) -> Any:
    """One request to the server; the central variable it answers with (a copy), or None."""
    import torch

    dist.send(torch.tensor([kind]), dst=0)
    if update is not None:
        dist.send(update, dst=0)
    dist.recv(reply, src=0)
    return None if reply[0].item() == STOP else reply[1:].clone()


def run_reference(workers: int, batch_size: int, budget_updates: int,
                  workdir: Path) -> dict[str, Any]:
    """Run the parameter server and its workers; (t, version, params) snapshots and rates."""
    from benchmarks.perf.common import start, stop
    from gemq.running.embedded import free_port

    config = PSConfig(workers, batch_size, budget_updates, free_port())
    out = workdir / f"ps-n{workers}.npz"
    children = [start(server, config, str(out), name="ps-server")]
    children += [start(worker, config, rank, name=f"ps-worker-{rank}")
                 for rank in range(1, workers + 1)]
    try:
        children[0].join(1800)
    finally:
        stop(children)
    with np.load(out) as saved:
        snapshots = list(zip(saved["times"].tolist(), saved["versions"].tolist(),
                             list(saved["params"]), strict=True))
        elapsed, updates = float(saved["elapsed"]), int(saved["updates"])
    return {"snapshots": snapshots, "elapsed_s": elapsed, "updates": updates}
