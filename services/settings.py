"""Settings of the deployable services, read from GEMQ_* environment variables.

Each service has one class; its fields are exactly the variables that service reads (the
Kubernetes manifests are checked against them).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar

from pydantic import Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from gemq.errors import ConfigError
from gemq.logs import LEVELS
from gemq.state.retention import RetentionPolicy

LOOPBACK = {"127.0.0.1", "::1", "localhost"}
PLACEHOLDER_SECRETS = {"changeme", "change-me", "secret", "token", "password", "xxx"}


class _GemqSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="GEMQ_", extra="ignore", frozen=True)

    redis_url: str = Field("redis://127.0.0.1:6379/0",
                           description="redis:// or rediss:// URL, password and user included")
    #: Records below this level are dropped: DEBUG, INFO, WARNING, ERROR or CRITICAL.
    log_level: str = "INFO"
    #: text: one readable line per record; json: one JSON object per line (gemq.logs).
    log_format: Literal["text", "json"] = "text"

    @field_validator("log_level")
    @classmethod
    def _known_level(cls, level: str) -> str:
        if level.strip().upper() not in LEVELS:
            raise ValueError(f"must be one of {', '.join(LEVELS)}")
        return level.strip().upper()


#: What GEMQ_QUEUE_URL says, for the services that use the rq queue.
QUEUE_URL_HELP = ("Redis holding the rq queue of aggregation jobs; default: redis_url. Set it "
                  "when redis_url is a Redis Cluster, which rq cannot use: a plain Redis "
                  "beside the cluster holds the queue, the cluster holds the runs")


class _QueueSettings(_GemqSettings):
    """The settings of the services that use the rq queue of aggregation jobs."""

    #: The rq queue aggregation jobs are enqueued on, and the Redis that holds it.
    aggregator_queue: str = "gemq-aggregator"
    queue_url: str | None = Field(None, description=QUEUE_URL_HELP)

    @field_validator("queue_url")
    @classmethod
    def _empty_is_none(cls, url: str | None) -> str | None:
        return url or None  # GEMQ_QUEUE_URL= (empty): the runs' Redis holds the queue


class ApiSettings(_QueueSettings):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    #: Bearer token for mutating endpoints; without one the API binds to loopback only.
    api_token: str | None = None
    #: GET endpoints under /api need no token (the dashboard can be watched read-only).
    open_reads: bool = True
    #: Accept ``package.module:factory`` models and datasets in API requests. Off by
    #: default: importing and calling a named function is running code chosen by the caller.
    allow_import_specs: bool = False
    #: Largest request body accepted, in bytes; a larger one is refused (413) unread. A run
    #: request is well under 1 KiB.
    max_body_bytes: int = Field(1 << 20, ge=1024)
    #: Seconds a request body may take to arrive in full; a slower one is refused (408) and
    #: its connection closed.
    body_timeout_s: float = Field(10.0, gt=0)
    #: Host names the service answers to besides loopback ones, comma-separated (for
    #: example the name an ingress or a tunnel reaches it by). Other names are refused (400):
    #: the defence against DNS rebinding. With a token set and this empty, any name passes.
    allowed_hosts: str = ""
    #: Ended runs kept in Redis, the most recently ended first; the service deletes older
    #: ones (docs/deploy.md has the memory arithmetic). 0: no limit.
    keep_runs: int = Field(RetentionPolicy.keep_runs, ge=0)
    #: Ended runs are deleted this many days after they ended. 0: no limit.
    keep_days: float = Field(RetentionPolicy.keep_days, ge=0)
    #: Seconds between two retention sweeps (the first comes at start-up).
    retention_interval_s: float = Field(60.0, gt=0)

    def retention(self) -> RetentionPolicy:
        return RetentionPolicy(keep_runs=self.keep_runs, keep_days=self.keep_days)

    def allowed_host_names(self) -> frozenset[str]:
        """GEMQ_ALLOWED_HOSTS as names: lower-cased, without spaces or a trailing dot."""
        return frozenset(n.strip().lower().rstrip(".") for n in self.allowed_hosts.split(",")
                         if n.strip())

    @field_validator("api_token")
    @classmethod
    def _no_placeholder(cls, token: str | None) -> str | None:
        if token is not None and (token.strip().lower() in PLACEHOLDER_SECRETS
                                  or len(token) < 16):
            raise ValueError("GEMQ_API_TOKEN must be a real secret of at least 16 "
                             "characters (for example: openssl rand -hex 24)")
        return token or None


#: Port of a service's own Prometheus endpoint (GET /metrics: its batch or step timings,
#: gemq/services/telemetry.py); unset: no endpoint. The Kubernetes manifests use 9110.
MetricsPort = Annotated[int | None, Field(ge=1, le=65535)]


class AggregatorServiceSettings(_QueueSettings):
    metrics_port: MetricsPort = None
    lease_ms: int = Field(5000, ge=100)
    #: Touched every few seconds while alive; `python -m gemq.services.probe` checks it.
    heartbeat_file: str = "/tmp/gemq-heartbeat"


class WorkerServiceSettings(_GemqSettings):
    #: Logical workers in this process (threads).
    workers: int = Field(1, ge=1, le=4096)
    #: Join only this run; default: whichever run is running, newest first.
    run: str | None = None
    device: str = "cpu"
    metrics_port: MetricsPort = None
    #: How often (s) an idle worker service looks for a running run.
    poll_s: float = Field(1.0, gt=0)
    #: Touched every few seconds while alive; `python -m gemq.services.probe` checks it.
    heartbeat_file: str = "/tmp/gemq-heartbeat"


SettingsT = TypeVar("SettingsT", bound=_GemqSettings)


def load(cls: type[SettingsT], **overrides: Any) -> SettingsT:
    """The settings from the environment, with explicit (non-None) overrides on top."""
    given = {k: v for k, v in overrides.items() if v is not None}
    try:
        return cls(**given)
    except ValidationError as e:
        error = e.errors()[0]
        field = str(error["loc"][0]) if error["loc"] else "settings"
        name = field if field in given else f"GEMQ_{field.upper()}"
        raise ConfigError(name, error["msg"]) from e
