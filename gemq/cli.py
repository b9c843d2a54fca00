"""The ``gemq`` command line. Heavy imports (torch) happen inside the commands that need them,
so ``gemq aggregator`` starts without torch."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from gemq.config import ALGORITHMS, PROXIES, WIRE_DTYPES, RunConfig
from gemq.errors import ConfigError, GemqError
from gemq.settings import apply_env_defaults
from gemq.simulate import add_simulate_parser, cmd_simulate

EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad flag in one line, without the usage block."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def _add_redis(parser: argparse.ArgumentParser, required: bool) -> None:
    parser.add_argument("--redis-url", default=None, required=False,
                        help="redis://[user:password@]host:port/db, rediss:// for TLS"
                             + ("" if required else "; default: a private embedded Redis"))


def _add_run(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--run", dest="run_id", default=None, help="the run id (required)")


def _add_proxy(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--proxy", choices=PROXIES, default="local",
                        help="GEM's proxy: each worker's own moment (local, the paper) or one "
                             "moment of all updates (global)")


def _default(field: str) -> Any:
    return RunConfig.__dataclass_fields__[field].default


def _add_training(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("training")
    group.add_argument("--algo", choices=ALGORITHMS, default="gem")
    group.add_argument("--lr", type=float, default=0.05, help="learning rate eta")
    group.add_argument("--momentum", type=float, default=0.9, help="proxy momentum mu")
    group.add_argument("--kappa", type=float, default=1.0, help="GEM proxy amplification")
    group.add_argument("--pi-max", type=float, default=5.0, help="GEM clip of pi")
    group.add_argument("--batch-size", type=_positive_int, default=64)
    budget = group.add_mutually_exclusive_group()
    budget.add_argument("--epochs", type=_positive_float, default=None,
                        help="passes over the training set, summed over workers (default 10)")
    budget.add_argument("--steps", type=_positive_int, default=None,
                        help="gradient updates to apply")
    group.add_argument("--model", default="cnn", help="cnn, mlp, logreg or module:factory")
    group.add_argument("--dataset", default="mnist5k",
                       help="mnist5k, digits, mnist-idx:DIR or module:factory")
    group.add_argument("--seed", type=int, default=0)
    group.add_argument("--max-staleness", type=int, default=512)
    group.add_argument("--run", dest="run_id", default=None,
                       help="run id; default: run-<date>-<time>-<random>")


def _add_transport(parser: argparse.ArgumentParser) -> None:
    """How gradients and parameters travel through Redis (not simulated by gemq simulate)."""
    group = parser.add_argument_group("transport")
    group.add_argument("--max-pending", type=_positive_int, default=64,
                       help="workers wait while the stream holds more gradients than this")
    group.add_argument("--wire-dtype", choices=tuple(WIRE_DTYPES), default="float32",
                       help="gradient payloads: float32, or half the bytes as bfloat16 "
                            "(cheap to convert) or float16")
    group.add_argument("--publish-every", type=_positive_int, default=_default("publish_every"),
                       help="publish parameters once this many updates were applied since "
                            "the last publication")
    group.add_argument("--publish-interval-ms", type=int,
                       default=_default("publish_interval_ms"),
                       help="...and this many ms have passed since it (0: no wait)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="gemq", description="Asynchronous training with Gradient Energy "
                     "Matching over Redis Streams. Every flag can also be set as GEMQ_<FLAG> "
                     "(for example GEMQ_REDIS_URL).")
    parser.add_argument("-v", "--verbose", action="store_true", help="log more")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    run = commands.add_parser("run", help="train locally: Redis, aggregator and workers")
    _add_training(run)
    _add_transport(run)
    _add_proxy(run)
    _add_redis(run, required=False)
    run.add_argument("--workers", type=_positive_int, default=4, help="logical workers")
    run.add_argument("--worker-processes", type=int, default=0,
                     help="processes hosting them as threads; 0: min(workers, max(4, CPUs))")
    run.add_argument("--device", default="cpu", help="auto, cpu or cuda[:N] for workers")
    run.add_argument("--out", type=Path, default=None, help="default: runs/<run-id>")
    run.add_argument("--json", type=Path, default=None, help="also write the summary here")
    run.add_argument("--no-progress", action="store_true", help="no live progress bar")

    create = commands.add_parser("create", help="create a run in Redis for remote workers")
    _add_training(create)
    _add_transport(create)
    _add_proxy(create)
    _add_redis(create, required=True)

    aggregator = commands.add_parser("aggregator", help="aggregate one run (numpy only)")
    _add_run(aggregator)
    _add_redis(aggregator, required=True)
    aggregator.add_argument("--lease-ms", type=_positive_int, default=5000)
    aggregator.add_argument("--serve", action="store_true",
                            help="the aggregator service: take runs' jobs off the rq queue")

    worker = commands.add_parser("worker", help="compute gradients for one run")
    _add_run(worker)
    _add_redis(worker, required=True)
    worker.add_argument("--workers", type=_positive_int, default=1,
                        help="logical workers in this process (one thread each)")
    worker.add_argument("--worker-id", default=None, help="id prefix; default: host-pid")
    worker.add_argument("--device", default="cpu", help="auto, cpu or cuda[:N]")
    worker.add_argument("--follow", action="store_true",
                        help="the worker service: join whichever run is running, wait between "
                             "runs (with --run: only that run)")

    serve = commands.add_parser("serve", help="the REST API and live dashboard")
    _add_redis(serve, required=True)
    serve.add_argument("--host", default=None, help="default 127.0.0.1; others need a token")
    serve.add_argument("--port", type=int, default=None, help="default 8000")

    status = commands.add_parser("status", help="print a run's state and counters as JSON")
    _add_run(status)
    _add_redis(status, required=True)

    apply_env_defaults(add_simulate_parser(commands), os.environ)
    for each in (parser, run, create, aggregator, worker, status, serve):
        apply_env_defaults(each, os.environ)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        service = (args.command == "serve" or getattr(args, "serve", False)
                   or getattr(args, "follow", False))
        logging.basicConfig(level=logging.INFO if args.verbose or service else logging.WARNING,
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        return int(COMMANDS[args.command](args) or 0)
    except ConfigError as e:
        print(f"gemq: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except GemqError as e:
        print(f"gemq: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("gemq: interrupted", file=sys.stderr)
        return 130


def _required(args: argparse.Namespace, dest: str, flag: str) -> str:
    # Checked here, not by argparse: a required argparse option ignores its env default.
    value = getattr(args, dest)
    if not value:
        env = "GEMQ_" + flag.removeprefix("--").replace("-", "_").upper()
        raise ConfigError(flag, f"required for 'gemq {args.command}' (or set {env})")
    return str(value)


def _require_url(args: argparse.Namespace) -> str:
    return _required(args, "redis_url", "--redis-url")


def _require_run(args: argparse.Namespace) -> str:
    return _required(args, "run_id", "--run")


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    return {"algo": args.algo, "lr": args.lr, "momentum": args.momentum, "kappa": args.kappa,
            "pi_max": args.pi_max, "batch_size": args.batch_size, "model": args.model,
            "dataset": args.dataset, "seed": args.seed, "max_staleness": args.max_staleness,
            "max_pending": args.max_pending, "wire_dtype": args.wire_dtype,
            "proxy": args.proxy, "publish_every": args.publish_every,
            "publish_interval_ms": args.publish_interval_ms}


def _cmd_run(args: argparse.Namespace) -> int:
    from gemq.local import train

    summary = train(workers=args.workers, worker_processes=args.worker_processes,
                    epochs=args.epochs, steps=args.steps,
                    redis_url=args.redis_url, out_dir=args.out, progress=not args.no_progress,
                    device=args.device, run_id=args.run_id, **_settings(args))
    if args.json:
        from gemq.summary import write_json

        write_json(summary, args.json)
    _print_summary(summary)
    return 0


def _print_summary(s: dict[str, Any]) -> None:
    rejected = sum(s["rejected"].values())
    print(f"test accuracy: {100 * s['test_accuracy']:.1f}% on {s['test_samples']} held-out "
          f"samples (train loss {s['train_loss']:.4f})")
    print(f"updates: {s['updates_applied']} applied, {rejected} rejected, {s['unused']} unused "
          f"in {s['wall_time_s']:.1f}s; mean staleness {s['staleness_mean']:.1f}, "
          f"energy ratio {s['energy_ratio']:.2f}")
    print(f"model:   {s['model_path']}")
    print(f"summary: {s['summary_path']}")


def _cmd_create(args: argparse.Namespace) -> int:
    from gemq.connection import connect
    from gemq.data import load_dataset
    from gemq.runs import budget_for, create_run, new_run_id

    data = load_dataset(args.dataset)
    budget = args.steps or budget_for(args.epochs or 10, data, args.batch_size)
    config = RunConfig.from_dict({"run_id": args.run_id or new_run_id(),
                                  "budget_updates": budget, **_settings(args)})
    client = connect(_require_url(args))
    try:
        create_run(client, config, data)
    except FileExistsError as e:
        raise GemqError(str(e)) from e
    finally:
        client.close()
    print(config.run_id)
    return 0


def _cmd_aggregator(args: argparse.Namespace) -> int:
    if args.serve:
        from gemq.services.aggregator import serve
        from gemq.services.settings import AggregatorServiceSettings, load

        serve(load(AggregatorServiceSettings, redis_url=args.redis_url,
                   lease_ms=args.lease_ms))
        return 0
    from gemq.aggregator import Aggregator, AggregatorOptions
    from gemq.connection import connect
    from gemq.process import graceful_shutdown
    from gemq.store import ENDED, RunStore

    run_id, url = _require_run(args), _require_url(args)
    client = connect(url)
    try:
        store = RunStore(client, run_id)
        final = Aggregator(store, AggregatorOptions(lease_ms=args.lease_ms)).run(
            graceful_shutdown())
    finally:
        client.close()
    print(f"run {run_id}: {final}")
    return 0 if final in ENDED or final == "shutdown" else 1


def _cmd_worker(args: argparse.Namespace) -> int:
    if args.follow:
        from gemq.process import graceful_shutdown
        from gemq.services.settings import WorkerServiceSettings, load
        from gemq.services.worker import follow

        settings = load(WorkerServiceSettings, redis_url=args.redis_url, run=args.run_id,
                        workers=args.workers, device=args.device)
        follow(settings, graceful_shutdown())
        return 0
    import socket

    import torch

    from gemq.connection import connect
    from gemq.process import graceful_shutdown
    from gemq.store import RunStore
    from gemq.worker import WorkerOptions, run_workers

    prefix = args.worker_id or f"{socket.gethostname()}-{os.getpid()}"
    ids = [prefix] if args.workers == 1 else [f"{prefix}-{i}" for i in range(args.workers)]
    if args.workers > 1:
        torch.set_num_threads(1)
    run_id, url = _require_run(args), _require_url(args)
    client = connect(url, retries=0)
    try:
        steps = run_workers(RunStore(client, run_id), ids, WorkerOptions(args.device),
                            graceful_shutdown())
    finally:
        client.close()
    print(f"run {run_id}: {sum(steps.values())} gradients published by {len(ids)} workers")
    return 0


def _cmd_status(args: argparse.Namespace) -> int:
    from gemq.connection import connect
    from gemq.store import RunStore
    from gemq.summary import run_totals

    run_id, url = _require_run(args), _require_url(args)
    client = connect(url)
    try:
        store = RunStore(client, run_id)
        print(json.dumps({**run_totals(store), "workers": store.worker_states()}, indent=2))
    finally:
        client.close()
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    from gemq.services.api.app import serve
    from gemq.services.settings import ApiSettings, load

    serve(load(ApiSettings, redis_url=args.redis_url, host=args.host, port=args.port))
    return 0


COMMANDS = {"run": _cmd_run, "create": _cmd_create, "aggregator": _cmd_aggregator,
            "worker": _cmd_worker, "status": _cmd_status, "serve": _cmd_serve,
            "simulate": cmd_simulate}
