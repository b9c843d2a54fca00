"""Whether a finished run's result is worth keeping: most gradients rejected, a test
accuracy no better than always answering the most common class, or (for a model judged by
its loss, such as a language model) a test loss no better than the training targets'
frequencies give, is a run that trained nothing useful, whatever its exit looked like."""

from __future__ import annotations

import math
from collections.abc import Mapping

#: Standard errors above chance an accuracy must reach to count as learning something:
#: 3 keeps a run that learnt from being flagged by the luck of its test sample.
CHANCE_MARGIN_SE = 3.0


def poor_result(applied: int, rejected: Mapping[str, int], test_accuracy: float | None,
                chance: float | None, test_samples: int, test_loss: float = math.nan,
                baseline_loss: float | None = None) -> tuple[str, ...]:
    """What makes a finished run's result poor, one sentence each; empty when nothing does.

    ``chance``: the share of the held-out samples in their most common class, the accuracy
    of a model that always answers it (None where targets are not classes);
    ``baseline_loss``: the held-out loss of the training targets' frequencies, for a model
    judged by its loss (None: not judged so)."""
    problems = []
    refused = sum(rejected.values())
    if refused > applied:
        reason = max(rejected, key=lambda r: rejected[r])
        problems.append(f"{refused:,} of {refused + applied:,} gradients were rejected "
                        f"(most as {reason}): most of the workers' steps were wasted")
    if test_accuracy is not None and chance is not None and test_samples:
        bar = chance + CHANCE_MARGIN_SE * math.sqrt(chance * (1 - chance) / test_samples)
        if test_accuracy <= bar:
            problems.append(f"test accuracy {100 * test_accuracy:.1f}% is no better than "
                            f"always answering the most common class ({100 * chance:.1f}% "
                            f"of the {test_samples:,} held-out samples)")
    if baseline_loss is not None and not test_loss < baseline_loss:
        problems.append(f"test loss {test_loss:.4f} is no better than the {baseline_loss:.4f} "
                        "of the training targets' frequencies (a model that ignores its "
                        "input: for text, the unigram baseline)")
    return tuple(problems)
