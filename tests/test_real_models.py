"""Models as users bring them: buffers (BatchNorm), any loss, mixed precision, warm starts
and checkpoints of the GEM moments."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import redis
import torch
from torch import nn
from torch.utils.data import Dataset

from gemq.aggregation.aggregator import Leader
from gemq.aggregation.leadership import Leadership
from gemq.aggregation.rules import GLOBAL_MOMENT, make_rule
from gemq.config import RunConfig
from gemq.errors import SpecError
from gemq.layout import BUFFER, PARAM, ParamLayout
from gemq.running.embedded import EmbeddedRedis
from gemq.running.runs import create_run
from gemq.shards import ShardPlan
from gemq.state.store import RunStore
from gemq.training.data import load_dataset, minibatches
from gemq.training.evaluate import evaluate
from gemq.training.flatmodel import FlatModel, flat_state, load_flat, state_dict_of
from gemq.training.losses import load_loss
from gemq.training.models import build_model, layout_of
from tests.helpers import GemqProcess, gradient_message, small_run, wait_for

ROOT = Path(__file__).resolve().parents[1]

# A BatchNorm MLP for digits whose inputs are far from zero (pixel values 0-16, plus 20):
# the initial running statistics (mean 0, variance 1) are far from the real ones, so a model
# whose buffers were dropped scores much worse in evaluation mode than one that kept them
# (0.14 against 0.975 for a plain loop of 180 steps, measured on 2026-12-03).
MODELS = """
import torch
from torch import nn
from torch.utils.data import TensorDataset

def bn_mlp():
    return nn.Sequential(nn.Linear(64, 128), nn.BatchNorm1d(128), nn.ReLU(),
                         nn.Linear(128, 10))

def logits_mlp():
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))

def raw_digits():
    from sklearn.datasets import load_digits
    bunch = load_digits()
    x = torch.tensor(bunch.data, dtype=torch.float32) + 20
    y = torch.tensor(bunch.target, dtype=torch.int64)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    x, y = x[order], y[order]
    return TensorDataset(x[360:], y[360:]), TensorDataset(x[:360], y[:360])

def smooth_l1(output, target):
    return nn.functional.cross_entropy(output, target, label_smoothing=0.1)
"""


def bn_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 3))


# --- the layout: parameters, then buffers ------------------------------------------------


def test_the_layout_holds_the_buffers_after_the_parameters() -> None:
    layout = layout_of(bn_mlp())
    assert [(t.name, t.kind, t.dtype) for t in layout.tensors] == [
        ("0.weight", PARAM, "float32"), ("0.bias", PARAM, "float32"),
        ("1.weight", PARAM, "float32"), ("1.bias", PARAM, "float32"),
        ("3.weight", PARAM, "float32"), ("3.bias", PARAM, "float32"),
        ("1.running_mean", BUFFER, "float32"), ("1.running_var", BUFFER, "float32"),
        ("1.num_batches_tracked", BUFFER, "int64")]
    assert layout.param_size == 8 * 6 + 6 + 6 + 6 + 6 * 3 + 3
    assert layout.size == layout.param_size + 6 + 6 + 1
    assert ParamLayout.from_json(layout.to_json()) == layout
    without = layout_of(nn.Linear(2, 2))
    assert without.layout_id == ParamLayout.from_shapes(
        [("weight", (2, 2)), ("bias", (2,))]).layout_id  # buffer-free ids unchanged


def test_the_layout_records_the_momentum_of_each_moving_average() -> None:
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2, momentum=0.3),
                          nn.Flatten(), nn.BatchNorm1d(4, momentum=None),
                          nn.InstanceNorm1d(4, track_running_stats=True), nn.Linear(4, 2))
    model.register_buffer("step", torch.zeros(3))
    momenta = {t.name: t.momentum for t in layout_of(model).buffers}
    assert momenta == {
        "1.running_mean": pytest.approx(0.3), "1.running_var": pytest.approx(0.3),
        "1.num_batches_tracked": 0.0,
        "3.running_mean": 0.0, "3.running_var": 0.0,  # momentum=None: a cumulative average
        "3.num_batches_tracked": 0.0,
        "4.running_mean": pytest.approx(0.1), "4.running_var": pytest.approx(0.1),
        "4.num_batches_tracked": 0.0, "step": 0.0}
    assert all(t.momentum == 0.0 for t in layout_of(model).params)
    root = nn.BatchNorm1d(3)
    assert [t.momentum for t in layout_of(root).buffers] == [pytest.approx(0.1)] * 2 + [0.0]


def test_buffer_momenta_travel_in_the_json_and_leave_the_layout_id_as_it_was() -> None:
    layout = layout_of(bn_mlp())
    again = ParamLayout.from_json(layout.to_json())
    assert again == layout
    assert [t.momentum for t in again.buffers] == [pytest.approx(0.1)] * 2 + [0.0]
    np.testing.assert_array_equal(again.buffer_momenta(), np.float32([0.1] * 12 + [0]))
    # A layout stored before momenta were recorded: the same id, every change added.
    data = json.loads(layout.to_json())
    for tensor in data["tensors"]:
        tensor.pop("momentum", None)
    old = ParamLayout.from_json(json.dumps(data))
    assert [t.momentum for t in old.buffers] == [0.0] * 3
    assert old.buffer_momenta() is None
    # The id of this model's layout before momenta existed (computed at the commit before):
    # runs resume from their model.pt and services compare ids, so it must not move.
    assert layout.layout_id == old.layout_id == "e3bda500df337ee2"
    with pytest.raises(ValueError, match="momentum 1.5 is not in"):
        ParamLayout.from_shapes([("w", (2,))], [("b", (2,), "float32", 1.5)])


@pytest.mark.parametrize("count", [2, 3, 5])
def test_each_shard_holds_the_momenta_of_its_own_buffer_elements(count: int) -> None:
    layout = ParamLayout.from_shapes([("w", (4,))], [
        ("mean", (6,), "float32", 0.1), ("var", (6,), "float32", 0.2), ("n", (), "int64")])
    plan = ShardPlan.of(layout, count)
    assert any(layout.param_size < s.start for s in plan.shards)  # shards of buffers alone
    parts = [shard.buffer_momenta(layout) for shard in plan.shards]
    joined = np.concatenate([np.zeros(s.stop - s.param_stop, np.float32) if p is None else p
                             for s, p in zip(plan.shards, parts, strict=True)])
    np.testing.assert_array_equal(joined, np.float32([0.1] * 6 + [0.2] * 6 + [0]))


def test_a_buffer_the_flat_state_cannot_carry_is_one_clear_error() -> None:
    model = nn.Linear(2, 2)
    model.register_buffer("phase", torch.zeros(2, dtype=torch.complex64))
    with pytest.raises(SpecError, match="buffer 'phase' is complex64: gemq carries buffers"):
        layout_of(model)
    model = nn.Linear(2, 2)
    model.register_buffer("scratch", torch.zeros(2, dtype=torch.complex64), persistent=False)
    assert [t.name for t in layout_of(model).tensors] == ["weight", "bias"]


def test_flat_state_round_trips_parameters_and_buffers_in_their_dtypes() -> None:
    source, target = bn_mlp(), bn_mlp()
    source.train()(torch.randn(16, 8) * 3 + 1)  # moves the running statistics
    state = flat_state(source)
    load_flat(target, state)
    for (name, a), (_, b) in zip(source.state_dict().items(), target.state_dict().items(),
                                 strict=True):
        assert a.dtype == b.dtype, name
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    rebuilt = state_dict_of(layout_of(source), state)
    assert rebuilt.keys() == source.state_dict().keys()
    assert rebuilt["1.num_batches_tracked"].dtype == torch.int64
    assert int(rebuilt["1.num_batches_tracked"]) == 1


def test_a_step_reports_the_change_it_made_to_the_buffers() -> None:
    torch.manual_seed(0)
    model = bn_mlp()
    flat = FlatModel(model)
    layout = layout_of(model)
    state = flat_state(model)
    flat.load(state)
    x, y = torch.randn(32, 8) * 2 + 3, torch.randint(0, 3, (32,))
    loss, _, out = flat.gradient(x, y)
    buffers = {t.name: out[t.slice] for t in layout.buffers}
    batch_mean = model[0](x).mean(0).detach().numpy()
    np.testing.assert_allclose(buffers["1.running_mean"], 0.1 * batch_mean, rtol=1e-5,
                               atol=1e-6)  # momentum 0.1 times (batch mean - 0)
    assert buffers["1.num_batches_tracked"].tolist() == [1.0]
    assert np.isfinite(out).all() and loss > 0


def test_the_rule_adds_buffer_changes_as_they_are() -> None:
    rule = make_rule(RunConfig(run_id="r"), size=4)
    theta = np.array([1, 1, 1, 1, 10, 20], np.float32)
    snapshot = theta.copy()
    gradient = np.array([0.5, 0.5, 0.5, 0.5, 2, -3], np.float32)
    rule.apply(theta, gradient, snapshot, "w", 0)
    np.testing.assert_allclose(theta[4:], [12, 17])
    assert rule.moments()["w"].shape == (4,)


def test_stale_batchnorm_steps_land_as_the_running_average_of_their_batches() -> None:
    """Real steps of a BatchNorm model, most on a copy many updates old, through the
    aggregator's rule: the run's running statistics are BatchNorm's own running average of
    the batches' statistics, taken in arrival order on the run's values."""
    torch.manual_seed(0)
    model = bn_mlp()
    flat, layout = FlatModel(model), layout_of(model)
    rule = make_rule(RunConfig(run_id="r", algo="downpour", lr=0.01), layout.param_size,
                     buffer_momenta=layout.buffer_momenta())
    theta = flat_state(model)
    versions = [theta.copy()]
    where = {t.name: t.slice for t in layout.buffers}
    mean = theta[where["1.running_mean"]].astype(np.float64)
    var = theta[where["1.running_var"]].astype(np.float64)
    for i in range(16):
        version = 0 if i % 4 else len(versions) - 1  # 3 in 4 read the first copy
        flat.load(versions[version])
        x, y = torch.randn(32, 8) * 2 + 3, torch.randint(0, 3, (32,))
        step = flat.gradient(x, y)
        with torch.no_grad():  # the batch's statistics, on the copy the worker read
            h = model[0](x).double()
        mean = 0.9 * mean + 0.1 * h.mean(0).numpy()
        var = 0.9 * var + 0.1 * h.var(0).numpy()  # BatchNorm keeps the unbiased variance
        rule.apply(theta, step.output, versions[version], f"w{i % 4}",
                   len(versions) - 1 - version)
        versions.append(theta.copy())
    np.testing.assert_allclose(theta[where["1.running_mean"]], mean, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(theta[where["1.running_var"]], var, rtol=1e-5, atol=1e-5)
    assert theta[where["1.num_batches_tracked"]].tolist() == [16.0]


# --- losses ---------------------------------------------------------------------------


def test_losses_by_name_and_by_spec(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert load_loss("cross_entropy") is nn.functional.cross_entropy
    assert load_loss("nll") is nn.functional.nll_loss
    (tmp_path / "myloss.py").write_text(MODELS)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert load_loss("myloss:smooth_l1").__name__ == "smooth_l1"
    with pytest.raises(SpecError, match="unknown loss 'mse': use one of cross_entropy, nll"):
        load_loss("mse")


def test_cross_entropy_is_right_for_logits_and_for_log_probabilities() -> None:
    logits = torch.randn(5, 4)
    target = torch.tensor([0, 1, 2, 3, 0])
    expected = nn.functional.nll_loss(torch.log_softmax(logits, 1), target)
    for output in (logits, torch.log_softmax(logits, 1)):
        torch.testing.assert_close(nn.functional.cross_entropy(output, target), expected)


def test_evaluation_reports_accuracy_only_for_class_targets() -> None:
    from torch.utils.data import TensorDataset

    model = nn.Linear(3, 1)
    data = TensorDataset(torch.randn(10, 3), torch.randn(10, 1))
    loss, accuracy = evaluate(model, data, loss=nn.functional.mse_loss)
    assert accuracy is None and loss > 0


# --- mixed precision ------------------------------------------------------------------


@pytest.mark.parametrize("amp", ["bfloat16", "float16"])
def test_mixed_precision_gradients_stay_close_to_float32(amp: str) -> None:
    torch.manual_seed(0)
    model = build_model("cnn", 784, 10)
    data = load_dataset("mnist5k")
    x, y = next(minibatches(data.train, 64, 1))
    state = flat_state(model)
    full = FlatModel(build_model("cnn", 784, 10).eval())  # eval: no dropout, same net
    full.load(state)
    full.model.eval()
    half = FlatModel(build_model("cnn", 784, 10), amp=amp)
    half.load(state)
    half.model.eval()
    _, _, reference = full.gradient(x, y)
    reference = reference.copy()
    _, _, mixed = half.gradient(x, y)
    cosine = float(np.dot(reference, mixed) / np.linalg.norm(reference) / np.linalg.norm(mixed))
    assert cosine > 0.99, cosine
    assert mixed.dtype == np.float32 and np.isfinite(mixed).all()


# --- checkpoints of the GEM moments ------------------------------------------------------


@pytest.mark.parametrize("optimizer", ["momentum", "adam"])
@pytest.mark.parametrize("proxy", ["local", "global"])
def test_a_new_leader_restores_the_checkpointed_moments(redis_client: redis.Redis,
                                                        proxy: str, optimizer: str) -> None:
    store = small_run(redis_client, checkpoint_overhead=1.0, proxy=proxy, optimizer=optimizer)
    rng = np.random.default_rng(0)
    for worker in ("w1", "w2"):
        store.publish_gradient(worker, gradient_message(
            store, worker, rng.standard_normal(36).astype(np.float32)))
    leader = Leader(store, store.config(), store.layout())
    assert Leadership(store, "t", 5000).acquire()
    entries = Leadership(store, "t", 5000).read(10).entries
    plan = leader.process([(i, f[b"m"], f[b"w"].decode()) for i, f in entries])  # type: ignore[index]
    assert set(plan.checkpoint) == ({"w1", "w2"} if proxy == "local" else {GLOBAL_MOMENT})
    assert Leadership(store, "t", 5000).commit(plan, leader.theta)
    version, saved = store.checkpointed_moments()
    assert version == 2
    successor = Leader(store, store.config(), store.layout())
    for worker, moment in leader.rule.moments().items():
        np.testing.assert_array_equal(saved[worker], moment)
        np.testing.assert_array_equal(successor.rule.moments()[worker], moment)


@pytest.mark.parametrize("shards", [1, 3])
def test_the_aggregator_applies_stale_running_statistics_as_their_average(
        redis_client: redis.Redis, shards: int) -> None:
    """Through the leaders of a (sharded) run: changes computed on a stale copy of BatchNorm-
    like buffers leave the run's running statistics the sequential average of the batches',
    whichever shard holds them."""
    layout = ParamLayout.from_shapes([("w", (4,))], [
        ("mean", (6,), "float32", 0.1), ("var", (6,), "float32", 0.1), ("n", (), "int64")])
    initial = np.float32([0] * 4 + [0] * 6 + [1] * 6 + [0])
    store = RunStore(redis_client, f"bn{shards}")
    store.create(RunConfig.from_dict({"run_id": f"bn{shards}", "algo": "downpour",
                                      "shards": shards}), layout, initial)
    plan = store.plan()
    assert shards == 1 or any(s.start > layout.param_size for s in plan.shards)
    stores = store.shards()
    leaders = [Leader(s, s.config(), s.layout()) for s in stores]
    for s in stores:
        assert Leadership(s, "t", 5000).acquire()
    rng = np.random.default_rng(1)
    expected = initial[4:16].astype(np.float64)
    for window in range(2):
        for i in range(5):  # every worker computed on version 0
            stats = np.concatenate([rng.normal(2.0, 0.1, 6), rng.uniform(0.01, 0.02, 6)])
            buffers = (0.9 * initial[4:16] + np.float32(0.1) * stats.astype(np.float32))
            change = np.concatenate([np.full(4, 0.1), buffers - initial[4:16], [1.0]])
            expected = 0.9 * expected + 0.1 * stats
            for shard, s in zip(plan.shards, stores, strict=True):
                s.publish_gradient(f"w{i}", gradient_message(
                    s, f"w{i}", change[shard.slice].astype(np.float32), version=0,
                    layout_id=plan.layout_id_of(shard.index)))
        for s, leader in zip(stores, leaders, strict=True):
            entries = Leadership(s, "t", 5000).read(10).entries
            commit = leader.process([(i, f[b"m"], f[b"w"].decode()) for i, f in entries])  # type: ignore[index]
            assert leader.updates == 5 * (window + 1)  # none rejected
            assert Leadership(s, "t", 5000).commit(commit, leader.theta)
    theta = np.concatenate([leader.theta for leader in leaders])
    np.testing.assert_allclose(theta[4:16], expected, rtol=1e-5, atol=1e-6)
    assert (theta[10:16] > 0).all()
    assert theta[16] == 10


def test_moments_of_forgotten_workers_leave_the_checkpoint(redis_client: redis.Redis) -> None:
    store = small_run(redis_client, checkpoint_overhead=1.0, worker_timeout_s=0.2)
    leader = Leader(store, store.config(), store.layout())
    assert Leadership(store, "t", 5000).acquire()

    def window(worker: str) -> None:
        store.publish_gradient(worker, gradient_message(
            store, worker, np.ones(36, np.float32), version=leader.version))
        entries = Leadership(store, "t", 5000).read(10).entries
        plan = leader.process([(i, f[b"m"], f[b"w"].decode()) for i, f in entries])  # type: ignore[index]
        assert Leadership(store, "t", 5000).commit(plan, leader.theta)
        leader.checkpoints.done(0.0)

    window("quiet")
    assert set(store.checkpointed_moments()[1]) == {"quiet"}
    time.sleep(0.3)
    window("busy")
    assert set(store.checkpointed_moments()[1]) == {"busy"}
    assert not redis_client.exists(store.keys.moment("quiet"))


# --- through gemq run ---------------------------------------------------------------


def _run(tmp_path: Path, *args: str, timeout: float = 300) -> dict[str, object]:
    (tmp_path / "usermodels.py").write_text(MODELS)
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    out = subprocess.run([sys.executable, "-m", "gemq", "run", "--no-progress", "--json",
                          str(tmp_path / "s.json"), "--out", str(tmp_path / "run"), *args],
                         capture_output=True, text=True, timeout=timeout, env=env,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    return json.loads((tmp_path / "s.json").read_text())


def _plain_loop(model: nn.Module, train: Dataset, test: Dataset, steps: int,
                batch_size: int, seed: int = 0) -> float:
    """The same model trained by momentum SGD in one process: test accuracy in eval mode."""
    torch.manual_seed(seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    batches = minibatches(train, batch_size, seed)
    model.train()
    for _ in range(steps):
        x, y = next(batches)
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    accuracy = evaluate(model, test)[1]
    assert accuracy is not None
    return accuracy


@pytest.mark.slow
def test_a_batchnorm_model_scores_like_a_plain_loop_in_evaluation_mode(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    summary = _run(tmp_path, "--model", "usermodels:bn_mlp", "--dataset",
                   "usermodels:raw_digits", "--workers", "2", "--epochs", "8")
    monkeypatch.syspath_prepend(str(tmp_path))
    import usermodels  # written by _run

    steps = int(summary["updates_applied"])  # type: ignore[call-overload]
    train, test = usermodels.raw_digits()
    plain = _plain_loop(usermodels.bn_mlp(), train, test, steps, 64)
    model = usermodels.bn_mlp()
    model.load_state_dict(torch.load(tmp_path / "run" / "model.pt", weights_only=True))
    kept = evaluate(model, test)[1]
    dropped = usermodels.bn_mlp()
    dropped.load_state_dict({k: v for k, v in model.state_dict().items()
                             if "running" not in k and "num_batches" not in k}, strict=False)
    without = evaluate(dropped, test)[1]
    print(f"eval accuracy: gemq {kept:.3f}, plain loop {plain:.3f}, buffers dropped "
          f"{without:.3f}")
    assert kept == summary["test_accuracy"]
    assert abs(kept - plain) < 0.05, (kept, plain)  # within noise of the plain loop
    assert kept > without + 0.3, (kept, without)  # ...and not what dropped buffers give
    assert int(model.state_dict()["1.num_batches_tracked"]) == steps


@pytest.mark.slow
def test_a_logits_model_trains_with_the_default_loss(tmp_path: Path) -> None:
    summary = _run(tmp_path, "--model", "usermodels:logits_mlp", "--dataset", "digits",
                   "--workers", "2", "--epochs", "20")
    assert summary["config"]["loss"] == "cross_entropy"  # type: ignore[index]
    assert summary["test_accuracy"] > 0.9  # type: ignore[operator]
    assert 0 < summary["test_loss"] < 1.0  # type: ignore[operator]  # bounded, unlike NLL


@pytest.mark.slow
def test_ctrl_c_leaves_a_model_that_a_new_run_starts_from(
        tmp_path: Path, redis_server: EmbeddedRedis, redis_client: redis.Redis) -> None:
    out = tmp_path / "first"
    process = GemqProcess("run", "--model", "mlp", "--dataset", "digits", "--steps", "100000",
                          "--run", "first", "--redis-url", redis_server.url, "--out", str(out))
    try:
        store = RunStore(redis_client, "first")
        wait_for(lambda: store.exists() and store.counters().get("applied", 0) >= 100,
                 timeout_s=120, what="100 updates")
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=60) == 130
        assert "saved the model as of update" in process.output()
    finally:
        process.stop()
    saved = torch.load(out / "model.pt", weights_only=True)
    model = build_model("mlp", 64, 10)
    model.load_state_dict(saved)
    version, state = store.latest()
    np.testing.assert_array_equal(flat_state(model), state)  # the state at the interruption
    created = subprocess.run([sys.executable, "-m", "gemq", "create", "--model", "mlp",
                              "--dataset", "digits", "--run", "second", "--redis-url",
                              redis_server.url, "--init-from", str(out / "model.pt")],
                             capture_output=True, text=True, timeout=120)
    assert created.returncode == 0, created.stderr
    start = RunStore(redis_client, "second").snapshot(0)
    assert start is not None
    np.testing.assert_array_equal(start, state)  # a new run begins where the first ended
    # gemq run --init-from too: five updates on, it scores what the saved model scored (an
    # ended run keeps only its final parameters, so its score is what can be compared).
    data = load_dataset("digits")
    saved_accuracy = evaluate(model, data.test)[1]
    summary = _run(tmp_path, "--model", "mlp", "--dataset", "digits", "--steps", "5",
                   "--run", "third", "--redis-url", redis_server.url,
                   "--init-from", str(out / "model.pt"))
    assert summary["state"] == "finished"
    assert saved_accuracy is not None and saved_accuracy > 0.5
    assert float(summary["test_accuracy"]) > saved_accuracy - 0.1  # type: ignore[arg-type]


def test_init_from_a_file_that_does_not_fit_is_one_clear_error(tmp_path: Path) -> None:
    torch.save(nn.Linear(3, 3).state_dict(), tmp_path / "other.pt")
    out = subprocess.run([sys.executable, "-m", "gemq", "create", "--model", "mlp",
                          "--dataset", "digits", "--redis-url", "redis://127.0.0.1:1/0",
                          "--init-from", str(tmp_path / "other.pt")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        f"gemq: error: --init-from {tmp_path / 'other.pt'} does not fit the model: "), lines


def test_create_run_refuses_a_loss_it_cannot_load(redis_client: redis.Redis) -> None:
    config = RunConfig(run_id="bad-loss", model="logreg", dataset="digits", loss="mse")
    with pytest.raises(SpecError, match="unknown loss 'mse'"):
        create_run(redis_client, config)
    assert not RunStore(redis_client, "bad-loss").exists()
