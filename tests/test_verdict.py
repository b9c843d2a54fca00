"""gemq/records/verdict.py: when a finished run's result is called poor."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils.data import TensorDataset

from gemq.records.verdict import poor_result
from gemq.training.evaluate import frequency_loss, majority_share


def test_a_good_run_has_no_problem() -> None:
    assert poor_result(625, {}, 0.97, 0.11, 1000) == ()
    assert poor_result(625, {"too_stale": 600}, None, None, 1000) == ()  # not most


def test_most_gradients_rejected() -> None:
    (problem,) = poor_result(30, {"too_stale": 37, "malformed": 2}, None, None, 1000)
    assert problem == ("39 of 69 gradients were rejected (most as too_stale): most of the "
                       "workers' steps were wasted")


def test_chance_accuracy_is_judged_against_the_most_common_class_with_a_margin() -> None:
    # 1,000 samples, 11.0% in the most common class: 3 standard errors is 3.0 points.
    (problem,) = poor_result(63, {}, 0.139, 0.11, 1000)
    assert problem == ("test accuracy 13.9% is no better than always answering the most "
                       "common class (11.0% of the 1,000 held-out samples)")
    assert poor_result(63, {}, 0.141, 0.11, 1000) == ()


def test_majority_share_counts_classes_across_batches() -> None:
    targets = torch.tensor([0, 2, 2, 1, 2, 0, 2])
    data = TensorDataset(torch.zeros(7, 3), targets)
    assert majority_share(data, batch_size=3) == 4 / 7
    regression = TensorDataset(torch.zeros(4, 3), torch.zeros(4, 1))
    assert majority_share(regression) is None


def test_a_loss_no_better_than_the_target_frequencies_is_poor() -> None:
    (problem,) = poor_result(800, {}, None, None, 2047, 3.4, 3.357)
    assert problem.startswith("test loss 3.4000 is no better than the 3.3570 of the "
                              "training targets' frequencies")
    assert poor_result(800, {}, None, None, 2047, 2.65, 3.357) == ()
    assert poor_result(800, {}, None, None, 2047, float("nan"), 3.357)  # NaN learnt nothing


def test_frequency_loss_of_sequences_across_batches_by_hand() -> None:
    # Training targets 0, 0, 0, 1 (and 3 classes): add-one counts 4, 2, 1 out of 7.
    train = TensorDataset(torch.zeros(2, 2), torch.tensor([[0, 0], [0, 1]]))
    test = TensorDataset(torch.zeros(1, 2), torch.tensor([[1, 2]]))
    expected = -(math.log(2 / 7) + math.log(1 / 7)) / 2
    assert frequency_loss(train, test, classes=3, batch_size=1) == pytest.approx(expected)
    floats = TensorDataset(torch.zeros(2, 2), torch.zeros(2, 2))
    assert frequency_loss(floats, floats) is None
