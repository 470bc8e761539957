"""A full worker's intake and fair share (``Intake`` with ``policy.Capacity``): it peeks at what the
fair pick would hand it next and takes an entry whose tenant runs fewer requests than a running
one's by the margin, to displace that one, and nothing else."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import pytest

from shared.request_lifecycle import RequestStatus
from shared.schemas import QueuedRequest, SamplingSpec
from tests.worker.test_intake_in_process import MODEL, Harness, make_harness
from worker.engine.core.policy import EngineLoad, RunningLoad, Urgency


@pytest.fixture
def h(redis_url: str, key_prefix: str) -> Iterator[Harness]:
    harness = make_harness(redis_url, key_prefix)
    yield harness
    harness.publisher.stop()
    harness.client.close()
    harness.redis.close()


def submit(h: Harness, tenant: str) -> str:
    return h.client.submit(MODEL, [1, 2, 3], SamplingSpec(max_new_tokens=4), priority=1, tenant=tenant)


def full_of(*tenants: str) -> EngineLoad:
    """A full engine running one level-1 request of each of ``tenants``."""
    loads = {t: tenants.count(t) for t in tenants}
    running = tuple(
        RunningLoad(Urgency(1.0, n, share=float(n), tenant=t, load=float(loads[t])), 10) for n, t in enumerate(tenants)
    )
    return EngineLoad(max_num_seqs=len(tenants), block_size=4, num_seqs=len(tenants), spare_blocks=0, running=running)


def test_a_full_worker_takes_a_light_tenants_entry_to_displace_a_heavy_one(h: Harness) -> None:
    heavy = [submit(h, "heavy") for _ in range(3)]
    h.load = full_of("heavy", "heavy", "heavy")
    assert h.intake.read_once() == "blocked", "another of the heavy tenant's displaces nothing"
    light = submit(h, "light")
    assert h.intake.read_once() == "took"
    assert h.taken() == [light] and h.status(light) is RequestStatus.RUNNING
    assert all(h.status(r) is RequestStatus.QUEUED for r in heavy)


def test_a_full_worker_shared_as_evenly_as_its_slots_allow_takes_nothing(h: Harness) -> None:
    submit(h, "light")
    h.load = full_of("heavy", "light")
    assert h.intake.read_once() == "blocked"
    assert h.taken() == []


def test_a_full_worker_counts_the_entry_it_took_to_displace_until_the_engine_has_run_it(h: Harness) -> None:
    """The engine displaces for fair share once per few steps; meanwhile the entry taken for it waits in the
    engine. The intake counts it as its tenant's (as if it had taken its place), so a full worker polling in
    the meantime does not take the light tenant's entries one per poll past its share."""
    light = [submit(h, "light") for _ in range(2)]
    h.load = full_of("heavy", "heavy", "heavy")
    assert h.intake.read_once() == "took" and h.taken() == [light[0]]
    waiting_light = Urgency(1.0, 3, share=0.0, tenant="light")
    h.load = replace(full_of("heavy", "heavy", "heavy"), num_seqs=4, waiting=(waiting_light,))
    assert h.intake.read_once() == "blocked", "light runs 1 of 3 once that entry starts: another would be 2 of 3"
    assert h.status(light[1]) is RequestStatus.QUEUED


def test_a_full_worker_takes_a_light_tenants_entry_queued_behind_a_flooding_tenants_head(h: Harness) -> None:
    """The pull charges a tenant up front, so right after the light tenant's last pull its share is above the
    flooding tenant's, whose entries wait (the worker is full) and are charged nothing meanwhile: the fair pick's
    head is the flooding tenant's, which displaces nothing here. The pick passes over that tenant
    (``policy.passed_over``) and finds the light tenant's entry behind it, which runs 2 of 5 once it starts."""
    heavy = [submit(h, "heavy") for _ in range(3)]
    first = submit(h, "light")
    h.load = replace(full_of("heavy", "heavy", "heavy", "heavy"), num_seqs=3)  # one slot free
    assert h.intake.read_once() == "took" and h.taken() == [first], "the light tenant goes first at an equal share"
    second = submit(h, "light")
    h.load = full_of("heavy", "heavy", "heavy", "heavy", "light")
    peek = h.intake.pull(1, 1, idle=False, peek=True)
    assert [fields["tenant"] for _, _, fields, _ in peek] == ["heavy"], "the pick's head is the flooding tenant's"
    assert h.intake.read_once() == "took"
    assert h.taken() == [first, second] and h.status(second) is RequestStatus.RUNNING
    assert all(h.status(r) is RequestStatus.QUEUED for r in heavy)


def test_a_full_worker_leaves_a_tenant_at_the_edge_of_its_share_to_the_pull_when_another_is_first(h: Harness) -> None:
    """Weights 3:1: light runs 3 of 16 beside heavy's 13, its next entry would displace one of heavy's (4 of 12),
    but it is not far under heavy's share. With heavy's entry first in the pick, the full worker takes nothing:
    light waits for its turn in the pull's order, which keeps the pool's 3:1, rather than churn the slots."""
    queued = [
        QueuedRequest(model=MODEL, prompt_token_ids=[1, 2, 3], priority=1, tenant=tenant, tenant_weight=weight)
        for tenant, weight in (("heavy", 3.0), ("light", 1.0))
    ]
    for request in queued:
        h.client.enqueue(request)
    h.redis.hset(h.intake.keys.share(MODEL, 1), "light", 1e6)  # light served far more lately: heavy's entry first
    running = [Urgency(1.0, n, tenant="heavy", load=13 / 3, weight=3.0) for n in range(13)]
    running += [Urgency(1.0, 20 + n, tenant="light", load=3.0) for n in range(3)]
    h.load = EngineLoad(16, 4, 16, 0, tuple(RunningLoad(u, 10) for u in running))
    assert h.intake.read_once() == "blocked"
    assert h.taken() == [] and all(h.status(r.id) is RequestStatus.QUEUED for r in queued)
