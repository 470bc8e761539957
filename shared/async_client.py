"""The asyncio twin of ``shared.client.QueueClient``: the same methods, as coroutines
(``stream`` is an async generator). It performs the same plans (``shared.client_core``) with
redis.asyncio; see ``shared.client`` for the contract.

Unlike the sync client, every stream it follows shares one pub/sub connection per Redis node
(``shared.subscriptions.ChannelHub``): an API replica holds a handful of Redis connections however
many streams it has open."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any, TypeVar, Unpack

import redis
import redis.asyncio as aioredis

from shared.client_core import CLIENT_SCRIPTS, QueueCore, SubmitOptions
from shared.event_delivery import AnyEvent, EventSequencer
from shared.redis_connect import connect_async
from shared.redis_plan import Emit, Plan, Steps, start
from shared.schemas import FinalResult, QueuedRequest, RequestInfo, SamplingSpec, WorkerHeartbeat
from shared.settings import Settings, get_settings
from shared.subscriptions import ChannelHub, HubSubscription

T = TypeVar("T")


class AsyncQueueClient:
    def __init__(self, settings: Settings | None = None, *, client: aioredis.Redis | None = None) -> None:
        self.settings = settings or get_settings()
        # A redis.asyncio.Redis, or its RedisCluster (INFLIGHTQ_REDIS_CLUSTER): same commands, and
        # redis.asyncio's own Retry either way (``connect_async``).
        self.redis: aioredis.Redis = client or connect_async(self.settings)  # type: ignore[assignment]
        self.hub = ChannelHub(self.redis, self.settings.stream_buffer_bytes)
        self._core = QueueCore(self.settings)
        self.keys = self._core.keys
        self._scripts = {lua: self.redis.register_script(lua) for lua in CLIENT_SCRIPTS}

    async def _perform(self, plan: Plan[Any], pubsub: HubSubscription | None = None) -> AsyncIterator[AnyEvent]:
        while (op := plan.next()) is not None:
            if isinstance(op, Emit):
                for event in op.events:
                    yield event
            else:
                try:
                    plan.reply(await start(op, self.redis, pubsub, self._scripts, asyncio.sleep))
                except Exception as error:
                    plan.fail(_as_lost_connection(error) or error)

    async def _run(self, steps: Steps[T], pubsub: HubSubscription | None = None) -> T:
        plan = Plan(steps)
        async for _ in self._perform(plan, pubsub):
            pass
        return plan.value  # type: ignore[return-value]

    # Submitting --------------------------------------------------------------------
    async def submit(
        self,
        model: str,
        prompt_token_ids: list[int],
        sampling: SamplingSpec | None = None,
        **options: Unpack[SubmitOptions],
    ) -> str:
        return await self._run(self._core.submit(model, prompt_token_ids, sampling, **options))

    async def enqueue(
        self,
        request: QueuedRequest,
        *,
        check_depth: bool = True,
        offer_to: str | None = None,
        tenant_max_queued: int | None = 0,
        offered_tokens: int = 0,
    ) -> str:
        """See ``QueueCore.enqueue``."""
        return await self._run(
            self._core.enqueue(
                request,
                check_depth=check_depth,
                offer_to=offer_to,
                tenant_max_queued=tenant_max_queued,
                offered_tokens=offered_tokens,
            )
        )

    async def ensure_groups(self, model: str) -> None:
        await self._run(self._core.ensure_groups(model))

    # Following ---------------------------------------------------------------------
    async def stream(
        self, request_id: str, from_index: int = 0, timeout: float | None = None
    ) -> AsyncIterator[AnyEvent]:
        async with self.hub.subscription() as pubsub:
            async for event in self._perform(Plan(self._core.follow(request_id, from_index, timeout)), pubsub):
                yield event

    async def result(self, request_id: str, timeout: float | None = None) -> FinalResult:
        async with self.hub.subscription() as pubsub:
            return await self._run(self._core.result(request_id, timeout), pubsub)

    async def _idle_check(self, request_id: str, sequencer: EventSequencer) -> tuple[list[AnyEvent], bool]:
        return await self._run(self._core.idle_check(request_id, sequencer))

    # Looking -----------------------------------------------------------------------
    async def status(self, request_id: str) -> RequestInfo | None:
        return await self._run(self._core.status(request_id))

    async def cancel(self, request_id: str) -> bool:
        return await self._run(self._core.cancel(request_id))

    async def queue_depth(self, model: str) -> dict[int, int]:
        return await self._run(self._core.queue_depth(model))

    async def lanes(self, model: str) -> list[str]:
        """Every lane and offer stream of the model, most urgent priority first."""
        return await self._run(self._core.lanes(model))

    async def tenant_waiting(self, model: str) -> dict[str, int]:
        return await self._run(self._core.tenant_waiting(model))

    async def tenant_shares(self, model: str, priority: int) -> dict[str, float]:
        return await self._run(self._core.tenant_shares(model, priority))

    async def oldest_waiting_age_s(self, model: str) -> float:
        return await self._run(self._core.oldest_waiting_age_s(model))

    async def live_workers(self, model: str | None = None) -> list[WorkerHeartbeat]:
        return await self._run(self._core.live_workers(model))

    async def models(self) -> list[str]:
        return await self._run(self._core.models())

    async def dead_letters(self, model: str, count: int = 100) -> list[dict[str, str]]:
        return await self._run(self._core.dead_letters(model, count))

    async def ping(self) -> bool:
        return await self._run(self._core.ping())

    async def close(self) -> None:
        await self.hub.close()
        await self.redis.aclose()

    async def __aenter__(self) -> AsyncQueueClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def _as_lost_connection(error: Exception) -> redis.ConnectionError | None:
    """redis.asyncio tearing a connection down while another task is still opening it (seen during
    a Cluster failover: its writer is gone mid-handshake) raises AttributeError with asyncio's
    loop, and RuntimeError "unable to perform operation on <TCPTransport closed=True ...>" with
    uvloop's. Either is a lost connection, and the plan treats it as one (a 503 at the API, a pause
    for a follower) instead of a crashed request."""
    if isinstance(error, AttributeError) or (
        isinstance(error, RuntimeError) and "unable to perform operation on" in str(error)
    ):
        return redis.ConnectionError(f"connection lost while it was opened ({error})")
    return None
