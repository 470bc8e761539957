"""A worker's per-tenant metrics: tokens served and time to first token by tenant, with bounded labels
(the configured tenants and the first tenant_metrics_max others by name, later ones as "other")."""

from __future__ import annotations

import re

import httpx

from inflightq_cli.redis_server import free_port
from shared.client import QueueClient
from shared.tenant_labels import NO_TENANT, OTHER, TenantLabels
from tests.worker.conftest import greedy

PROMPT = [1, 2, 3, 4, 5]


def test_labels_keep_configured_and_first_tenants_then_fold_the_rest_into_other() -> None:
    labels = TenantLabels(["gold"], more=2)
    assert [labels(t) for t in ("a", "gold", "b", "c", "a", None, "d")] == [
        "a",
        "gold",
        "b",
        OTHER,
        "a",
        NO_TENANT,
        OTHER,
    ]
    folded = TenantLabels(["gold"], more=0).top({"gold": 1, "x": 5, "y": 3, "z": 2, "": 4}, 1)
    assert folded == {"gold": 1, "x": 5, OTHER: 5, NO_TENANT: 4}


def samples(text: str, name: str) -> dict[tuple[str, ...], float]:
    """Each sample of ``name``: its (tenant, kind-or-le) labels -> value."""
    found = {}
    for line in text.splitlines():
        match = re.fullmatch(name + r"\{(.*)\} (\S+)", line)
        if match:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', match.group(1)))
            found[(labels["tenant"], labels.get("kind", labels.get("le", "")))] = float(match.group(2))
    return found


def test_tokens_and_first_token_times_by_tenant_under_bounded_labels(spawn_worker, client: QueueClient) -> None:
    port = free_port()
    spawn_worker(
        "tenants",
        "--metrics-port",
        str(port),
        env={"INFLIGHTQ_TENANT_METRICS": "gold", "INFLIGHTQ_TENANT_METRICS_MAX": "1"},
    )
    model = client.settings.model
    # gold is named; "first" is the one further tenant labelled by name; "second" and "third" are "other".
    runs = [("gold", 3), ("first", 4), ("second", 5), ("third", 6), (None, 2)]
    ids = [client.submit(model, PROMPT, greedy(n), tenant=tenant) for tenant, n in runs]
    for request_id in ids:
        client.result(request_id, timeout=60)
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    tokens = samples(text, "inflightq_worker_tenant_tokens_total")
    assert {tenant for tenant, _ in tokens} == {"gold", "first", OTHER, NO_TENANT}
    assert tokens[("gold", "generated")] == 3 and tokens[("first", "generated")] == 4
    assert tokens[(OTHER, "generated")] == 5 + 6 and tokens[(NO_TENANT, "generated")] == 2
    assert tokens[(OTHER, "prompt")] == 2 * len(PROMPT)
    ttft = samples(text, "inflightq_worker_tenant_time_to_first_token_seconds_count")
    assert ttft == {("gold", ""): 1, ("first", ""): 1, (OTHER, ""): 2, (NO_TENANT, ""): 1}
