"""What `gemq run` tells a user whose snapshot budget would reject gradients in flight."""

from __future__ import annotations

import pytest

from gemq.aggregation.snapshots import budget_advice, kept_versions
from gemq.config import RunConfig

MLP_11M = 11_388_010  # benchmarks.big_models:mlp_11m, 43.4 MB
CNN = 163_790  # the paper CNN, 0.66 MB


def config(**settings: int) -> RunConfig:
    return RunConfig(run_id="advice", **settings)  # type: ignore[arg-type]


def test_the_defaults_with_a_big_model_name_the_flags_that_keep_every_gradient() -> None:
    advice = budget_advice(config(), MLP_11M, workers=2)
    assert advice == ("2 parameter snapshots of a shard fit in --snapshot-budget-mb 64: "
                      "gradients more than 1 update stale will be rejected (snapshot_gone); "
                      "for 2 workers, --max-pending 4 --snapshot-budget-mb 305 keeps every "
                      "gradient in flight (README: settings for big models)")


def test_the_flags_advised_are_enough_and_then_nothing_is_said() -> None:
    advised = config(max_pending=4, snapshot_budget_mb=305)
    assert kept_versions(advised, MLP_11M) == 4 + 2 + 1
    assert budget_advice(advised, MLP_11M, workers=2) is None
    # One megabyte less keeps a version less: the advice comes back, now for the budget only.
    short = budget_advice(config(max_pending=4, snapshot_budget_mb=304), MLP_11M, workers=2)
    assert short is not None and short.endswith(
        "for 2 workers, --snapshot-budget-mb 305 keeps every gradient in flight "
        "(README: settings for big models)")


@pytest.mark.parametrize("workers", [1, 2, 8, 30])
def test_small_models_under_the_defaults_get_no_advice(workers: int) -> None:
    assert budget_advice(config(), CNN, workers=workers) is None


def test_only_a_budget_that_binds_before_max_staleness_is_reported() -> None:
    # max_staleness 3 refuses older gradients as too_stale: 4 versions are all it needs.
    assert budget_advice(config(max_staleness=3), CNN, workers=2) is None
    advice = budget_advice(config(max_staleness=3, snapshot_budget_mb=1), MLP_11M, workers=2)
    assert advice is not None and advice.startswith("2 parameter snapshots of a shard fit")
