"""The DDP contender of benchmarks/perf/versus_ddp.py: the paper CNN on mnist5k, trained the
way a PyTorch user trains it, under torchrun with gloo on the CPU.

    python -m torch.distributed.run --standalone --nproc-per-node N [--max-restarts 1] \\
        -m benchmarks.perf.ddp_train --workdir DIR --steps S [--batch-size 64]

Every rank takes its own minibatch of ``--batch-size`` samples (the global batch of a step
is N times that), DistributedDataParallel averages the gradients, and momentum SGD (the
proxy GEM matches: lr 0.05, momentum 0.9) steps. One torch thread per process.

What a DDP user must add to survive a lost worker is here too: rank 0 checkpoints model,
optimiser and step to ``DIR/checkpoint.pt`` every ``--checkpoint-every`` steps, and every
rank resumes from it when torchrun's elastic agent restarts the group.

Files in DIR, read by the benchmark:
- ``pid-rank{R}-attempt{A}``: each rank's process id (A: torchrun's restart count), so the
  benchmark can slow or kill one rank from outside;
- ``started-attempt{A}``: the wall-clock time (``time.time()``) when every rank of that
  attempt was ready and training began: attempt 0's is the run's clock start;
- ``snapshots.bin``: rank 0's (wall time, step, parameters) records, ~every 0.2 s and at
  the last step (see SnapshotLog); the benchmark evaluates them afterwards, with the same
  code as every other contender, so that evaluating never competes for the cores;
- ``done``: written by rank 0 when the last step is taken.
"""

from __future__ import annotations

import argparse
import os
import struct
import time
from pathlib import Path
from typing import Any

import numpy as np

SNAPSHOT_EVERY_S = 0.2
#: A record's header: wall time (float64) and step (int64), then the float32 parameters.
HEADER = struct.Struct("<dq")


class SnapshotLog:
    """Append-only (wall time, step, parameters) records in one file. Each record is written
    in one call and flushed, so a process killed mid-write loses at most its last record
    (the reader drops a partial one)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.last = 0.0

    def due(self) -> bool:
        return time.monotonic() - self.last >= SNAPSHOT_EVERY_S

    def append(self, step: int, params: np.ndarray) -> None:
        self.last = time.monotonic()
        with self.path.open("ab") as out:
            out.write(HEADER.pack(time.time(), step)
                      + np.ascontiguousarray(params, dtype=np.float32).tobytes())


def read_snapshots(path: Path, size: int) -> list[tuple[float, int, np.ndarray]]:
    """Every whole record of a SnapshotLog holding ``size`` parameters: (wall time, step,
    parameters)."""
    if not path.exists():
        return []
    raw = path.read_bytes()
    record = HEADER.size + 4 * size
    out = []
    for start in range(0, len(raw) - record + 1, record):
        wall, step = HEADER.unpack_from(raw, start)
        params = np.frombuffer(raw, np.float32, size, start + HEADER.size).copy()
        out.append((wall, step, params))
    return out


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="benchmarks.perf.ddp_train", description=__doc__)
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--steps", type=int, required=True, help="optimiser steps in all")
    parser.add_argument("--batch-size", type=int, default=64, help="per rank")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--checkpoint-every", type=int, default=10, help="steps")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def resume(path: Path, model: Any, optimiser: Any) -> int:
    """Load the last checkpoint into ``model`` and ``optimiser``; the step it was taken at
    (0 without one)."""
    import torch

    if not path.exists():
        return 0
    saved = torch.load(path, weights_only=True)
    model.load_state_dict(saved["model"])
    optimiser.load_state_dict(saved["optimiser"])
    return int(saved["step"])


def checkpoint(path: Path, model: Any, optimiser: Any, step: int) -> None:
    """Write the checkpoint beside its path and rename it over: a rank killed mid-write
    leaves the previous checkpoint whole."""
    import torch

    partial = path.with_suffix(".partial")
    torch.save({"model": model.state_dict(), "optimiser": optimiser.state_dict(),
                "step": step}, partial)
    os.replace(partial, path)


def train(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from gemq.training.data import load_dataset, minibatches, worker_seed
    from gemq.training.flatmodel import flat_state
    from gemq.training.models import build_model

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    (args.workdir / f"pid-rank{rank}-attempt{attempt}").write_text(str(os.getpid()))
    data = load_dataset("mnist5k")
    dist.init_process_group("gloo")
    torch.manual_seed(args.seed)  # the same initial parameters as gemq's run with this seed
    model = build_model("cnn", data.in_features, data.num_classes).train()
    ddp = DistributedDataParallel(model)  # broadcasts rank 0's parameters
    optimiser = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=args.momentum)
    saved = args.workdir / "checkpoint.pt"
    step = resume(saved, model, optimiser)
    # A restarted attempt draws fresh minibatches: replaying the lost order is not what a
    # user's sampler does either.
    batches = minibatches(data.train, args.batch_size,
                          worker_seed(args.seed, f"ddp-{rank}-{attempt}"))
    log = SnapshotLog(args.workdir / "snapshots.bin") if rank == 0 else None
    dist.barrier()  # every rank ready: training, and attempt 0's clock, start now
    if rank == 0:
        (args.workdir / f"started-attempt{attempt}").write_text(repr(time.time()))
    while step < args.steps:
        x, y = next(batches)
        optimiser.zero_grad(set_to_none=True)
        torch.nn.functional.nll_loss(ddp(x), y).backward()
        optimiser.step()
        step += 1
        if log is not None:
            if step % args.checkpoint_every == 0:
                checkpoint(saved, model, optimiser, step)
            if log.due() or step == args.steps:
                log.append(step, flat_state(model))
    if rank == 0:
        (args.workdir / "done").write_text(repr(time.time()))
    dist.barrier()  # no rank tears the group down while another still uses it
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    train(parse(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
