"""The fair-share queue at the Redis level (``shared.work_queue``): the weighted fair pick between
tenants, the lift of a newly active tenant, a flood that does not hold a light tenant back, offers
and stealing, the per-tenant queued limit, the once-only settle, and the Lua against the rules
``policy.py`` states. Counted in pulls and tokens, never in seconds; ``test_fair_queue_on_cluster``
runs them again on a Redis Cluster."""

from __future__ import annotations

import random
import time
from collections import Counter

import pytest
import redis

from shared.client import QueueClient
from shared.errors import OverloadedError, TenantOverloadedError
from shared.keys import CONSUMER_GROUP, Keys
from shared.schemas import QueuedRequest, SamplingSpec
from shared.settings import Settings
from shared.work_queue import PULL, SETTLE, pull_args, pull_keys, request_cost, settle_keys
from tests.conftest import RedisBackend
from worker.engine.core.policy import Candidate, PassOver, charge, fair_pick, lift, offer_stealable, settle

MODEL = "m"
LEVEL = 1


@pytest.fixture
def queue_settings(redis_backend: RedisBackend, key_prefix: str) -> Settings:
    return Settings(
        redis_url=redis_backend.url, redis_cluster=redis_backend.cluster, key_prefix=key_prefix, max_queue_depth=100_000
    )


@pytest.fixture
def queue(queue_settings: Settings):
    with QueueClient(queue_settings) as client:
        yield client


def put(
    queue: QueueClient,
    tenant: str | None,
    *,
    weight: float = 1.0,
    prompt: int = 8,
    new: int = 8,
    offer_to: str | None = None,
    limit: int = 0,
    held: int = 0,
) -> str:
    request = QueuedRequest(
        model=MODEL,
        prompt_token_ids=[1] * prompt,
        sampling=SamplingSpec(max_new_tokens=new),
        priority=LEVEL,
        tenant=tenant,
        tenant_weight=weight,
    )
    return queue.enqueue(request, offer_to=offer_to, tenant_max_queued=limit, offered_tokens=held)


def pull(
    r: redis.Redis,
    keys: Keys,
    worker: str = "w1",
    count: int = 1,
    *,
    idle: bool = False,
    steal_after_ms: int = 60_000,
    peek: bool = False,
    prefill_ms_per_token: float = 0.0,
    passed_over: PassOver | None = None,
) -> list[tuple[str, str, dict[str, str], float]]:
    """What a worker's intake does (``Intake.pull``): (stream, entry id, fields, share) per pick."""
    args = pull_args(
        keys, MODEL, LEVEL, worker, count, idle=idle, steal_after_ms=steal_after_ms, peek=peek,
        prefill_ms_per_token=prefill_ms_per_token,
        cannot_displace=passed_over.cannot_displace if passed_over else (),
        at_the_edge=passed_over.at_the_edge if passed_over else (),
    )  # fmt: skip
    picks = r.eval(PULL, 8, *pull_keys(keys, MODEL, LEVEL, worker), *args)
    return [(s, e, dict(zip(f[::2], f[1::2], strict=True)), float(v)) for s, e, f, v, _ in picks]


def settle_entry(r: redis.Redis, keys: Keys, stream: str, entry_id: str, used: int) -> int:
    return int(r.eval(SETTLE, 3, *settle_keys(keys, stream), CONSUMER_GROUP, entry_id, used))


def tenant_of(pick: tuple[str, str, dict[str, str], float]) -> str:
    return pick[2]["tenant"]


def test_weights_3_to_1_both_backlogged_serve_tokens_3_to_1(queue, redis_client, keys) -> None:
    for _ in range(200):
        put(queue, "big", weight=3.0, prompt=30, new=10)
        put(queue, "small", weight=1.0, prompt=30, new=10)
    served: Counter[str] = Counter()
    for _ in range(10):  # 10 pulls of 8, as a worker with 8 free slots pulls
        for pick in pull(redis_client, keys, count=8):
            served[tenant_of(pick)] += int(pick[2]["cost"])
    assert served["big"] + served["small"] == 80 * 40
    assert abs(served["big"] / served["small"] / 3 - 1) <= 0.10, served


def test_a_flooding_tenant_does_not_hold_back_the_next_tenant(queue, redis_client, keys) -> None:
    for _ in range(200):
        put(queue, "flood")
    first = pull(redis_client, keys, count=3)
    assert [tenant_of(p) for p in first] == ["flood"] * 3
    put(queue, "light")
    assert tenant_of(pull(redis_client, keys)[0]) == "light", "the light tenant's request comes next, not 197 later"
    assert queue.tenant_waiting(MODEL) == {"flood": 197}


def test_a_full_workers_pick_passes_over_a_head_that_displaces_nothing_to_a_tenant_far_under_its_share(
    queue, redis_client, keys
) -> None:
    for _ in range(3):
        put(queue, "flood")
    for tenant in ("light", "edge"):
        put(queue, tenant)
        pull(redis_client, keys)  # its first, at the flood's share (fewer waiting): charged
        put(queue, tenant)  # its share is above the flood's now
    assert tenant_of(pull(redis_client, keys, peek=True)[0]) == "flood"
    full = PassOver(cannot_displace=frozenset({"flood"}), at_the_edge=frozenset({"edge"}))
    picks = pull(redis_client, keys, count=2, passed_over=full)
    assert [tenant_of(p) for p in picks] == ["light"], "never the flood's nor the edge tenant's, nor a second light"
    assert queue.tenant_waiting(MODEL) == {"flood": 3, "edge": 1}
    at_head = PassOver(cannot_displace=frozenset({"light"}), at_the_edge=frozenset({"flood"}))
    assert tenant_of(pull(redis_client, keys, passed_over=at_head)[0]) == "flood", "an edge tenant at the head: taken"
    assert [tenant_of(p) for p in pull(redis_client, keys, count=3)] == ["edge", "flood", "flood"], "the rest stay"


def test_a_request_of_a_tenant_with_nothing_waiting_wakes_a_full_worker_and_a_floods_next_ones_do_not(
    queue, redis_client, keys, queue_settings
) -> None:
    arrivals = keys.light_arrivals(MODEL)
    put(queue, "flood")
    put(queue, "flood")
    assert redis_client.llen(arrivals) == 1, "the flood's first only: its second finds one waiting"
    put(queue, "light")
    assert redis_client.llen(arrivals) == 2
    put(queue, None)
    assert redis_client.llen(arrivals) == 2, "no tenant: no share to be under"
    pull(redis_client, keys, count=3)  # light's taken (and one of the flood's): light has none waiting again
    put(queue, "light")
    assert redis_client.llen(arrivals) == 3
    with QueueClient(queue_settings.model_copy(update={"fair_share": False})) as fcfs:
        put(fcfs, "other")
    assert redis_client.llen(arrivals) == 3, "fair share off: nobody is woken for it"


def test_a_tenant_that_becomes_active_banks_no_credit_for_its_idle_time(queue, redis_client, keys) -> None:
    for _ in range(40):
        put(queue, "busy")
    for _ in range(20):
        pull(redis_client, keys)  # busy alone is served 20 requests while "late" is idle
    busy = queue.tenant_shares(MODEL, LEVEL)["busy"]
    for _ in range(20):
        put(queue, "late")
    assert queue.tenant_shares(MODEL, LEVEL)["late"] == busy, "lifted to the least share among the backlogged"
    order = [tenant_of(pull(redis_client, keys)[0]) for _ in range(10)]
    # Equal costs and weights: the two alternate, instead of "late" taking 20 in a row on banked credit.
    assert Counter(order) == {"busy": 5, "late": 5}, order


def test_requests_without_a_tenant_are_one_tenant_in_the_priority_stream(queue, redis_client, keys) -> None:
    ids = [put(queue, None) for _ in range(3)]
    assert redis_client.xlen(keys.stream(MODEL, LEVEL)) == 3, "a deployment without tenants has one stream per level"
    picks = pull(redis_client, keys, count=5)
    assert [p[1] for p in picks] == [e for e, _ in redis_client.xrange(keys.stream(MODEL, LEVEL))]
    assert [p[2]["request"] for p in picks] and len(ids) == 3
    assert queue.queue_depth(MODEL)[LEVEL] == 0


def test_settle_charges_what_was_used_once_however_often_it_runs(queue, redis_client, keys) -> None:
    put(queue, "t", weight=2.0, prompt=10, new=90)
    stream, entry_id, _, share = pull(redis_client, keys)[0]
    assert share == 0.0 and queue.tenant_shares(MODEL, LEVEL)["t"] == 50.0, "charged prompt + max_new_tokens / weight"
    assert settle_entry(redis_client, keys, stream, entry_id, used=30) == 1
    assert queue.tenant_shares(MODEL, LEVEL)["t"] == 15.0, "charged what it used: 30 tokens / 2"
    assert settle_entry(redis_client, keys, stream, entry_id, used=30) == 0, "the second settle finds no entry"
    assert queue.tenant_shares(MODEL, LEVEL)["t"] == 15.0
    assert redis_client.xlen(stream) == 0


def test_a_tenant_past_its_queued_limit_is_refused_alone(queue, redis_client, keys) -> None:
    for _ in range(3):
        put(queue, "greedy", limit=3)
    with pytest.raises(TenantOverloadedError) as refused:
        put(queue, "greedy", limit=3)
    assert isinstance(refused.value, OverloadedError) and refused.value.value == 3
    put(queue, "other", limit=3)  # another tenant is still taken
    assert sorted(tenant_of(p) for p in pull(redis_client, keys, count=2)) == ["greedy", "other"]
    assert tenant_of(pull(redis_client, keys, peek=True)[0]) == "greedy"
    assert queue.tenant_waiting(MODEL) == {"greedy": 2}, "a peek takes nothing"
    put(queue, "greedy", limit=3)  # one of its requests was taken by a worker: it may queue one more
    assert queue.tenant_waiting(MODEL) == {"greedy": 3}


def test_an_offer_goes_to_its_worker_first_and_is_stolen_after_the_bound(queue, redis_client, keys) -> None:
    redis_client.sadd(keys.held(MODEL, "w1"), "live")
    put(queue, "t")  # in the lane: older than the offer
    offered = put(queue, "t", offer_to="w1")
    assert redis_client.xlen(keys.offers(MODEL, LEVEL, "w1")) == 1
    picks = pull(redis_client, keys, "w1")
    assert picks[0][0] == keys.offers(MODEL, LEVEL, "w1"), "its own offer first among equal shares"
    assert offered in picks[0][2]["request"]

    put(queue, "t", offer_to="w1")
    assert tenant_of(pull(redis_client, keys, "w2")[0]) == "t"  # the lane's entry: the offer waits for w1
    assert pull(redis_client, keys, "w2") == [], "a busy worker leaves another's fresh offer"
    assert len(pull(redis_client, keys, "w2", idle=True, peek=True)) == 1, "an idle worker steals at once"
    assert len(pull(redis_client, keys, "w2", steal_after_ms=0, peek=True)) == 1, "past the bound anyone takes it"
    redis_client.delete(keys.held(MODEL, "w1"))  # w1 died: its offers go back to the pool at once
    stolen = pull(redis_client, keys, "w2")
    assert stolen and stolen[0][0] == keys.offers(MODEL, LEVEL, "w1")


def test_a_busy_worker_leaves_an_offer_as_long_as_prefilling_what_its_worker_holds_would_take(
    queue, redis_client, keys
) -> None:
    """Stealing an offer means computing the prefix its worker holds again: a busy worker waits the bound plus
    that time (its own prefill rate times the held tokens), an idle one takes it at once, as does anyone once
    its worker is gone; an offer for a short shared head is hardly held back."""
    redis_client.sadd(keys.held(MODEL, "w1"), "live")
    put(queue, "t", prompt=100, offer_to="w1", held=96)
    (entry,) = redis_client.xrange(keys.offers(MODEL, LEVEL, "w1"))
    assert entry[1]["held"] == "96"
    slow = 3_600_000.0  # ms per token: prefilling the prompt here would take longer than the test
    assert pull(redis_client, keys, "w2", steal_after_ms=0, prefill_ms_per_token=slow, peek=True) == []
    assert pull(redis_client, keys, "w2", steal_after_ms=0, peek=True), "past the bound at no prefill cost"
    assert pull(redis_client, keys, "w2", idle=True, steal_after_ms=0, prefill_ms_per_token=slow, peek=True)
    assert pull(redis_client, keys, "w2", idle=True, prefill_ms_per_token=slow, peek=True) == [], (
        "an idle worker waits for the holder as long as it would take to prefill the held prefix, up to the bound"
    )
    assert pull(redis_client, keys, "w2", idle=True, peek=True), "no prefill time to save: at once"
    redis_client.delete(keys.held(MODEL, "w1"))
    assert pull(redis_client, keys, "w2", steal_after_ms=60_000, prefill_ms_per_token=slow, peek=True)
    assert not offer_stealable(900, 500, owner_live=True, idle=False, held_tokens=96, prefill_ms_per_token=5.0)
    assert offer_stealable(980, 500, owner_live=True, idle=False, held_tokens=96, prefill_ms_per_token=5.0)
    assert offer_stealable(600, 500, owner_live=True, idle=False, held_tokens=16, prefill_ms_per_token=5.0)
    assert not offer_stealable(400, 500, owner_live=True, idle=True, held_tokens=96, prefill_ms_per_token=5.0)
    assert offer_stealable(480, 500, owner_live=True, idle=True, held_tokens=96, prefill_ms_per_token=5.0)
    assert offer_stealable(500, 500, owner_live=True, idle=True, held_tokens=960, prefill_ms_per_token=5.0)


def test_a_busy_worker_steals_an_offer_only_when_it_waited_the_bound_longer_than_its_own_work(
    queue, redis_client, keys
) -> None:
    """When the whole pool is backlogged every entry outlives the steal bound; taking the holder's offers
    then only trades them for the taker's own work and loses their cached prefixes. A busy worker steals an
    offer that waited the bound longer than the oldest work of its own that the pick ranks with it; a tenant
    further under its share than all of that is stolen for by its age alone, as before."""
    redis_client.sadd(keys.held(MODEL, "w1"), "live")
    offered = put(queue, "t", offer_to="w1")
    put(queue, "t")  # w2's own work, as old as the offer
    time.sleep(0.5)
    (pick,) = pull(redis_client, keys, "w2", steal_after_ms=300, peek=True)
    assert pick[0] == keys.lane(MODEL, LEVEL, "t"), "the offer is past the bound but no older than w2's work"
    own, stolen = pull(redis_client, keys, "w2", count=2, steal_after_ms=300)
    assert own[0] == pick[0] and stolen[0] == keys.offers(MODEL, LEVEL, "w1") and offered in stolen[2]["request"], (
        "with its own work taken, a second free slot steals it"
    )
    assert not offer_stealable(500, 300, owner_live=True, idle=False, own_wait_ms=499)
    assert offer_stealable(500, 300, owner_live=True, idle=False, own_wait_ms=200)

    for _ in range(3):
        put(queue, "flood")
    pull(redis_client, keys, "w2", count=1)  # the flood is now over the light tenant's share
    light = put(queue, "light", offer_to="w1")
    time.sleep(0.5)
    (pick,) = pull(redis_client, keys, "w2", steal_after_ms=300, peek=True)
    assert light in pick[2]["request"], "w2's own work is the flood's, further over its share: the offer's age decides"


def test_work_past_the_steal_bound_goes_before_a_workers_own_younger_offer(queue, redis_client, keys) -> None:
    """Affinity delays work nobody holds by the bound at most: a worker busy with its own offers would
    otherwise leave a first turn waiting without end."""
    redis_client.sadd(keys.held(MODEL, "w1"), "live")
    first_turn = put(queue, "t")
    put(queue, "t", offer_to="w1")
    (within,) = pull(redis_client, keys, "w1", peek=True)
    assert within[0] == keys.offers(MODEL, LEVEL, "w1"), "within the bound its own offer goes first"
    (overdue,) = pull(redis_client, keys, "w1", steal_after_ms=0)
    assert first_turn in overdue[2]["request"], "past it the older entry goes first"
    lane = Candidate(0.0, 2, False, 1, 0, overdue=True)
    offer = Candidate(0.0, 2, True, 2, 0)
    assert fair_pick([offer, lane]) == 1 and fair_pick([offer, lane._replace(overdue=False)]) == 0


def test_a_light_tenants_offer_behind_a_floods_offers_to_the_same_worker_is_picked_and_moves_to_its_lane(
    queue, redis_client, keys
) -> None:
    """Affinity sends a flooding tenant's requests (one shared prefix) to one worker's offer stream; a light
    tenant's request that the same worker holds goes behind them there. The pick sees each tenant's first
    offer, not the stream's head alone; the group delivers a stream in order, so the entry it takes from
    behind the head moves to its tenant's lane and is read from there."""
    redis_client.sadd(keys.held(MODEL, "w1"), "live")
    for _ in range(4):
        put(queue, "flood", offer_to="w1")
    pull(redis_client, keys, "w1", count=2)  # the flood runs two: its share is now above the light tenant's
    light = put(queue, "light", offer_to="w1")
    offers = keys.offers(MODEL, LEVEL, "w1")
    full = PassOver(frozenset({"flood"}), frozenset())  # a full worker: the flood's next displaces nothing
    (peeked,) = pull(redis_client, keys, "w1", peek=True, passed_over=full)
    assert (peeked[0], tenant_of(peeked)) == (offers, "light") and light in peeked[2]["request"], "behind the flood's"
    assert peeked[1] == [e for e, _ in redis_client.xrange(offers)][-1]
    assert redis_client.xlen(offers) == 5, "a peek moves nothing"
    assert [tenant_of(p) for p in pull(redis_client, keys, "w1", count=3, peek=True)] == ["light", "flood", "flood"]
    (taken,) = pull(redis_client, keys, "w1", passed_over=full)
    assert (taken[0], tenant_of(taken)) == (keys.lane(MODEL, LEVEL, "light"), "light") and light in taken[2]["request"]
    assert redis_client.xlen(offers) == 4 and peeked[1] not in [e for e, _ in redis_client.xrange(offers)]
    assert queue.tenant_waiting(MODEL) == {"flood": 2}
    assert settle_entry(redis_client, keys, taken[0], taken[1], used=16) == 1, "settled from its lane"
    assert [tenant_of(p) for p in pull(redis_client, keys, "w1", count=3)] == ["flood", "flood"]
    assert queue.queue_depth(MODEL)[LEVEL] == 0


def test_an_offer_to_a_worker_that_is_gone_goes_to_the_tenant_lane(queue, redis_client, keys) -> None:
    put(queue, "t", offer_to="nobody")
    assert redis_client.xlen(keys.lane(MODEL, LEVEL, "t")) == 1
    assert not redis_client.exists(keys.offers(MODEL, LEVEL, "nobody"))


def test_every_lane_and_offer_stream_is_in_the_lanes_set_with_its_group(queue, redis_client, keys) -> None:
    redis_client.sadd(keys.held(MODEL, "w1"), "live")
    put(queue, "a")
    put(queue, None)
    put(queue, "b", offer_to="w1")
    lanes = set(queue.lanes(MODEL))
    expected = {keys.lane(MODEL, LEVEL, "a"), keys.stream(MODEL, LEVEL), keys.offers(MODEL, LEVEL, "w1")}
    assert expected <= lanes
    for lane in expected:
        assert [g["name"] for g in redis_client.xinfo_groups(lane)] == [CONSUMER_GROUP]
    assert queue.queue_depth(MODEL)[LEVEL] == 3
    assert queue.oldest_waiting_age_s(MODEL) >= 0.0


def test_the_lua_pick_agrees_with_the_policy_rules_on_a_random_scenario(queue, redis_client, keys) -> None:
    """The same random enqueues, pulls and settles, in Redis and in ``policy.py``'s functions: the
    same picks in the same order, the same shares."""
    rng = random.Random(49)
    weights = {"a": 1.0, "b": 2.5, "c": 0.5, "d": 4.0}
    shares: dict[str, float] = {}
    # Per tenant, oldest first: (request id, entry id, cost, weight).
    waiting: dict[str, list[tuple[str, str, int, float]]] = {t: [] for t in weights}
    clock = 0.0
    running: list[tuple[str, str, str, int, float]] = []  # (stream, entry, tenant, cost, weight)
    for _ in range(300):
        op = rng.random()
        if op < 0.5:
            tenant = rng.choice(list(weights))
            prompt, new = rng.randint(1, 60), rng.randint(1, 60)
            request_id = put(queue, tenant, weight=weights[tenant], prompt=prompt, new=new)
            if not waiting[tenant]:
                backlogged = [shares[t] for t, queued in waiting.items() if queued]
                shares[tenant] = lift(shares.get(tenant, 0.0), backlogged, clock)
            entry_id = redis_client.xrevrange(keys.lane(MODEL, LEVEL, tenant), count=1)[0][0]
            waiting[tenant].append((request_id, entry_id, request_cost(prompt, new), weights[tenant]))
        elif op < 0.8:
            # Lanes are FIFO per tenant: a tenant's candidate is its oldest waiting request; the
            # script looks at them by share, then name (the backlog's order), the first of equals wins.
            heads = sorted(
                ((t, queued[0]) for t, queued in waiting.items() if queued), key=lambda h: (shares[h[0]], h[0])
            )
            candidates = [
                Candidate(shares[t], len(waiting[t]), False, *map(int, head[1].split("-"))) for t, head in heads
            ]
            expected = fair_pick(candidates)
            picks = pull(redis_client, keys)
            if expected is None:
                assert picks == []
                continue
            tenant, (request_id, _, cost, weight) = heads[expected]
            stream, entry_id, fields, share = picks[0]
            assert (fields["tenant"], request_id in fields["request"]) == (tenant, True)
            assert share == pytest.approx(shares[tenant])
            clock = max(clock, shares[tenant])
            shares[tenant] = charge(shares[tenant], cost, weight)
            waiting[tenant].pop(0)
            running.append((stream, entry_id, tenant, cost, weight))
        elif running:
            stream, entry_id, tenant, cost, weight = running.pop(rng.randrange(len(running)))
            used = rng.randint(1, cost)
            settle_entry(redis_client, keys, stream, entry_id, used)
            shares[tenant] = settle(shares[tenant], cost, used, weight)
        stored = queue.tenant_shares(MODEL, LEVEL)
        assert stored == pytest.approx(shares)


def test_offer_stealing_rule_in_policy() -> None:
    assert not offer_stealable(100, 500, owner_live=True, idle=False)
    assert offer_stealable(500, 500, owner_live=True, idle=False)
    assert offer_stealable(0, 500, owner_live=False, idle=False)
    assert offer_stealable(0, 500, owner_live=True, idle=True)
