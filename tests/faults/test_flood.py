"""A flood past the queue limit: every submit past max_queue_depth gets 429 with Retry-After,
and every one accepted is in Redis (nothing lost, no limit overshoot under concurrency)."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable

import httpx

from shared.client import QueueClient
from shared.settings import Settings
from tests.api.conftest import ApiServer
from tests.faults.conftest import scale


def test_a_flood_past_the_queue_limit_is_refused_cleanly(
    settings: Settings, start_api: Callable[[Settings], ApiServer]
) -> None:
    limit, submits = 50, scale(300, 1500)
    api = start_api(settings.model_copy(update={"max_queue_depth": limit}))

    async def flood() -> list[httpx.Response]:
        limits = httpx.Limits(max_connections=100)
        async with httpx.AsyncClient(base_url=api.url, timeout=120, limits=limits) as http:
            body = {"prompt": "Go", "max_new_tokens": 4}
            return await asyncio.gather(*(http.post("/v1/jobs", json=body) for _ in range(submits)))

    answers = asyncio.run(flood())
    codes = Counter(r.status_code for r in answers)
    assert codes == {202: limit, 429: submits - limit}, codes
    assert all(r.headers.get("retry-after") for r in answers if r.status_code == 429)
    accepted = [r.json()["id"] for r in answers if r.status_code == 202]
    with QueueClient(settings) as client:
        assert sum(client.queue_depth(settings.model).values()) == limit
        assert all(client.status(rid).status.value == "queued" for rid in accepted)  # type: ignore[union-attr]
    print(
        f"FAULTS flood: {submits} concurrent job submits, limit {limit}: {codes[202]} accepted (all queued), "
        f"{codes[429]} x 429 with Retry-After, lost 0"
    )
