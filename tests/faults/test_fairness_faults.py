"""Fair share under faults, counted in requests and tokens (never seconds): a worker SIGKILLed in the
middle of a flood, and a Redis restart in the middle of one.

Each test queues every request before any worker pulls, so no tenant is lifted above 0 (each
becomes backlogged while the other's virtual time is still 0): a tenant's virtual time at the end is
then exactly the tokens its requests used (``usage.total_tokens``: prompt + generated) over its
weight. A re-run charged twice adds a whole request's cost; a re-run never charged, or a refund
applied twice, takes one away; either breaks the equality."""

from __future__ import annotations

import signal
from collections.abc import Callable

import pytest

from shared.client import QueueClient
from shared.request_builder import build_request
from shared.request_lifecycle import RequestStatus
from shared.schemas import RequestInfo, SamplingSpec
from tests.worker import paced_worker, slow_worker
from tests.worker.test_worker import tokens_sent, wait_for

FLOOD, LIGHT = "flood", "light"


def queue(
    client: QueueClient, tenant: str, weight: float, count: int, sampling: Callable[[int], SamplingSpec]
) -> list[str]:
    """``count`` requests of ``tenant`` (prompts of 4 tokens), enqueued as the API enqueues them."""
    ids = []
    for i in range(count):
        prompt = [10 + i, 200 + 7 * i, 3000 + (i if tenant == FLOOD else 500 + i), 42]
        request = build_request(client.settings, client.settings.model, prompt, sampling(i), tenant=tenant)
        request = request.model_copy(update={"tenant_weight": weight})
        client.enqueue(request)
        ids.append(request.id)
    return ids


def finished(client: QueueClient, ids: list[str]) -> list[RequestInfo]:
    infos = [client.status(rid) for rid in ids]
    assert all(i is not None and i.status is RequestStatus.DONE for i in infos), [
        (i.id, i.status, i.error) for i in infos if i is not None and i.status is not RequestStatus.DONE
    ]
    return infos  # type: ignore[return-value]


def used(infos: list[RequestInfo]) -> int:
    return sum(i.result.usage.total_tokens for i in infos)  # type: ignore[union-attr]


def after_the_last(infos: list[RequestInfo], light: list[RequestInfo]) -> int:
    """How many of ``infos`` finished after every ``light`` request had finished."""
    last = max(i.finished_at for i in light)  # type: ignore[type-var]
    return sum(i.finished_at > last for i in infos)  # type: ignore[operator]


def test_a_worker_killed_mid_flood_leaves_every_request_charged_once(spawn_worker, client, reference) -> None:
    flood_n, light_n, seqs = 40, 6, 4
    model, prefix = client.settings.model, client.settings.key_prefix

    def stops_early(i: int) -> SamplingSpec:
        # Half stop at a token the tiny model generates (charged less than their cost: the refund counts).
        n = 12
        if i % 2:
            return SamplingSpec(max_new_tokens=n)
        prompt = [10 + i, 200 + 7 * i, 3000 + i, 42]
        return SamplingSpec(max_new_tokens=n, stop_token_ids=[reference(prompt, n)[3]])

    flood = queue(client, FLOOD, 1.0, flood_n, stops_early)
    light = queue(client, LIGHT, 2.0, light_n, lambda i: SamplingSpec(max_new_tokens=12))
    assert client.tenant_waiting(model) == {FLOOD: flood_n, LIGHT: light_n}

    env = {"INFLIGHTQ_MAX_NUM_SEQS": str(seqs), "INFLIGHTQ_PREFETCH_SEQS": "0"}
    dying = spawn_worker("dying", env=env, script=paced_worker.SCRIPT)
    wait_for(lambda: sum(client.tenant_waiting(model).values()) == flood_n + light_n - seqs, timeout=60)

    def taken() -> list[str]:
        return [rid for rid in flood + light if (info := client.status(rid)) and info.worker == "dying"]

    wait_for(lambda: len(taken()) == seqs, timeout=60)
    held = taken()
    for rid in held:  # the prefill and two decode steps each: killed mid-generation
        paced_worker.allow_steps(client.redis, prefix, rid, 3)
    wait_for(lambda: all(tokens_sent(client, rid) >= 2 for rid in held), timeout=60)
    charged_before = client.tenant_shares(model, client.status(held[0]).priority)  # type: ignore[union-attr]
    dying.signal(signal.SIGKILL)
    dying.wait(timeout=10)

    spawn_worker("heir", env=env)
    for rid in flood + light:
        client.result(rid, timeout=180)
    flood_infos, light_infos = finished(client, flood), finished(client, light)
    priority = flood_infos[0].priority
    shares = client.tenant_shares(model, priority)

    rerun = [i for i in flood_infos + light_infos if i.attempt > 0]
    assert sorted(i.id for i in rerun) == sorted(held) and all(i.worker == "heir" for i in rerun)
    # The dying worker's pulls were charged (cost / weight each) and the heir's re-runs were not charged again.
    assert sum(charged_before.values()) > 0
    refunded = sum(i.result.usage.total_tokens < 4 + 12 for i in flood_infos)  # type: ignore[union-attr]
    assert refunded > 0, "no request stopped early: the refund was not exercised"
    assert shares[FLOOD] == pytest.approx(used(flood_infos) / 1.0, rel=1e-9)
    assert shares[LIGHT] == pytest.approx(used(light_infos) / 2.0, rel=1e-9)
    assert client.tenant_waiting(model).get(FLOOD, 0) == client.tenant_waiting(model).get(LIGHT, 0) == 0
    # Fair share went on beside the takeover: the light requests the heir pulled itself did not wait behind
    # the flood's backlog (the re-runs wait for the dead worker's heartbeat to lapse, in seconds, not turns).
    behind = after_the_last(flood_infos, [i for i in light_infos if i.attempt == 0])
    assert behind >= flood_n // 2, f"only {behind} flood requests finished after the last light one"
    print(
        f"FAULTS fairness, worker killed mid-flood: {len(rerun)} re-run, {flood_n + light_n} requests charged once "
        f"(flood {shares[FLOOD]:.0f} = {used(flood_infos)} tokens, light {shares[LIGHT]:.1f} = "
        f"{used(light_infos)} / 2); {behind} of {flood_n} flood requests finished after the last light one"
    )


def test_a_redis_restart_mid_flood_keeps_the_counters_and_the_weights(spawn_worker, settings, tmp_path) -> None:
    from inflightq_cli.redis_server import free_port
    from tests.worker.test_redis_outage import persistent_redis

    heavy_n, light_n, seqs, tokens = 40, 40, 4, 8
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    with persistent_redis(port, tmp_path) as first:
        client = QueueClient(settings.model_copy(update={"redis_url": url}))
        model = client.settings.model

        def same(i: int) -> SamplingSpec:  # every request costs and uses 4 + 8 tokens
            return SamplingSpec(max_new_tokens=tokens, ignore_eos=True)

        heavy = queue(client, FLOOD, 3.0, heavy_n, same)
        light = queue(client, LIGHT, 1.0, light_n, same)
        env = {
            "INFLIGHTQ_MAX_NUM_SEQS": str(seqs),
            "INFLIGHTQ_PREFETCH_SEQS": "0",
            "INFLIGHTQ_TEST_STEP_S": "0.02",
            "INFLIGHTQ_REDIS_OUTAGE_GRACE_S": "60",
        }
        spawn_worker("steady", url=url, env=env, script=slow_worker.SCRIPT)
        done = lambda: sum(  # noqa: E731
            (i := client.status(rid)) is not None and i.status is RequestStatus.DONE for rid in heavy + light
        )
        wait_for(lambda: done() >= 8, timeout=120)
        before = done()
        first.terminate()  # a clean shutdown: the append-only file keeps the counters
        first.wait(timeout=10)
        assert before < 2 * (heavy_n // 3), "the flood must still be backlogged when Redis goes away"
        with persistent_redis(port, tmp_path):
            for rid in heavy + light:
                client.result(rid, timeout=300)
            heavy_infos, light_infos = finished(client, heavy), finished(client, light)
            shares = client.tenant_shares(model, heavy_infos[0].priority)
            client.close()
    assert used(heavy_infos) == used(light_infos) == 40 * (4 + tokens)
    assert shares[FLOOD] == pytest.approx(used(heavy_infos) / 3.0, rel=1e-9)
    assert shares[LIGHT] == pytest.approx(used(light_infos) / 1.0, rel=1e-9)
    # Weights 3:1 across the restart: while both were backlogged (the first 40 requests to finish), the
    # heavy tenant had three of every four, give or take the batch in flight at either end.
    first_half = sorted(heavy_infos + light_infos, key=lambda i: i.finished_at)[:40]  # type: ignore[arg-type, return-value]
    heavy_share = sum(i.tenant == FLOOD for i in first_half)
    assert 30 - seqs <= heavy_share <= 30 + seqs, f"{heavy_share} of the first 40 were the weight-3 tenant's"
    print(
        f"FAULTS fairness, Redis restart mid-flood after {before} of 80 requests: every request charged once "
        f"(weight 3: {shares[FLOOD]:.1f} = {used(heavy_infos)} / 3; weight 1: {shares[LIGHT]:.0f}); "
        f"{heavy_share} of the first 40 finished were the weight-3 tenant's (3:1 = 30)"
    )
