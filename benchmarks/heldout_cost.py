"""What the held-out evaluation during a run costs the workers, as a ratio to their steps.

    python -m benchmarks.heldout_cost

For each model, in one process and one thread (a worker's share of a small machine): the
mean time of a worker step (a minibatch of 64, forward and backward, into a flat gradient:
gemq.training.flatmodel) and of one evaluation as a worker makes it every eval_every
updates (gemq.training.heldout: the first EVAL_SAMPLES held-out samples). Prints the
evaluation in steps, and its share of the work at the default eval_every.
"""

from __future__ import annotations

import time

import torch
from torch.utils.data import Subset

from gemq.config import RunConfig
from gemq.training.data import load_dataset, minibatches
from gemq.training.evaluate import evaluate
from gemq.training.flatmodel import FlatModel
from gemq.training.heldout import EVAL_SAMPLES
from gemq.training.models import build_model

CASES = (("cnn", "mnist5k"), ("resnet", "mnist5k"), ("mlp", "digits"), ("logreg", "digits"))
STEPS, EVALUATIONS = 40, 5


def measure(model_name: str, dataset: str) -> tuple[float, float, int]:
    """(seconds per step, seconds per evaluation, samples evaluated)."""
    data = load_dataset(dataset)
    net = FlatModel(build_model(model_name, data.in_features, data.num_classes))
    batches = minibatches(data.train, 64, 0)
    held_out = Subset(data.test, range(min(EVAL_SAMPLES, len(data.test))))  # type: ignore[arg-type]
    for _ in range(5):  # warm up
        net.gradient(*next(batches))
    evaluate(net.model, held_out)
    started = time.perf_counter()
    for _ in range(STEPS):
        net.gradient(*next(batches))
    step_s = (time.perf_counter() - started) / STEPS
    started = time.perf_counter()
    for _ in range(EVALUATIONS):
        evaluate(net.model, held_out)
    return step_s, (time.perf_counter() - started) / EVALUATIONS, len(held_out)


def main() -> None:
    torch.set_num_threads(1)
    every = RunConfig("defaults").eval_every
    print(f"held-out evaluation every {every} updates, on up to {EVAL_SAMPLES} samples; "
          "one thread")
    for model_name, dataset in CASES:
        step_s, eval_s, samples = measure(model_name, dataset)
        steps = eval_s / step_s
        print(f"{model_name:>7} on {dataset:<8} step {1e3 * step_s:7.2f} ms, evaluation of "
              f"{samples} samples {1e3 * eval_s:8.2f} ms = {steps:5.2f} steps: "
              f"{100 * steps / every:.1f} % of the work at eval_every {every}")


if __name__ == "__main__":
    main()
