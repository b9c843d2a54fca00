"""The ``gemq`` command line. Heavy imports (torch) happen inside the commands that need them,
so ``gemq aggregator`` starts without torch.

This is the top of the house: it may import the library and the services (gemq.services);
nothing imports it but the ``gemq`` script and ``python -m gemq``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import redis

from gemq import __version__, logs
from gemq.cliargs import (
    EXIT_POOR_RESULT,
    EXIT_USAGE,
    Parser,
    add_config,
    add_redis,
    add_run,
    add_settings,
    apply_env_defaults,
    non_negative_int,
    positive_int,
    required,
    settings_of,
)
from gemq.config import (
    BUDGET,
    COMPUTE,
    LIMITS,
    PLANNED_WORKERS,
    TRAINING,
    TRANSPORT,
    USER_SETTINGS,
    left_to_gemq,
    make_config,
    validate_settings,
)
from gemq.configfile import apply_config_file
from gemq.errors import ConfigError, GemqError, RunExists
from gemq.process import Terminated, raise_on_termination
from gemq.records.curves import FORMATS
from gemq.running.localservices import DEFAULT_WORKERS as DEFAULT_LOCAL_WORKERS
from gemq.sim.command import add_simulate_parser, cmd_simulate

if TYPE_CHECKING:
    from gemq.records.summary import RunSummary

#: The run settings `gemq run` and `gemq create` take.
RUN_GROUPS = (TRAINING, BUDGET, COMPUTE, TRANSPORT, LIMITS)
_NEW_RUN_ID = "run id; default: run-<date>-<time>-<random>"


def _verbose(parser: argparse.ArgumentParser, default: Any = False) -> None:
    parser.add_argument("-v", "--verbose", action="store_true", default=default,
                        help="log more")


def _command(commands: Any, name: str, help: str, example: str) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = commands.add_parser(
        name, help=help, description=help[0].upper() + help[1:] + ".",
        epilog=f"example:\n  {example}")
    # After the command too (gemq run -v); SUPPRESS keeps it from undoing `gemq -v run`.
    _verbose(parser, default=argparse.SUPPRESS)
    return parser


def _add_init_from(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--init-from", type=Path, default=None, metavar="PATH",
                        help="start from this state_dict file (an earlier run's model.pt) "
                             "instead of the seeded initial parameters")


def build_parser() -> Parser:
    parser = Parser(prog="gemq", description="Asynchronous training with Gradient Energy "
                    "Matching over Redis Streams. Every flag can also be set as GEMQ_<FLAG> "
                    "(for example GEMQ_REDIS_URL).")
    parser.add_argument("--version", action="version", version=f"gemq {__version__}")
    _verbose(parser)
    commands = parser.add_subparsers(dest="command", required=True, parser_class=Parser)

    run = _command(commands, "run", "train locally: Redis, aggregator and workers",
                   "gemq run --workers 8 --algo gem --epochs 20")
    add_settings(run, RUN_GROUPS)
    add_run(run, _NEW_RUN_ID)
    add_redis(run, required=False)
    run.add_argument("--workers", type=positive_int, default=4, help="logical workers")
    run.add_argument("--worker-processes", type=non_negative_int, default=0,
                     help="processes hosting them as threads; 0: min(workers, max(4, CPUs))")
    run.add_argument("--device", default="cpu", help="auto, cpu or cuda[:N] for workers")
    run.add_argument("--out", type=Path, default=None, help="default: runs/<run-id>")
    run.add_argument("--json", type=Path, default=None, help="also write the summary here")
    run.add_argument("--no-progress", action="store_true", help="no live progress bar")
    run.add_argument("--accept-poor-result", action="store_true",
                     help=f"exit 0 even when the run finishes with most gradients rejected or "
                          f"a test accuracy no better than chance (a warning either way; "
                          f"without this flag, exit code {EXIT_POOR_RESULT})")
    run.add_argument("--dashboard", nargs="?", type=positive_int, const=8000, default=None,
                     metavar="PORT", help="serve the live dashboard for this run on "
                     "http://127.0.0.1:PORT (default 8000), and after it until Ctrl-C")
    run.add_argument("--local-cluster", type=int, default=0, metavar="MASTERS",
                     help="start a private Redis Cluster of this many masters instead of "
                          "one private Redis (try --shards on the real topology); 0: no")
    run.add_argument("--tensorboard", type=Path, default=None, metavar="DIR",
                     help="also write the curves as TensorBoard scalars to DIR/<run-id> "
                          "(needs pip install 'gemq[tensorboard]')")
    _add_init_from(run)
    run.add_argument("--resume", default=None, metavar="RUN_DIR|RUN_ID",
                     help="continue an interrupted run with its whole state (parameters, "
                          "update count, GEM moments, curves): its folder (runs/<id>), or "
                          "with --redis-url, its id; training settings come from the run")
    add_config(run)

    create = _command(commands, "create", "create a run in Redis for remote workers",
                      "RUN=$(gemq create --redis-url redis://host:6379/0 --epochs 20)")
    add_settings(create, RUN_GROUPS)
    add_run(create, _NEW_RUN_ID)
    add_redis(create, required=True)
    create.add_argument("--workers", type=positive_int, default=PLANNED_WORKERS,
                        help="workers you plan to run: what the settings left at auto are "
                             "sized for")
    _add_init_from(create)
    add_config(create)

    aggregator = _command(commands, "aggregator", "aggregate one run (numpy only)",
                          "gemq aggregator --run $RUN --redis-url redis://host:6379/0")
    add_run(aggregator)
    add_redis(aggregator, required=True)
    aggregator.add_argument("--lease-ms", type=positive_int, default=5000,
                            help="the leader's lease; a standby takes over this long after "
                                 "the leader's last sign of life")
    aggregator.add_argument("--shard", type=int, default=None,
                            help="lead this shard of a sharded run only (default: every "
                                 "shard, one thread each; run one process per shard to "
                                 "spread them over cores or machines)")
    aggregator.add_argument("--serve", action="store_true",
                            help="the aggregator service: take runs' jobs off the rq queue")

    worker = _command(commands, "worker", "compute gradients for one run",
                      "gemq worker --run $RUN --redis-url redis://host:6379/0 --workers 4")
    add_run(worker)
    add_redis(worker, required=True)
    worker.add_argument("--workers", type=positive_int, default=1,
                        help="logical workers in this process (one thread each)")
    worker.add_argument("--worker-id", default=None, help="id prefix; default: host-pid")
    worker.add_argument("--device", default="cpu", help="auto, cpu or cuda[:N]")
    worker.add_argument("--follow", action="store_true",
                        help="the worker service: join whichever run is running, wait between "
                             "runs (with --run: only that run)")

    serve = _command(commands, "serve", "the REST API and live dashboard",
                     "gemq serve --redis-url redis://host:6379/0 --port 8000\n"
                     "  gemq serve --local      # and a private Redis, an aggregator and "
                     "workers: Start trains")
    add_redis(serve, required=True)
    serve.add_argument("--host", default=None, help="default 127.0.0.1; others need a token")
    serve.add_argument("--port", type=int, default=None, help="default 8000")
    serve.add_argument("--local", action="store_true",
                       help="instead of --redis-url: start a private Redis (in memory: its "
                            "runs go when gemq serve stops), an aggregator service and a "
                            "worker service beside the API, so that runs started from the "
                            "dashboard train on this machine")
    serve.add_argument("--workers", type=positive_int, default=DEFAULT_LOCAL_WORKERS,
                       help="with --local: the worker service's workers")

    status = _command(commands, "status", "print a run's state and counters as JSON",
                      "gemq status --run $RUN --redis-url redis://host:6379/0")
    add_run(status)
    add_redis(status, required=True)

    export = _command(commands, "export", "write a run's curves (its metrics stream) as CSV "
                      "or JSON lines",
                      "gemq export --run $RUN --redis-url redis://host:6379/0 --out curves.csv")
    add_run(export)
    add_redis(export, required=True)
    export.add_argument("--out", type=Path, default=None, metavar="FILE",
                        help="file to write; default: standard output")
    export.add_argument("--format", choices=FORMATS, default="csv",
                        help="csv (a header line, then a row per metrics entry) or jsonl (a "
                             "JSON object per row)")



    rm = _command(commands, "rm", "delete a run that is not running or queued: every key "
                  "it has in Redis", "gemq rm --run $RUN --redis-url redis://host:6379/0")
    add_run(rm)
    add_redis(rm, required=True)
    rm.add_argument("--force", action="store_true",
                    help="also a running or queued run whose aggregator and workers are gone "
                         "(no aggregator holds its lease, no worker was heard from for the "
                         "run's worker timeout)")


    simulate = add_simulate_parser(commands)
    add_config(simulate)
    _verbose(simulate, default=argparse.SUPPRESS)
    # A bad GEMQ_ variable is an error of the commands that read it, raised once one runs
    # (main): it must not break --help, nor the commands that have no such flag.
    for name, each in (("", parser), ("run", run), ("create", create),
                       ("aggregator", aggregator), ("worker", worker), ("status", status),
                       ("serve", serve), ("export", export), ("rm", rm),
                       ("simulate", simulate)):
        if name:
            parser.commands[name] = each
        try:
            apply_env_defaults(each, os.environ)
        except ConfigError as e:
            parser.env_errors[name] = e
    return parser


def _complete(parser: argparse.ArgumentParser) -> None:
    """Answer the shell's tab completion and exit, when the shell asks and the optional
    argcomplete package is there (pip install 'gemq[completion]'; see the README)."""
    if "_ARGCOMPLETE" not in os.environ:
        return
    try:
        import argcomplete
    except ImportError:
        return
    argcomplete.autocomplete(parser)


def main(argv: Sequence[str] | None = None) -> int:
    try:
        parser = build_parser()
        _complete(parser)
        args = parser.parse_args(argv)  # --help answers here, whatever the environment
        env_error = parser.env_errors.get("") or parser.env_errors.get(args.command)
        if env_error is not None:
            raise env_error
        if getattr(args, "config", None) is not None:  # its values, under the flags given
            given = sys.argv[1:] if argv is None else list(argv)
            apply_config_file(parser.commands[args.command], args.config, given)
            args = parser.parse_args(argv)
        service = (args.command == "serve" or getattr(args, "serve", False)
                   or getattr(args, "follow", False))
        if not service:  # a service sets up its logging from GEMQ_LOG_LEVEL and GEMQ_LOG_FORMAT
            logs.configure(logging.INFO if args.verbose else logging.WARNING)
        if args.command in USER_CODE_COMMANDS:
            _find_modules_in_the_working_directory()
        return int(COMMANDS[args.command](args) or 0)
    except ConfigError as e:
        print(f"gemq: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except GemqError as e:
        print(f"gemq: error: {e}", file=sys.stderr)
        return 1
    except redis.RedisError as e:  # what gemq does not wait out: a reply that is not Redis'
        print(f"gemq: error: Redis: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("gemq: interrupted", file=sys.stderr)
        return 130
    except Terminated as e:
        print(f"gemq: stopped by {e}", file=sys.stderr)
        return 128 + e.signum


#: The commands that import a user's ``module:factory`` specs (the API never does).
USER_CODE_COMMANDS = ("run", "create", "worker")


def _find_modules_in_the_working_directory() -> None:
    """``--model mymodels:net`` finds ./mymodels.py, as ``python -m`` would: the ``gemq``
    script's own folder, not the working directory, heads sys.path. Appended, so a local
    file never hides an installed package of the same name; worker processes inherit it."""
    here = os.getcwd()
    if not any(os.path.abspath(entry or ".") == here for entry in sys.path):
        sys.path.append(here)


def _require_url(args: argparse.Namespace) -> str:
    return required(args, "redis_url", "--redis-url")


def _require_run(args: argparse.Namespace) -> str:
    return required(args, "run_id", "--run")


def _run_settings(args: argparse.Namespace) -> dict[str, Any]:
    return {**settings_of(args, RUN_GROUPS), "run_id": args.run_id}


def _cmd_run(args: argparse.Namespace) -> int:
    with raise_on_termination():  # from the first moment: a SIGTERM while torch loads too
        summary = _resume(args) if args.resume else _train(args)
    if args.json:
        summary.write_json(args.json)
    _print_summary(summary)
    for problem in summary.problems:
        print(f"gemq: warning: {problem}", file=sys.stderr)
    if summary.problems and not args.accept_poor_result:
        print(f"gemq: exit code {EXIT_POOR_RESULT}: the run's result is poor "
              "(--accept-poor-result exits 0)", file=sys.stderr)
        return EXIT_POOR_RESULT
    return 0


def _train(args: argparse.Namespace) -> RunSummary:
    from gemq.running.local import train

    return train(workers=args.workers, worker_processes=args.worker_processes,
                 redis_url=args.redis_url, out_dir=args.out, progress=not args.no_progress,
                 device=args.device, init_from=args.init_from,
                 local_cluster=args.local_cluster, tensorboard=args.tensorboard,
                 dashboard=args.dashboard, **_run_settings(args))


def _resume(args: argparse.Namespace) -> RunSummary:
    from gemq.running.local import LocalOptions
    from gemq.running.resume import resume

    defaults = {s.name: s.default for s in USER_SETTINGS}
    given = sorted(name for name, value in _run_settings(args).items()
                   if value != defaults.get(name))
    given += ["init_from"] if args.init_from else []
    if given:
        flags = ", ".join("--run" if g == "run_id" else "--" + g.replace("_", "-")
                          for g in given)
        raise ConfigError("--resume", f"continues a run with its own settings; drop {flags} "
                                      "(or the GEMQ_ variables or --config keys that set them)")
    return resume(args.resume, LocalOptions(
        workers=args.workers, worker_processes=args.worker_processes,
        redis_url=args.redis_url, out_dir=args.out, progress=not args.no_progress,
        device=args.device, local_cluster=args.local_cluster,
        tensorboard=args.tensorboard, dashboard=args.dashboard))


def _print_summary(s: RunSummary) -> None:
    rejected = sum(s.rejected.values())
    baseline = (f", unigram baseline {s.baseline_loss:.4f}" if s.baseline_loss is not None
                else "")
    result = (f"test accuracy: {100 * s.test_accuracy:.1f}%"
              if s.test_accuracy is not None else f"test loss: {s.test_loss:.4f}{baseline}")
    state = "" if s.state == "finished" else f" (run {s.state})"
    print(f"{result} on {s.test_samples} held-out samples (train loss "
          f"{s.train_loss:.4f}){state}")
    print(f"updates: {s.updates_applied} applied, {rejected} rejected, {s.unused} unused "
          f"in {s.wall_time_s:.1f}s; mean staleness {s.staleness_mean:.1f}, "
          f"energy ratio {s.energy_ratio:.2f}")
    if s.workers_joined:
        print(f"workers: {s.workers} started here and {s.workers_joined} that joined from "
              "elsewhere (workers of the same Redis: a worker service or gemq worker)")
    print(f"model:   {s.model_path}")
    print(f"summary: {s.summary_path}")
    print(f"curves:  {s.metrics_path}")


def _cmd_create(args: argparse.Namespace) -> int:
    from gemq.running.runs import create_sized, initial_state
    from gemq.state.connection import COMMAND_WAIT_S, connect
    from gemq.training.data import load_dataset

    settings = _run_settings(args)
    validate_settings(settings)
    url = _require_url(args)
    data = load_dataset(args.dataset)
    config = make_config(settings, train_samples=len(data.train))  # type: ignore[arg-type]
    layout, state = initial_state(config, data, args.init_from)  # before Redis is touched
    client = connect(url, wait_s=COMMAND_WAIT_S)
    try:
        _, sizing = create_sized(client, config, layout, state,
                                 left_to_gemq=left_to_gemq(settings), workers=args.workers)
    except RunExists as e:
        raise GemqError(str(e)) from e
    finally:
        client.close()
    if sizing.differs_from_defaults():
        print(f"run {config.run_id}: {sizing.describe()}", file=sys.stderr)
    print(config.run_id)
    return 0


def _cmd_aggregator(args: argparse.Namespace) -> int:
    if args.serve:
        from gemq.services.aggregator import serve
        from gemq.services.settings import AggregatorServiceSettings, load

        serve(load(AggregatorServiceSettings, redis_url=args.redis_url,
                   lease_ms=args.lease_ms))
        return 0
    from gemq.aggregation.aggregator import AggregatorOptions, lead_shards
    from gemq.process import graceful_shutdown
    from gemq.state.connection import connect
    from gemq.state.retention import release_if_ended
    from gemq.state.store import ENDED, RunStore

    run_id, url = _require_run(args), _require_url(args)
    client = connect(url)
    try:
        shards = RunStore(client, run_id).shards()
        if args.shard is not None:
            if not 0 <= args.shard < len(shards):
                raise ConfigError("shard", f"run {run_id} has shards 0 to {len(shards) - 1}, "
                                           f"not {args.shard}")
            shards = [shards[args.shard]]
        shutdown = graceful_shutdown()
        finals = lead_shards(shards, AggregatorOptions(lease_ms=args.lease_ms), shutdown)
        for shard, final in zip(shards, finals, strict=True):
            release_if_ended(shard, final)
    finally:
        client.close()
    for shard, final in zip(shards, finals, strict=True):
        print(f"run {run_id}" + (f" shard {shard.shard}" if len(finals) > 1 else "")
              + f": {final}")
    return 0 if all(f in ENDED or f == "shutdown" for f in finals) else 1


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

    from gemq.process import graceful_shutdown
    from gemq.state.connection import connect
    from gemq.state.store import RunStore
    from gemq.training.worker import WorkerOptions, resolve_device, run_workers

    resolve_device(args.device)
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


@contextlib.contextmanager
def _run_client(args: argparse.Namespace) -> Iterator[tuple[str, Any]]:
    """The run id the command names and a client of its Redis, closed on the way out."""
    from gemq.state.connection import COMMAND_WAIT_S, connect

    run_id, url = _require_run(args), _require_url(args)
    client = connect(url, wait_s=COMMAND_WAIT_S)
    try:
        yield run_id, client
    finally:
        client.close()


def _cmd_status(args: argparse.Namespace) -> int:
    from gemq.records.summary import run_totals
    from gemq.state.store import RunStore

    with _run_client(args) as (run_id, client):
        store = RunStore(client, run_id)
        print(json.dumps({**run_totals(store), "workers": store.worker_states()}, indent=2))
    return 0


def _cmd_rm(args: argparse.Namespace) -> int:
    from gemq.errors import RunBusy
    from gemq.services.jobs import forget_job
    from gemq.state.retention import delete_run

    with _run_client(args) as (run_id, client):
        try:
            deleted = delete_run(client, run_id, force=args.force)
        except RunBusy as e:
            if e.reason != "busy" or args.force:
                raise
            raise GemqError(f"{e}; or, if its aggregator and workers are gone, delete it "
                            "with --force") from e
        forget_job(client, deleted.job_id)
    print(f"deleted run {run_id} ({deleted.keys} keys)")
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    from gemq.records.export import export_to_file, export_to_stdout
    from gemq.state.store import RunStore

    with _run_client(args) as (run_id, client):
        store = RunStore(client, run_id)
        if args.out is None:
            export_to_stdout(store, args.format, progress=True)
            return 0
        rows = export_to_file(store, args.out, args.format, progress=True)
    print(f"run {run_id}: {rows} rows written to {args.out}", file=sys.stderr)
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    from gemq.services.api.app import serve
    from gemq.services.settings import ApiSettings, load

    if not args.local:
        if not args.redis_url:
            raise ConfigError("--redis-url", "required for 'gemq serve' (or set "
                                             "GEMQ_REDIS_URL); or --local: a private Redis "
                                             "with an aggregator and workers")
        serve(load(ApiSettings, redis_url=args.redis_url, host=args.host, port=args.port))
        return 0
    if args.redis_url:
        raise ConfigError("--local", "starts a private Redis: give it or --redis-url, not both")
    from gemq import logs
    from gemq.ports import check_port_free
    from gemq.running.localservices import local_services
    from gemq.services.api.app import check_binding

    # The URL is the private Redis's, known once it runs.
    settings = load(ApiSettings, redis_url="redis://127.0.0.1", host=args.host, port=args.port)
    logs.configure(settings.log_level, settings.log_format)
    # Before anything starts: a refused host or a taken port is one line, not a Redis and
    # two services to stop.
    check_binding(settings)
    check_port_free(settings.host, settings.port, "choose another with --port")
    with local_services(args.workers) as url:
        serve(settings.model_copy(update={"redis_url": url}))
    return 0


COMMANDS = {"run": _cmd_run, "create": _cmd_create, "aggregator": _cmd_aggregator,
            "worker": _cmd_worker, "status": _cmd_status, "serve": _cmd_serve,
            "export": _cmd_export, "rm": _cmd_rm, "simulate": cmd_simulate}
