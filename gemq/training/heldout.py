"""Held-out evaluation while a run trains, for every kind of run (local or services).

Every ``eval_every`` updates, one worker evaluates the parameters it has just loaded on the
first ``EVAL_SAMPLES`` samples of the held-out set: the first worker to load a version
past the next multiple claims it in Redis (one atomic script), so each multiple is
evaluated once however many workers there are, and a worker that falls behind skips the
ones already claimed. The result waits in Redis for the aggregator's next commit, which
writes it into that commit's metrics entry (``eval_updates``, ``test_loss``,
``test_accuracy``): from there metrics.csv, the API and the dashboard have it like any
other metric.

Its cost is a forward pass over EVAL_SAMPLES samples in the worker's time, measured
against the workers' steps by ``python -m benchmarks.heldout_cost`` (docs/performance.md,
"Held-out evaluation").
"""

from __future__ import annotations

import logging

from torch import nn
from torch.utils.data import Dataset, Subset

from gemq.config import RunConfig
from gemq.state.store import RunStore
from gemq.training.evaluate import evaluate
from gemq.training.losses import LossFunction

log = logging.getLogger(__name__)

#: Held-out samples an evaluation during the run reads: the first ones of the test set, the
#: same every time. gemq run's final evaluation reads them all.
EVAL_SAMPLES = 512


class HeldOutEvaluation:
    """One worker's part in its run's evaluations."""

    def __init__(self, store: RunStore, config: RunConfig, test: Dataset,
                 loss: LossFunction) -> None:
        self.store = store
        self.every = config.eval_every if len(test) else 0  # type: ignore[arg-type]
        self.samples = Subset(test, range(min(EVAL_SAMPLES, len(test))))  # type: ignore[arg-type]
        self.loss = loss
        self._next = self.every  # the first version due

    def evaluate_if_due(self, version: int, model: nn.Module) -> None:
        """Evaluate ``model`` (loaded with the parameters at ``version``) if an evaluation
        is due there and no other worker has claimed it."""
        if not self.every or version < self._next:
            return
        index = version // self.every
        self._next = (index + 1) * self.every
        if not self.store.claim_evaluation(index):
            return
        loss, accuracy = evaluate(model, self.samples, loss=self.loss)
        self.store.record_evaluation(version, loss, accuracy)
        log.debug("run %s: held-out loss %.4g at update %d", self.store.run_id, loss, version)
