"""The API's use of the queue client: dispatch (to a live worker, within the queue's depth),
follow events, and cancel whatever a client walked away from.

Routes stay thin: they translate bodies into requests (``shared.request_builder``) and events into
their wire shapes."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import anyio

from producer_api import metrics
from producer_api.affinity import Affinity
from producer_api.api_keys import ApiKey, RateLimiter
from producer_api.tenants import Tenants
from shared.errors import CancelledError, ExpiredError, LimitError, OverloadedError, UnavailableError, error_from_type
from shared.schemas import AnyEvent, DoneEvent, ErrorEvent, FinalResult, QueuedRequest, TokenEvent, WorkerHeartbeat
from shared.settings import Settings

# A live worker seen this recently is trusted without asking Redis again.
_LIVE_CACHE_S = 1.0
# Beyond a request's own deadline, how long we wait for the worker's "expired" event.
_DEADLINE_GRACE_S = 5.0
_CANCEL_TIMEOUT_S = 2.0
# How often, while streams of a model are followed, the API checks that a worker still serves it.
_WATCH_S = 2.0
# How long one answer to "does a worker serve this model?" is reused: concurrent askers (the
# model's WorkerWatch, anything else asking) share one Redis query.
_SERVED_CACHE_S = 1.0


@dataclass
class Generation:
    """A finished request as the non-streaming routes need it: its tokens (with logprobs) and result."""

    request_id: str
    tokens: list[TokenEvent] = field(default_factory=list)
    result: FinalResult | None = None


class ClientDisconnected(CancelledError):
    def __init__(self) -> None:
        super().__init__("the client disconnected")


def submitted_tokens(requests: list[QueuedRequest]) -> int:
    """What a key's tokens per minute counts at submission: prompt tokens plus max_new_tokens."""
    return sum(len(r.prompt_token_ids) + r.sampling.max_new_tokens for r in requests)


class Dispatcher:
    def __init__(
        self, settings: Settings, client: Any, *, tenants: Tenants | None = None, limiter: RateLimiter | None = None
    ) -> None:
        self.settings = settings
        self.client = client
        self.tenants = tenants or Tenants(settings, [])
        self.limiter = limiter
        self._live: dict[str, tuple[float, list[WorkerHeartbeat]]] = {}
        self._served: dict[str, tuple[float, asyncio.Future[bool]]] = {}
        self._watches: dict[str, WorkerWatch] = {}
        self._affinity: Affinity | None = None

    async def live_workers(self, model: str | None = None) -> list[WorkerHeartbeat]:
        workers = await self.client.live_workers(model)
        return [w for w in workers if not w.draining]

    async def wait_for_worker(self, model: str) -> list[WorkerHeartbeat]:
        """Live workers of ``model``, waiting up to no_worker_wait_s for one to appear, else 503."""
        cached = self._live.get(model)
        if cached and time.monotonic() - cached[0] < _LIVE_CACHE_S:
            return cached[1]
        give_up = time.monotonic() + self.settings.no_worker_wait_s
        while True:
            workers = await self.live_workers(model)
            if workers:
                self._live[model] = (time.monotonic(), workers)
                return workers
            left = give_up - time.monotonic()
            if left <= 0:
                raise UnavailableError(f"no live worker serves model {model!r}")
            await asyncio.sleep(min(0.25, left))

    async def is_served(self, model: str) -> bool:
        """Whether any worker, draining ones included, serves ``model``; concurrent askers within
        _SERVED_CACHE_S share one query (a failed query is not cached)."""
        cached = self._served.get(model)
        if cached is None or time.monotonic() - cached[0] >= _SERVED_CACHE_S:

            async def ask() -> bool:
                return bool(await self.client.live_workers(model))

            cached = (time.monotonic(), asyncio.ensure_future(ask()))
            self._served[model] = cached
        try:
            return await asyncio.shield(cached[1])
        except Exception:
            if self._served.get(model) is cached:
                del self._served[model]
            raise

    def device_of(self, model: str, worker: str | None) -> str:
        for heartbeat in self._live.get(model, (0.0, []))[1]:
            if heartbeat.name == worker:
                return heartbeat.device
        return "unknown"

    async def submit(self, request: QueuedRequest, *, need_worker: bool = True, key: ApiKey | None = None) -> str:
        """Queues a request the route built (``shared.request_builder``) as its tenant, with the
        tenant's weight and queued limit; charges ``key``'s tokens per minute (``key=None``: none,
        or already charged). Its id."""
        if need_worker:
            workers = await self.wait_for_worker(request.model)
        else:  # affinity picks among the workers seen last (none: no offer)
            workers = self._live.get(request.model, (0.0, []))[1]
        terms = self.tenants.terms(request.tenant)
        request.tenant_weight = terms.weight
        try:
            if key is not None and self.limiter is not None:
                await self.limiter.charge_tokens(key, submitted_tokens([request]))
            # Only when set: the tenant's queued limit is the enqueue script's argument.
            options: dict[str, Any] = {} if terms.max_queued is None else {"tenant_max_queued": terms.max_queued}
            offer_to, held = await self.offer(request, workers)
            if offer_to is not None:
                options |= {"offer_to": offer_to, "offered_tokens": held}
            request_id: str = await self.client.enqueue(request, **options)
        except (LimitError, OverloadedError) as error:
            metrics.TENANT_REJECTIONS.labels(self.tenants.labels(request.tenant), error.code).inc()
            raise
        metrics.SUBMITTED.labels(request.model, str(request.priority)).inc()
        metrics.PROMPT_TOKENS.labels(request.model).inc(len(request.prompt_token_ids))
        return request_id

    async def offer_to(self, request: QueuedRequest, workers: list[WorkerHeartbeat]) -> str | None:
        """The live worker holding the longest prefix of ``request`` (``producer_api.affinity``), if any."""
        return (await self.offer(request, workers))[0]

    async def offer(self, request: QueuedRequest, workers: list[WorkerHeartbeat]) -> tuple[str | None, int]:
        """That worker (None: no offer) and the prompt tokens it holds cached."""
        if not self.settings.affinity:
            return None, 0
        if self._affinity is None:
            self._affinity = Affinity(self.settings, self.client.redis)
        return await self._affinity.offer(request, workers)

    async def submit_all(self, requests: list[QueuedRequest], *, key: ApiKey | None = None) -> list[str]:
        """All or nothing: if one of n choices is refused (429), the accepted ones are cancelled.
        ``key``'s tokens per minute are charged for all of them at once, before any is queued."""
        ids: list[str] = []
        if requests:
            await self.wait_for_worker(requests[0].model)
        if key is not None and self.limiter is not None:
            try:
                await self.limiter.charge_tokens(key, submitted_tokens(requests))
            except LimitError as error:
                metrics.TENANT_REJECTIONS.labels(self.tenants.labels(key.tenant), error.code).inc()
                raise
        try:
            for request in requests:
                ids.append(await self.submit(request))
        except BaseException:
            for request_id in ids:
                await self.cancel_quietly(request_id)
            raise
        return ids

    async def cancel_quietly(self, request_id: str) -> None:
        # Shielded: this runs while the surrounding task is being cancelled (client gone).
        with anyio.CancelScope(shield=True), anyio.move_on_after(_CANCEL_TIMEOUT_S):
            try:
                await self.client.cancel(request_id)
            except Exception:  # best effort: the deadline or the result TTL cleans up otherwise
                pass

    async def events(
        self,
        request_id: str,
        *,
        route: str,
        model: str,
        started: float,
        from_index: int = 0,
        deadline: float | None = None,
        cancel_if_unfinished: bool = True,
    ) -> AsyncIterator[AnyEvent]:
        """The request's events until its terminal one; cancels the request if the consumer stops early."""
        timeout = None if deadline is None else max(0.0, deadline - time.time()) + _DEADLINE_GRACE_S
        finished = False
        last_token_at: float | None = None
        stream = self.client.stream(request_id, from_index=from_index, timeout=timeout)
        try:
            try:
                async for event in self._watched(stream, model):
                    if isinstance(event, TokenEvent):
                        now = time.perf_counter()
                        if last_token_at is None:
                            metrics.TIME_TO_FIRST_TOKEN.labels(route).observe(now - started)
                        else:
                            metrics.INTER_TOKEN_LATENCY.labels(route).observe(now - last_token_at)
                        last_token_at = now
                        metrics.GENERATED_TOKENS.labels(model).inc()
                    else:
                        finished = True
                        if isinstance(event, DoneEvent):
                            metrics.QUEUE_TIME.labels(model).observe(event.result.timings.queue_time_s)
                            if (done_at := event.result.timings.finished_at) is not None:
                                metrics.E2E_LATENCY.labels(model).observe(done_at - event.result.timings.submitted_at)
                    yield event
                    if finished:
                        return
            except TimeoutError:
                raise ExpiredError("the request's deadline passed before it finished") from None
            if not finished:
                raise UnavailableError("the token stream ended before the request finished")
        finally:
            # Shielded: this runs while the consumer is being cancelled (its client left).
            with anyio.CancelScope(shield=True):
                with anyio.move_on_after(_CANCEL_TIMEOUT_S), contextlib.suppress(Exception):
                    await stream.aclose()
                if not finished and cancel_if_unfinished:
                    metrics.CANCELLED_ON_DISCONNECT.inc()
                    await self.cancel_quietly(request_id)

    async def _watched(self, stream: AsyncIterator[AnyEvent], model: str) -> AsyncIterator[AnyEvent]:
        """``stream``'s events, unless every worker of the model is gone for no_worker_wait_s: then
        503 instead of waiting forever. (A dead worker's request is taken over by a live one, so a
        live worker means progress will come.) The model's ``WorkerWatch`` checks for all its
        streams at once; a silent stream itself sets no timer."""
        watch = self._watches.get(model)
        if watch is None:
            watch = self._watches[model] = WorkerWatch(self, model)
        iterator = aiter(stream)
        pending: asyncio.Future[AnyEvent] | None = None
        watch.follow()
        try:
            while True:
                pending = asyncio.ensure_future(anext(iterator))
                gone = watch.gone
                await asyncio.wait((pending, gone), return_when=asyncio.FIRST_COMPLETED)
                if not pending.done():
                    raise UnavailableError(f"no live worker serves model {model!r} any more")
                try:
                    event = pending.result()
                except StopAsyncIteration:
                    return
                pending = None
                yield event
        finally:
            watch.unfollow()
            if pending is not None and not pending.done():
                pending.cancel()
                with contextlib.suppress(BaseException):
                    await pending

    async def collect(self, request_id: str, **kwargs: Any) -> Generation:
        """Follows a request to its end; raises its error if it failed."""
        generation = Generation(request_id)
        async with contextlib.aclosing(self.events(request_id, **kwargs)) as events:
            async for event in events:
                if isinstance(event, TokenEvent):
                    generation.tokens.append(event)
                elif isinstance(event, DoneEvent):
                    generation.result = event.result
                else:
                    raise as_error(event)
        return generation

    async def collect_all(self, request_ids: list[str], **kwargs: Any) -> list[Generation]:
        """n choices at once; the first failure cancels the others (their cleanup cancels their requests)."""
        tasks = [asyncio.ensure_future(self.collect(request_id, **kwargs)) for request_id in request_ids]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for task in tasks:
                if not task.done():
                    task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


class WorkerWatch:
    """Whether any worker (draining ones included: they still finish what they run) serves a model,
    checked every _WATCH_S while some stream of it is followed, by one task for all of them.

    ``gone`` completes once no worker has served the model for no_worker_wait_s; the streams
    waiting on it end with 503, and the next ones get a fresh future. One task, not a timer per
    silent stream: with many requests queued, per-stream timers would wake the API hundreds of times
    a second. A failed check counts as neither: Redis being unreachable is not every worker being gone."""

    def __init__(self, dispatcher: Dispatcher, model: str) -> None:
        self.dispatcher = dispatcher
        self.model = model
        self.gone: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.followers = 0
        self._task: asyncio.Task[None] | None = None

    def follow(self) -> None:
        self.followers += 1
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._run())

    def unfollow(self) -> None:
        self.followers -= 1

    async def _run(self) -> None:
        settings = self.dispatcher.settings
        check_every = max(0.5, min(_WATCH_S, settings.no_worker_wait_s))
        workerless_since: float | None = None
        while self.followers > 0:
            await asyncio.sleep(check_every)
            try:
                served = await self.dispatcher.is_served(self.model)
            except Exception:
                continue
            if served:
                workerless_since = None
                continue
            now = time.monotonic()
            workerless_since = workerless_since or now
            if now - workerless_since >= settings.no_worker_wait_s:
                self.gone.set_result(None)
                self.gone = asyncio.get_running_loop().create_future()
                workerless_since = None


def as_error(event: ErrorEvent) -> Exception:
    if event.error_type == "cancelled":
        return CancelledError(event.message)
    return error_from_type(event.error_type, event.message)
