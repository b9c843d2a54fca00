"""Every Redis key and stream name gemq uses, built from one template per kind.

A run's parameters may be split into shards (gemq/shards.py). Each shard's keys share a
prefix whose braces are a Redis Cluster hash tag, ``gemq:{<run>}:`` for shard 0 and
``gemq:{<run>/<k>}:`` for shard k by default: a shard lives in one slot, so its
aggregator's commit script may touch all of its keys, and Redis Cluster places the shards
by their tags' slots. On a Redis Cluster, run creation may give shard k another tag of the
form ``<run>/<k>.<n>`` instead, one whose slot the master placement wants for the shard
serves (gemq/state/placement.py: round-robin over the masters); those tags are stored run-wide
(``shard_tags``) and every process finds shard k's keys through them. The run-wide keys
(configuration, layout, status, shard tags) live in shard 0's slot. A run of one shard has
exactly the keys it had before shards existed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from gemq.ids import is_valid_run_id

#: Index of every run, across runs (not part of any run's slot).
RUNS_INDEX = "gemq:runs"
#: The consumer group the aggregators read the gradient stream through.
AGGREGATOR_GROUP = "aggregators"
#: One consumer name shared by every aggregator of a run: only the lease holder reads, and a
#: new leader inherits the pending entries of the one it replaced.
AGGREGATOR_CONSUMER = "leader"
#: The two fields of a gradient stream entry: the worker id it was published under, and
#: the message (gemq/wire/codec.py). RunStore.publish writes them; the aggregator reads
#: them (a reply names them as bytes); nothing else spells them.
SENDER_FIELD = "w"
MESSAGE_FIELD = "m"


def shard_tag(run_id: str, shard: int, attempt: int = 0) -> str:
    """A hash tag shard ``shard`` of a run may have: the default one (``attempt`` 0), or
    another candidate of placement's (gemq/state/placement.py). Run ids cannot hold '/', so no
    run's tag is another's, and no shard's is another shard's."""
    if shard == 0:
        return run_id
    return f"{run_id}/{shard}" if attempt == 0 else f"{run_id}/{shard}.{attempt}"


@dataclass(frozen=True)
class RunKeys:
    """The key names of one shard of a run (shard 0: also the run-wide ones)."""

    run_id: str
    shard: int = 0
    #: The hash tag run creation placed the shard under (its ``shard_tags`` entry); None:
    #: the default tag.
    placed: str | None = None

    def __post_init__(self) -> None:
        # A stored tag is trusted only in the shape shard_tag makes: deletion finds a run's
        # keys by run_key_pattern, and no tag may name another run's or shard's keys.
        if self.placed is not None and not _is_tag_of(self.placed, self.run_id, self.shard):
            raise ValueError(f"{self.placed!r} is no hash tag of shard {self.shard} "
                             f"of run {self.run_id!r}")
        if self.placed == shard_tag(self.run_id, self.shard):  # one value per set of keys
            object.__setattr__(self, "placed", None)

    @property
    def prefix(self) -> str:
        return f"gemq:{{{self.tag}}}:"

    @property
    def tag(self) -> str:
        """The shard's hash tag: the one it was placed under, else the default."""
        return self.placed or shard_tag(self.run_id, self.shard)

    def _key(self, name: str) -> str:
        return self.prefix + name

    def _run_key(self, name: str) -> str:
        return f"gemq:{{{self.run_id}}}:{name}"

    @property
    def config(self) -> str:
        """JSON run configuration (string; run-wide)."""
        return self._run_key("config")

    @property
    def layout(self) -> str:
        """JSON parameter layout: names, shapes, offsets (string; run-wide)."""
        return self._run_key("layout")

    @property
    def status(self) -> str:
        """Run lifecycle hash: state, error, stop_requested, timestamps (run-wide)."""
        return self._run_key("status")

    @property
    def shard_tags(self) -> str:
        """Hash: shard index -> its hash tag, for each shard placed under another tag than
        its default (run-wide; absent when none was)."""
        return self._run_key("shard_tags")

    @property
    def head(self) -> str:
        """Hash: version (updates applied), last applied stream id, the shard's final state."""
        return self._key("head")

    def params(self, version: int) -> str:
        """Immutable float32 parameter snapshot published at ``version``."""
        return self._key(f"params:{version}")

    @property
    def versions(self) -> str:
        """Sorted set of the versions whose snapshots are still kept."""
        return self._key("versions")

    @property
    def gradients(self) -> str:
        """The gradient stream workers XADD to."""
        return self._key("gradients")

    @property
    def metrics(self) -> str:
        """Capped stream of one entry per committed batch."""
        return self._key("metrics")

    @property
    def counters(self) -> str:
        """Hash of run totals: published, applied, rejected:<reason>."""
        return self._key("counters")

    @property
    def workers(self) -> str:
        """Sorted set of the registered worker ids, by last contact."""
        return self._key("workers")

    def worker(self, worker_id: str) -> str:
        """Hash of one worker's state: heartbeat, steps, staleness, rejections."""
        return self._key(f"worker:{worker_id}")

    def staging(self, token: str) -> str:
        """Parameters on their way into a commit by the aggregator holding ``token``."""
        return self._key(f"staging:{token}")

    @property
    def evaluations(self) -> str:
        """List: held-out evaluations workers left for the next commits, oldest first, each
        a JSON array of field, value, field, value... (eval_updates, test_loss,
        test_accuracy); each commit moves one into its metrics entry."""
        return self._key("evaluations")

    @property
    def evaluation_claim(self) -> str:
        """The index (updates // eval_every) of the newest evaluation a worker has claimed."""
        return self._key("evaluation_claim")

    @property
    def moments(self) -> str:
        """Hash: worker id -> the version whose commit checkpointed its GEM moment."""
        return self._key("moments")

    def moment(self, worker_id: str) -> str:
        """A worker's checkpointed GEM moment (float32, the parameters' size)."""
        return self._key(f"moment:{worker_id}")

    def staged_moment(self, token: str, worker_id: str) -> str:
        """A moment on its way into a checkpointing commit by the leader holding ``token``."""
        return self._key(f"staging:{token}:moment:{worker_id}")

    @property
    def lease(self) -> str:
        """The aggregator lease: holds the leader's token, expires unless renewed."""
        return self._key("lease")


def _is_tag_of(tag: str, run_id: str, shard: int) -> bool:
    if shard == 0:
        return tag == run_id
    return re.fullmatch(rf"{re.escape(run_id)}/{shard}(\.[1-9][0-9]*)?", tag) is not None


def deletion_marker(run_id: str) -> str:
    """The key a deletion holds while it removes a run's keys: in shard 0's slot (its hash
    tag), and outside ``run_key_pattern``, so the removal does not take it too."""
    return f"gemq:deleting:{{{run_id}}}"


def run_key_pattern(run_id: str) -> str:
    """A SCAN MATCH pattern for every key of a run, of every shard: ``gemq:{<run>}:...``,
    ``gemq:{<run>/<k>}:...`` and ``gemq:{<run>/<k>.<n>}:...``. Run ids hold no glob
    characters, '/' or '}', so it matches no other run's keys; ``run_id`` must be valid
    (``is_valid_run_id``)."""
    if not is_valid_run_id(run_id):
        raise ValueError(f"not a run id: {run_id!r}")
    return f"gemq:{{{run_id}[}}/]*"
