"""The queue client: submit work, follow its tokens, collect results, cancel, look at queues.

Any service imports this to use the queue without HTTP; the API is a thin layer over it.
``QueueClient`` is synchronous; ``AsyncQueueClient`` (``shared.async_client``) has the same
methods as coroutines. Both only perform I/O: what they do is written once, in
``shared.client_core``; the request lifecycle they drive is ``shared.request_lifecycle``.

Following a request (``stream``) subscribes to its token channel first, then replays its log,
then follows live, de-duplicating by token index: no gap and no duplicate however late the
caller comes, and a request that is already final is replayed and ends. Call ``submit`` before
``stream`` for a new request (the log makes that race-free)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any, TypeVar, Unpack

import redis

from shared.client_core import CLIENT_SCRIPTS, QueueCore, SubmitOptions, redis_kwargs
from shared.event_delivery import AnyEvent, EventSequencer
from shared.redis_connect import connect
from shared.redis_plan import Emit, Plan, Steps, start
from shared.schemas import FinalResult, QueuedRequest, RequestInfo, SamplingSpec, WorkerHeartbeat
from shared.settings import Settings, get_settings
from shared.subscriptions import StreamSubscription

__all__ = ["QueueClient", "redis_kwargs"]

T = TypeVar("T")


class QueueClient:
    def __init__(self, settings: Settings | None = None, *, client: redis.Redis | None = None) -> None:
        self.settings = settings or get_settings()
        # A redis.Redis, or a redis.cluster.RedisCluster (INFLIGHTQ_REDIS_CLUSTER): same commands.
        self.redis: redis.Redis = client or connect(self.settings)  # type: ignore[assignment]
        self._core = QueueCore(self.settings)
        self.keys = self._core.keys
        self._scripts = {lua: self.redis.register_script(lua) for lua in CLIENT_SCRIPTS}

    def _perform(self, plan: Plan[Any], pubsub: StreamSubscription | None = None) -> Iterator[AnyEvent]:
        """Runs the plan's ops against Redis, yielding the events it emits."""
        while (op := plan.next()) is not None:
            if isinstance(op, Emit):
                yield from op.events
                continue
            try:
                plan.reply(start(op, self.redis, pubsub, self._scripts, time.sleep))
            except Exception as error:
                plan.fail(error)

    def _run(self, steps: Steps[T], pubsub: StreamSubscription | None = None) -> T:
        plan = Plan(steps)
        for _ in self._perform(plan, pubsub):
            pass
        return plan.value  # type: ignore[return-value]

    # Submitting --------------------------------------------------------------------
    def submit(
        self,
        model: str,
        prompt_token_ids: list[int],
        sampling: SamplingSpec | None = None,
        **options: Unpack[SubmitOptions],
    ) -> str:
        return self._run(self._core.submit(model, prompt_token_ids, sampling, **options))

    def enqueue(
        self,
        request: QueuedRequest,
        *,
        check_depth: bool = True,
        offer_to: str | None = None,
        tenant_max_queued: int | None = 0,
        offered_tokens: int = 0,
    ) -> str:
        """See ``QueueCore.enqueue``."""
        return self._run(
            self._core.enqueue(
                request,
                check_depth=check_depth,
                offer_to=offer_to,
                tenant_max_queued=tenant_max_queued,
                offered_tokens=offered_tokens,
            )
        )

    def ensure_groups(self, model: str) -> None:
        self._run(self._core.ensure_groups(model))

    # Following ---------------------------------------------------------------------
    def stream(self, request_id: str, from_index: int = 0, timeout: float | None = None) -> Iterator[AnyEvent]:
        """Every event of the request from ``from_index`` on, ending with its terminal event.
        ``timeout`` bounds the whole stream (TimeoutError past it)."""
        with StreamSubscription(self.redis) as pubsub:
            yield from self._perform(Plan(self._core.follow(request_id, from_index, timeout)), pubsub)

    def result(self, request_id: str, timeout: float | None = None) -> FinalResult:
        """Waits for the request to finish; raises the error type of its ErrorEvent."""
        with StreamSubscription(self.redis) as pubsub:
            return self._run(self._core.result(request_id, timeout), pubsub)

    def _idle_check(self, request_id: str, sequencer: EventSequencer) -> tuple[list[AnyEvent], bool]:
        return self._run(self._core.idle_check(request_id, sequencer))

    # Looking -----------------------------------------------------------------------
    def status(self, request_id: str) -> RequestInfo | None:
        return self._run(self._core.status(request_id))

    def cancel(self, request_id: str) -> bool:
        """True when the request was queued (now cancelled) or running (its worker is told)."""
        return self._run(self._core.cancel(request_id))

    def queue_depth(self, model: str) -> dict[int, int]:
        """Requests waiting (not yet taken by a worker), per priority."""
        return self._run(self._core.queue_depth(model))

    def lanes(self, model: str) -> list[str]:
        """Every lane and offer stream of the model, most urgent priority first."""
        return self._run(self._core.lanes(model))

    def tenant_waiting(self, model: str) -> dict[str, int]:
        return self._run(self._core.tenant_waiting(model))

    def tenant_shares(self, model: str, priority: int) -> dict[str, float]:
        return self._run(self._core.tenant_shares(model, priority))

    def oldest_waiting_age_s(self, model: str) -> float:
        """Age of the oldest request no worker has taken yet (0.0 when none waits)."""
        return self._run(self._core.oldest_waiting_age_s(model))

    def live_workers(self, model: str | None = None) -> list[WorkerHeartbeat]:
        return self._run(self._core.live_workers(model))

    def models(self) -> list[str]:
        return self._run(self._core.models())

    def dead_letters(self, model: str, count: int = 100) -> list[dict[str, str]]:
        return self._run(self._core.dead_letters(model, count))

    def ping(self) -> bool:
        return self._run(self._core.ping())

    def close(self) -> None:
        self.redis.close()

    def __enter__(self) -> QueueClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def __getattr__(name: str) -> Any:
    # The asyncio client lives in its own module; re-exported here lazily to avoid an import cycle.
    if name == "AsyncQueueClient":
        from shared.async_client import AsyncQueueClient

        return AsyncQueueClient
    raise AttributeError(name)
