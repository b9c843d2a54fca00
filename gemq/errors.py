"""The one exception hierarchy of gemq: every error the library raises on purpose."""


class GemqError(Exception):
    """Base class of every error gemq raises deliberately."""


class ConfigError(GemqError, ValueError):
    """A run configuration or flag value is invalid; the message names the field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class CodecError(GemqError):
    """A gradient message was refused; ``reason`` is a short machine-readable tag."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


class RedisUnavailable(GemqError):
    """Redis could not be reached (after retries); the message names the URL."""


class RunNotFound(GemqError):
    """No run with the given id exists in Redis."""


class RunExists(GemqError):
    """A run with the given id exists already."""


class RunLost(GemqError):
    """A run's committed state vanished from Redis (restarted without persistence?)."""


class PublishRefused(GemqError):
    """Redis would not add a worker's gradient to the run's stream (the message says why)."""


class FencedError(GemqError):
    """This aggregator no longer holds the run's lease; its writes were refused."""


class SpecError(GemqError):
    """A ``module:factory`` model or dataset spec could not be imported or used."""


class RunBusy(GemqError):
    """A run cannot be deleted now. ``reason``: ``busy`` (running or queued), ``led`` (an
    aggregator holds its lease) or ``workers`` (a worker may still write to it)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
