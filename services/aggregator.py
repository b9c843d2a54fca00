"""The aggregator service: an rq worker that takes aggregation jobs off the queue.

``gemq aggregator --serve`` or ``python -m services.aggregator``. Needs numpy, not torch.
"""

from __future__ import annotations

import logging
import os
import socket

from rq import Worker
from rq.serializers import JSONSerializer

from gemq.connection import connect, redact
from gemq.process import setup_logging
from services.jobs import queue
from services.probe import start_heartbeat
from services.settings import AggregatorServiceSettings, load

log = logging.getLogger(__name__)


def serve(settings: AggregatorServiceSettings) -> None:
    start_heartbeat(settings.heartbeat_file)
    client = connect(settings.redis_url, wait_s=float("inf"))
    name = f"gemq-aggregator-{socket.gethostname()}-{os.getpid()}"
    log.info("aggregator service %s: waiting for jobs on %r at %s", name,
             settings.aggregator_queue, redact(settings.redis_url))
    worker = Worker([queue(client, settings.aggregator_queue)], connection=client, name=name,
                    serializer=JSONSerializer)
    worker.work(with_scheduler=False, logging_level="INFO")


def main() -> None:
    setup_logging()
    serve(load(AggregatorServiceSettings))


if __name__ == "__main__":
    main()
