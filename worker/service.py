"""The worker process: Redis -> engine -> Redis.

The engine loop runs on the main thread and never waits on Redis. Beside it:

- ``Intake`` pulls what the policy's ``Capacity`` allows, in strict priority order (``intake.py``,
  ``engine/core/policy.py``), and ``Acceptance`` turns each entry into work or a final status,
- ``Recovery`` keeps this worker's entries fresh and takes over dead workers' (``recovery.py``),
- ``Publisher`` writes each step's tokens in one round trip, and every final status (``publisher.py``),
- ``CancelListener`` and ``Heartbeat``,
- ``HeldBlocks``: the prefix blocks the engine holds, mirrored into Redis after each step (``held_blocks.py``).

They hand work to the loop through one inbox (start / cancel / lost), drained between steps.

On SIGTERM the worker drains: no new work, running requests get ``drain_timeout_s`` to finish,
and whatever is left is handed back: its entry stays pending with its idle time pushed past
``reclaim_after_s``, so the next XAUTOCLAIM of any live worker resumes it from its replay log
(no token is generated twice, and the status stays ``running`` as the lifecycle requires).
Then the worker exits 0."""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
import uuid

from shared.client_core import redis_kwargs
from shared.redis_connect import connect
from shared.schemas import WorkerHeartbeat
from shared.settings import Settings
from shared.tenant_labels import TenantLabels
from worker.acceptance import Acceptance
from worker.active import ActiveRequest, failure_suspects
from worker.adapters import WorkerAdapters, preload
from worker.cancel_listener import CancelListener
from worker.engine.core.policy import Capacity
from worker.engine_port import Engine
from worker.heartbeat import Heartbeat
from worker.held_blocks import HeldBlocks
from worker.inbox import Inbox, InboxItem, OwnedEntries
from worker.intake import Intake, WorkerLoad
from worker.light_arrivals import LightArrivals
from worker.prefill_rate import PrefillRate
from worker.priority_latency import PriorityLatency
from worker.publisher import Publisher
from worker.reconnect import TRANSIENT
from worker.recovery import Recovery
from worker.run_state import RunState
from worker.streams import ensure_groups
from worker.tenant_usage import TenantUsage
from worker.watchdog import EngineWatchdog

log = logging.getLogger("inflightq.worker")

# Cancels that arrive before their request reaches the loop are remembered this long.
EARLY_CANCEL_TTL_S = 60.0


def default_name() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:4]}"


class WorkerService:
    def __init__(
        self,
        settings: Settings,
        engine: Engine,
        *,
        model: str | None = None,
        name: str | None = None,
        device: str = "cpu",
        dtype: str = "auto",
        threads: int = 0,
    ) -> None:
        self.settings = settings
        self.threads = threads
        self.engine = engine
        self.model = model or settings.model
        self.name = name or default_name()
        self.device = device
        self.dtype = dtype
        self.started_at = time.time()
        # A few requests beyond the running slots (the prefetch of Celery or RabbitMQ), so a slot that
        # frees at the end of a step is refilled by the next step although the intake reads Redis
        # while that step runs.
        self.capacity = Capacity.for_engine(engine.max_num_seqs, settings.prefetch_seqs)
        self.state = RunState()
        self.stopping = self.state.stopping
        self.draining = self.state.draining
        self.capacity_changed = self.state.capacity_changed
        self._drain_deadline = float("inf")
        self.counters: dict[str, int] = dict.fromkeys(
            ("taken_over", "dead_lettered", "cancelled", "expired", "completed", "generated_tokens", "handed_back"), 0
        )
        self.latency = PriorityLatency(self.name, self.model)
        self.tenant_usage = TenantUsage(self.name, self.model, TenantLabels.from_settings(settings))
        self.inbox = Inbox()
        self.owned = OwnedEntries()
        self._active: dict[str, ActiveRequest] = {}  # engine-loop thread only
        self._early_cancels: dict[str, float] = {}

        # A RedisCluster on a Cluster: every thread below takes either. surrogateescape: bytes that are not
        # UTF-8 in a stream entry reach acceptance as lone surrogates (and are dead-lettered) instead of
        # raising in the intake's read, which stopped every worker.
        self.redis = connect(settings, **redis_kwargs(settings, encoding_errors="surrogateescape"))
        self.adapters = WorkerAdapters(settings, self.redis, self.model, worker=self.name, engine=engine)
        self.adapters.register_configured()
        preload(engine, self.adapters.of_model(), settings.max_loras)
        self.publisher = Publisher(settings, self.redis, self.name)
        self.acceptance = Acceptance(
            settings, self.redis, self.publisher, self.name, self.model, self._hand_over, self.counters
        )
        self.prefill_rate = PrefillRate()
        load = WorkerLoad(
            engine_load=lambda: self.engine.load,
            in_transit=lambda: self.inbox.in_transit,
            is_idle=self.is_idle,
            prefill_ms_per_token=lambda: self.prefill_rate.ms_per_token,
        )
        self.intake = Intake(
            settings, self.redis, self.acceptance, self.capacity, load, self.state, name=self.name, model=self.model
        )
        # A full worker looks for a light tenant's request as it arrives, not at its next poll.
        self.light_arrivals = (
            LightArrivals(self.redis, self.intake.keys, self.model, self.state) if settings.fair_share else None
        )
        self.recovery = Recovery(
            settings, self.redis, self.acceptance, self.owned, self.state,
            name=self.name, model=self.model, room=self.room, on_lost=self.lost,
        )  # fmt: skip
        self.held = HeldBlocks(
            settings, self.redis, self.publisher, engine,
            name=self.name, model=self.model, draining=self.draining,
        )  # fmt: skip
        self.heartbeat_thread = Heartbeat(settings, self.redis, self.name, self.heartbeat, self.stopping, self.held)
        self.cancel_listener = CancelListener(settings, self.redis, self.cancel, self.stopping)
        self.loop_progress_at = time.monotonic()  # stamped by the engine loop; read by the watchdog
        self.watchdog = EngineWatchdog(self, settings.engine_stall_s) if settings.engine_stall_s > 0 else None

    # Read by the I/O threads ---------------------------------------------------------
    def room(self) -> int:
        return self.capacity.room(self.engine.load, self.inbox.in_transit)

    def is_idle(self) -> bool:
        return not self.inbox.in_transit and not self.engine.has_unfinished()

    def heartbeat(self) -> WorkerHeartbeat:
        stats = self.engine.stats
        return WorkerHeartbeat(
            name=self.name,
            model=self.model,
            device=self.device,
            dtype=self.dtype,
            threads=self.threads,
            max_num_seqs=self.engine.max_num_seqs,
            num_kv_blocks=self.engine.num_total_blocks,
            # The engine's own counts are only refreshed when it steps; an idle engine runs nothing.
            running=self.engine.num_unfinished,
            waiting=stats.num_waiting if self.engine.has_unfinished() else 0,
            free_kv_blocks=self.engine.num_free_blocks,
            engine_steps=stats.steps,
            preemptions=stats.preemptions,
            started_at=self.started_at,
            draining=self.draining.is_set(),
        )

    # Called by the I/O threads -------------------------------------------------------
    def cancel(self, request_id: str) -> None:
        self.inbox.put(InboxItem("cancel", request_id))

    def lost(self, stream: str, entry_id: str) -> None:
        # A finished request is not reported: its ack may have landed just before the publisher's
        # settled callback removed it from ours, so it is no longer pending, yet nobody took it over.
        owner = self.owned.running_owner(stream, entry_id)
        if owner is not None:
            log.warning("request %s was taken over by another worker; dropping it here", owner)
            self.inbox.put(InboxItem("lost", owner))

    def _hand_over(self, active: ActiveRequest) -> None:
        if active.request.adapter:  # loaded here, in the I/O thread, rather than by the engine loop at its start
            self.adapters.prefetch(active.request.adapter)
        self.owned.add(active)
        self.inbox.put(InboxItem("start", active.id, active))
        # An urgent start (a level more urgent, or a tenant far under its share) stops a long step of
        # the work it outranks at its next layer, instead of waiting for all of it: the loop then takes
        # the start and runs it first.
        self.engine.interrupt_for(active.request.priority, active.request.tenant, active.request.tenant_weight)

    # The engine loop -----------------------------------------------------------------
    def run(self) -> int:
        self._install_signal_handlers()
        ensure_groups(self.redis, self.intake.streams)
        for thread in (self.publisher, self.heartbeat_thread, self.cancel_listener, self.recovery, self.intake):
            thread.start()
        if self.light_arrivals is not None:
            self.light_arrivals.start()
        self.loop_progress_at = time.monotonic()
        if self.watchdog is not None:
            self.watchdog.start()
        log.info("worker %s serving %s", self.name, self.model)
        try:
            while True:
                self.loop_progress_at = time.monotonic()
                self._take_inbox(block=not self.engine.has_unfinished())
                if self.draining.is_set() and (
                    not self.engine.has_unfinished() or time.monotonic() >= self._drain_deadline
                ):
                    break
                if self.engine.has_unfinished():
                    self._step()
                self.held.sync()  # what the step cached and evicted goes out with its tokens
        finally:
            self._shut_down()
        return 0

    def drain(self, timeout: float | None = None) -> None:
        """Stop taking work; running requests get ``timeout`` (default drain_timeout_s) to finish."""
        if self.draining.is_set():
            self._drain_deadline = time.monotonic()  # a second signal: stop now
        else:
            wait = self.settings.drain_timeout_s if timeout is None else timeout
            self._drain_deadline = time.monotonic() + wait
            self.draining.set()
        self.inbox.wake()

    def _install_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda _signum, _frame: self.drain())

    def _take_inbox(self, *, block: bool) -> None:
        items = self.inbox.take(0.5 if block and not self.draining.is_set() else 0.0)
        for item in items:
            if item.kind == "start":
                assert item.active is not None
                self._start(item.active)
                self.inbox.started(item.active.request.priority)
            elif item.kind == "cancel":
                self._cancel(item.request_id)
            else:
                self._drop(item.request_id)
                self.engine.abort(item.request_id)
        if items:
            self.capacity_changed.set()
        if any(item.kind == "start" for item in items):
            self.held.sync()  # the starts' prompts are advertised before the step that prefills them

    def _start(self, active: ActiveRequest) -> None:
        if self.draining.is_set():
            self._hand_back(active)
            return
        if self._early_cancels.pop(active.id, None) is not None:
            self._finish_error(active, "cancelled", "cancelled", "cancelled by client")
            self.counters["cancelled"] += 1
            return
        if active.prior_finish is not None:  # the last token was sent; only the final write was lost
            self._finish_done(active, active.prior_finish)
            return
        from worker.engine import SamplingParams

        request = active.request
        try:
            self.engine.add_request(
                request.id,
                request.prompt_token_ids,
                SamplingParams(**request.sampling.model_dump()),
                priority=request.priority,
                deadline=request.deadline,
                tenant=request.tenant,
                prior_output_token_ids=active.prior_token_ids,
                lora=self.adapters.request_for(request.adapter) if request.adapter else None,
                share=active.share,
                weight=request.tenant_weight,
            )
        except Exception as error:  # the engine refuses this request (too long, bad token ids, ...)
            self._drop(active.id)
            self.acceptance.dead_letter(request, active.stream, active.entry_id, f"engine rejected it: {error}")
            return
        self._active[active.id] = active
        if not request.adapter:  # an adapter's blocks are rooted in its key, which the engine resolves
            self.held.promise(request.id, request.prompt_token_ids, request.tenant)
        if not active.prior_token_ids and active.attempt == 0:
            self.latency.started(request.priority, time.time() - request.submitted_at)
            self.tenant_usage.started(request.tenant, len(request.prompt_token_ids))
            if request.adapter:
                self.adapters.started(request.adapter, len(request.prompt_token_ids))

    def _cancel(self, request_id: str) -> None:
        active = self._active.get(request_id)
        if active is None:
            now = time.monotonic()
            self._early_cancels = {k: t for k, t in self._early_cancels.items() if now - t < EARLY_CANCEL_TTL_S}
            self._early_cancels[request_id] = now
            return
        self.engine.abort(request_id)
        self.counters["cancelled"] += 1
        self._finish_error(active, "cancelled", "cancelled", "cancelled by client")

    def _step(self) -> None:
        interrupted = self.engine.stats.interrupted_steps
        forward_s = self.engine.stats.forward_time_s
        try:
            events = self.engine.step()
        except Exception:
            # The batch's state is unknown: give every request back. Only the suspects are charged
            # a delivery, so one poison does not drag its batch into the dead letters.
            log.exception("engine step failed; handing %d requests back", len(self._active))
            suspects = failure_suspects(list(self._active.values()))
            for active in list(self._active.values()):
                self.engine.abort(active.id)
                self._hand_back(active, failed=active.id in suspects)
            return
        stats = self.engine.stats
        if stats.interrupted_steps == interrupted:  # a stopped step ran nobody to the end
            for active in self._active.values():
                active.steps_survived += 1
            self.prefill_rate.observe(stats.batch_tokens, stats.batch_seqs, stats.forward_time_s - forward_s)
        self.publisher.publish_tokens(
            (event, self._active[event.request_id].attempt) for event in events if event.request_id in self._active
        )
        for event in events:
            active = self._active.get(event.request_id)
            if active is None:
                continue
            first = active.first_token_at is None and event.token_id >= 0
            active.add(event.token_id, event.text)
            if first and not active.prior_token_ids and active.attempt == 0:
                self.latency.first_token(active.request.priority, time.time() - active.request.submitted_at)
                self.tenant_usage.first_token(active.request.tenant, time.time() - active.request.submitted_at)
            if event.token_id >= 0:
                self.counters["generated_tokens"] += 1
                self.tenant_usage.generated(active.request.tenant)
                if active.request.adapter:
                    self.adapters.generated(active.request.adapter)
            if event.finish_reason == "expired":
                self.counters["expired"] += 1
                self._finish_error(active, "expired", "expired", "deadline passed during generation")
            elif event.finish_reason == "error":  # this request alone failed (its grammar matcher broke)
                self._finish_error(active, "failed", "generation", event.error or "generation failed")
            elif event.finish_reason is not None:
                self._finish_done(active, event.finish_reason)

    # A finished request's entry stays ours (kept fresh, never taken over, by this worker's own
    # recovery either) until its final status and ack reach Redis: after an outage longer than
    # reclaim_after_s, recovery would otherwise run again what only waits to be written.
    def _finish_done(self, active: ActiveRequest, finish_reason: str) -> None:
        self._drop(active.id, keep_entry=True)
        self.counters["completed"] += 1
        result = active.result(finish_reason, self.name)
        self.publisher.finish_done(active.stream, active.entry_id, result, lambda: self.owned.discard(active.id))

    def _finish_error(self, active: ActiveRequest, status: str, error_type: str, message: str) -> None:
        self._drop(active.id, keep_entry=True)
        index = len(active.prior_token_ids) + len(active.token_ids)
        self.publisher.finish_error(
            active.id, active.stream, active.entry_id, status, error_type, message, index,
            lambda: self.owned.discard(active.id), used=len(active.request.prompt_token_ids) + index,
        )  # fmt: skip

    def _drop(self, request_id: str, *, keep_entry: bool = False) -> None:
        self._active.pop(request_id, None)
        self.held.settled(request_id)
        if keep_entry:
            self.owned.settling(request_id)
        else:
            self.owned.discard(request_id)
        self.capacity_changed.set()

    def _hand_back(self, active: ActiveRequest, *, failed: bool = False) -> None:
        self._drop(active.id)
        self.counters["handed_back"] += 1
        try:
            self.recovery.hand_back(active.stream, active.entry_id, active.id, failed=failed)
        except TRANSIENT as error:  # it stays pending: XAUTOCLAIM takes it after reclaim_after_s anyway
            log.warning("could not hand %s back (%s)", active.id, error)

    def _shut_down(self) -> None:
        self.loop_progress_at = float("inf")  # the loop has ended on purpose: nothing for the watchdog to catch
        self.draining.set()
        left = list(self._active.values())
        for active in left:
            self.engine.abort(active.id)
        # Every token sent reaches the replay log before its entry is handed back: the next owner
        # resumes from the log, and must not find it short (it would generate those tokens again).
        if not self.publisher.flush(timeout=10):
            log.warning("some writes did not reach Redis before exit")
        for active in left:
            self._hand_back(active)
        # Only then wait for the intake (up to one idle block on the notify list): the requests that
        # ran here are already on their way to another worker.
        self.intake.join(timeout=5)
        self._take_inbox(block=False)  # starts that were on their way are handed back
        self.stopping.set()
        for thread in (self.recovery, self.cancel_listener, self.heartbeat_thread):
            thread.join(timeout=5)
        self.heartbeat_thread.remove()
        self.held.remove()
        self.publisher.stop(timeout=5)
        self.redis.close()
        stats = self.engine.stats
        # The engine's own account, for comparing a worker's steps with the offline engine's.
        log.info(
            "worker %s stopped (%s); engine: %d steps, %.1f ms/step, forward %.0f%% of step, %d tokens generated",
            self.name,
            self.counters,
            stats.steps,
            1000 * stats.step_time_s / max(1, stats.steps),
            100 * stats.forward_share,
            stats.generated_tokens,
        )
