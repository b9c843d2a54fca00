"""Placing a new run's shards on a Redis Cluster's masters (gemq/state/placement.py), on slot maps
written out here; tests/test_cluster.py places runs on a real cluster."""

from __future__ import annotations

from collections import Counter

import redis
from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot

from gemq.state.keys import RunKeys, shard_tag
from gemq.state.placement import placed_tags, spread
from tests.helpers import small_run

#: What ``redis-cli --cluster create`` does with three masters: three equal runs of slots.
THIRDS: list[str | None] = [f"m{slot * 3 // REDIS_CLUSTER_HASH_SLOTS}"
                            for slot in range(REDIS_CLUSTER_HASH_SLOTS)]
RUN_IDS = [f"run-20261203-1942{i:02d}-{i * 7919:05x}" for i in range(20)]


def masters_of(run_id: str, count: int, owners: list[str | None]) -> list[str | None]:
    tags = spread(run_id, count, owners)
    return [owners[key_slot(RunKeys(run_id, k, tags.get(k)).head.encode())]
            for k in range(count)]


def test_three_shards_land_on_three_masters_whatever_the_run_id() -> None:
    for run_id in RUN_IDS:
        assert Counter(masters_of(run_id, 3, THIRDS)) == {"m0": 1, "m1": 1, "m2": 1}, run_id
    default = [len({THIRDS[key_slot(RunKeys(r, k).head.encode())] for k in range(3)})
               for r in RUN_IDS]
    assert min(default) < 3  # what the default tags alone would have done to some of them


def test_more_shards_than_masters_go_round_robin() -> None:
    for run_id in RUN_IDS[:5]:
        assert sorted(Counter(masters_of(run_id, 6, THIRDS)).values()) == [2, 2, 2]
        assert sorted(Counter(masters_of(run_id, 7, THIRDS)).values()) == [2, 2, 3]
        assert len(set(masters_of(run_id, 2, THIRDS))) == 2


def test_shards_spread_over_masters_of_very_unequal_slot_counts() -> None:
    owners: list[str | None] = ["tiny"] * 20 + ["big"] * 16_000
    owners += ["mid"] * (REDIS_CLUSTER_HASH_SLOTS - len(owners))
    for run_id in RUN_IDS[:5]:
        assert Counter(masters_of(run_id, 6, owners)) == {"tiny": 2, "big": 2, "mid": 2}


def test_shard_0_and_shards_already_in_place_keep_their_default_tags() -> None:
    for run_id in RUN_IDS:
        tags = spread(run_id, 3, THIRDS)
        assert 0 not in tags
        for k, tag in tags.items():
            assert tag.startswith(f"{run_id}/{k}.") and tag != shard_tag(run_id, k)
        assert spread(run_id, 3, THIRDS) == tags  # every creator would choose the same
    one_master: list[str | None] = ["only"] * REDIS_CLUSTER_HASH_SLOTS
    assert spread(RUN_IDS[0], 4, one_master) == {}


def test_a_plain_redis_places_nothing(redis_client: redis.Redis) -> None:
    store = small_run(redis_client, "plain", shards=3)
    assert placed_tags(store.client, "plain", 3) == {}
    assert [s.keys.tag for s in store.shards()] == ["plain", "plain/1", "plain/2"]
    assert not store.client.exists(store.keys.shard_tags)
