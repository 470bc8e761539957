"""The streaming core: requests in, token events out, one scheduler step at a time.

The worker drives it (add_request / abort / step) and reads its load report and stats;
``LLM`` wraps it for offline use. Thread-safe: a lock serialises the public calls, so an
abort from an I/O thread lands between steps.
"""

from __future__ import annotations

import dataclasses
import secrets
import threading
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import Any

from worker.engine.core.block_manager import BlockManager, CacheChanges
from worker.engine.core.config import EngineConfig
from worker.engine.core.cpu_threads import thread_governor
from worker.engine.core.memory import KvCacheSize, kv_cache_size
from worker.engine.core.outputs import EngineEvent, EngineStats, FinishReason
from worker.engine.core.policy import EngineLoad, Policy, RunningLoad
from worker.engine.core.scheduler import Scheduler
from worker.engine.core.sequence import Sequence, SequenceStatus
from worker.engine.core.speculation import SpeculationConfig, Speculator
from worker.engine.core.step_interrupt import StepInterrupt, StepInterrupted
from worker.engine.model.fast_linear import decode_layouts_in_order
from worker.engine.model.lora import Adapter, AdapterSet, LoRARequest
from worker.engine.model.model_loader import Resolve
from worker.engine.model.model_runner import ModelRunner
from worker.engine.sampling.detokenizer import IncrementalDetokenizer
from worker.engine.sampling.sampler import Sampler, SamplingRow
from worker.engine.sampling.sampling_params import SamplingParams
from worker.engine.sampling.structured import StructuredOutput, allowed_prefix


class LLMEngine:
    def __init__(
        self, model: Any, tokenizer: Any, config: EngineConfig | None = None, *, clock: Callable[[], float] = time.time
    ) -> None:
        """``model`` and ``tokenizer`` loaded already (``from_config`` loads them from ``config.model``); the
        model's own device and dtype are used."""
        config = config or EngineConfig()
        self.model = model
        self.tokenizer = tokenizer
        text_config = model.config.get_text_config()
        max_model_len = min(
            config.max_model_len or 1 << 30, getattr(text_config, "max_position_embeddings", None) or 1 << 30
        )
        param = next(model.parameters())
        num_kv_blocks = config.num_kv_blocks
        self.kv_cache_size: KvCacheSize | None = None  # how it was sized, when the caller did not say
        if num_kv_blocks is None:
            self.kv_cache_size = kv_cache_size(
                ModelRunner.kv_bytes_per_block(model, config.block_size, param.dtype),
                param.device,
                max_num_seqs=config.max_num_seqs,
                max_model_len=max_model_len,
                block_size=config.block_size,
                fraction=config.kv_memory_fraction,
            )
            num_kv_blocks = self.kv_cache_size.num_blocks
        max_model_len = min(max_model_len, num_kv_blocks * config.block_size)
        self.config = config = dataclasses.replace(config, num_kv_blocks=num_kv_blocks, max_model_len=max_model_len)
        self.max_model_len = max_model_len
        self.stats = EngineStats()
        self.block_manager = BlockManager(num_kv_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.block_manager,
            self.stats,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            policy=Policy(aging_steps=config.aging_steps, fair_share=config.fair_share),
            max_prefill_tokens_beside_decodes=config.max_prefill_tokens_beside_decodes,
            clock=clock,
        )
        self.cpu_threads = thread_governor(config.cpu_threads, config.cpu_share, param.device)
        self.runner = ModelRunner(model, config)
        self.stats.warmup_s = self.runner.warmup_s
        self.sampler = Sampler(text_config.vocab_size, param.device)
        # Rows of the embedding table: an id past them would fail the whole batch's forward.
        self.vocab_size = int(model.get_input_embeddings().num_embeddings)
        self.eos_token_ids = _eos_ids(model, tokenizer)
        self.special_token_ids = set(getattr(tokenizer, "all_special_ids", ()))
        self.structured = StructuredOutput(tokenizer, text_config.vocab_size, self.eos_token_ids)
        self.speculator: Speculator | None = None
        if config.speculative_tokens > 0:
            self.speculator = Speculator(
                SpeculationConfig(
                    config.speculative_tokens,
                    config.speculative_ngram_max,
                    config.speculative_ngram_min,
                    config.speculative_min_acceptance,
                )
            )
            self.scheduler.propose = self._propose
        # Rows up to which a decode step runs on decode_linear and the one-op decode step (0: none here).
        fast = decode_layouts_in_order(model)
        self._fast_rows = min((p.decode_numel // p.in_features for p in fast), default=0)
        self._seqs: dict[str, Sequence] = {}
        self._adapter_of: dict[str, Adapter] = {}  # request id -> the adapter it pins while in the engine
        self._pending: list[EngineEvent] = []  # events decided outside a step (e.g. a resume already complete)
        self._arrivals = 0
        self._lock = threading.RLock()
        self._interrupt = StepInterrupt()
        # Read by the worker's capacity decision without the lock (a step holds it for its whole forward).
        self.load = EngineLoad(config.max_num_seqs, config.block_size)
        self._refresh_load()

    @classmethod
    def from_config(cls, config: EngineConfig, *, resolve: Resolve | None = None) -> LLMEngine:
        """Loads ``config.model`` on ``config.device`` in ``config.dtype`` and builds the engine around it;
        ``resolve`` maps a model name to its files (default: the installed resolver, ``model_loader``)."""
        from worker.engine.model.hardware import resolve_device, resolve_dtype
        from worker.engine.model.model_loader import load_model

        device = resolve_device(config.device)
        dtype = resolve_dtype(
            config.dtype, device, cpu_kernels=config.cpu_kernels, kernel_cache_dir=config.kernel_cache_dir
        )
        model, tokenizer = load_model(config.model, dtype, device, config.converted_model_dir, resolve=resolve)
        return cls(model, tokenizer, config)

    # --- what it holds, read by the worker ------------------------------------------------------
    @property
    def max_num_seqs(self) -> int:
        return self.scheduler.max_num_seqs

    @property
    def num_unfinished(self) -> int:
        return len(self._seqs)

    @property
    def num_free_blocks(self) -> int:
        return self.block_manager.num_free_blocks

    @property
    def num_total_blocks(self) -> int:
        return self.block_manager.num_blocks

    def _refresh_load(self) -> None:
        """Called with the lock held, after anything that moves blocks or the queues."""
        bm, scheduler = self.block_manager, self.scheduler
        claimed = sum(bm.blocks_for(s.num_tokens) - len(s.block_table) for s in scheduler.waiting)
        self.load = EngineLoad(
            max_num_seqs=scheduler.max_num_seqs,
            block_size=bm.block_size,
            num_seqs=len(self._seqs),
            spare_blocks=bm.num_free_blocks - claimed,
            running=tuple(
                RunningLoad(u, len(s.block_table))
                for s, u in zip(scheduler.running, scheduler.fair_urgencies(scheduler.running), strict=True)
            ),
            waiting=tuple(scheduler.urgency(s) for s in scheduler.waiting),
        )

    def has_unfinished(self) -> bool:
        return bool(self._seqs or self._pending)

    def prefix_cache_changes(self, full: bool = False) -> CacheChanges:
        """Block hashes (``shared.prefix_hash``) cached and evicted since the last call; ``full``: all cached."""
        with self._lock:
            return self.block_manager.drain_changes(full)

    # --- requests -----------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Seq[int],
        params: SamplingParams | None = None,
        priority: int = 0,
        deadline: float | None = None,
        tenant: str | None = None,
        prior_output_token_ids: Seq[int] = (),
        lora: LoRARequest | None = None,
        share: float = 0.0,
        weight: float = 1.0,
    ) -> None:
        """``lora``: the adapter the request runs with (loaded here if the engine does not hold it; raises
        ``lora.AdapterError`` for one it cannot serve, ``ValueError`` where the engine serves no adapters)."""
        params = params or SamplingParams()
        prompt, prior = list(prompt_token_ids), list(prior_output_token_ids)
        if not prompt:
            raise ValueError("prompt_token_ids must not be empty")
        bad = next((t for t in (*prompt, *prior) if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"token id {bad} is outside the model's vocabulary (0..{self.vocab_size - 1})")
        if len(prompt) + len(prior) >= self.max_model_len:
            raise ValueError(
                f"prompt of {len(prompt) + len(prior)} tokens leaves no room (max_model_len {self.max_model_len})"
            )
        if params.seed is None:  # a fixed seed per request makes a crash-resumed request continue identically
            params = dataclasses.replace(params, seed=secrets.randbits(63))
        # Built outside the lock (a new constraint compiles in milliseconds); raises on a bad one.
        matcher = self.structured.matcher(params.constraint, prior) if params.constraint is not None else None
        adapter = self._acquire_adapter(lora) if lora is not None else None  # from disk outside the lock
        with self._lock:
            if request_id in self._seqs:
                if adapter is not None:
                    self.adapters.release(adapter)  # type: ignore[union-attr]
                raise ValueError(f"request {request_id!r} is already in the engine")
            detok = IncrementalDetokenizer(self.tokenizer, prompt, params.stop, prior_output_token_ids=prior)
            seq = Sequence(
                request_id, prompt, params, arrival=self._arrivals, priority=priority, deadline=deadline,
                tenant=tenant, adapter=adapter.key if adapter else None, prior_output_token_ids=prior,
                detokenizer=detok,
            )  # fmt: skip
            seq.matcher = matcher
            seq.share, seq.weight = share, weight
            if self._speculates(params):
                assert self.speculator is not None
                seq.speculation = self.speculator.new_state()
            self._arrivals += 1
            if len(prior) >= params.max_new_tokens:
                if adapter is not None:
                    self.adapters.release(adapter)  # type: ignore[union-attr]
                self._pending.append(EngineEvent(request_id, len(prior), -1, "", finish_reason="length"))
                return
            self._seqs[request_id] = seq
            if adapter is not None:
                self._adapter_of[request_id] = adapter
            self.scheduler.add(seq)
            self._refresh_load()

    @property
    def adapters(self) -> AdapterSet | None:
        """The LoRA adapters the engine holds; None where it serves none (``EngineConfig.max_loras`` 0)."""
        return self.runner.adapters

    def _acquire_adapter(self, lora: LoRARequest) -> Adapter:
        if self.runner.adapters is None:
            raise ValueError(f"adapter {lora.name!r} asked of an engine that serves none (max_loras is 0)")
        return self.runner.adapters.acquire(lora)

    def interrupt_for(self, priority: int, tenant: str | None = None, weight: float = 1.0) -> bool:
        """A request of ``priority`` (of ``tenant``, with its ``weight``) is on its way (from any thread,
        without the lock): stops the step in progress at its next layer if the arrival runs first of some of
        that step's work (``Scheduler.pauses_any``; when a step may stop is ``step_interrupt``'s). True if
        it asked the step to stop."""
        return self._interrupt.arrival(priority, tenant or "", weight)

    def abort(self, request_id: str) -> bool:
        with self._lock:
            seq = self._seqs.get(request_id)
            if seq is None:
                return False
            self._drop(seq)
            self._refresh_load()
            return True

    # --- the loop -----------------------------------------------------------------------------
    def step(self) -> list[EngineEvent]:
        with self._lock:
            started = time.perf_counter()
            if self.cpu_threads is not None:
                self.cpu_threads.tick()
            events, self._pending = self._pending, []
            batch = self.scheduler.schedule()
            for seq in batch.expired:
                events.append(EngineEvent(seq.request_id, seq.num_output_tokens, -1, "", finish_reason="expired"))
                self.stats.expired += 1
                self._drop(seq)
            for seq in batch.preempted:
                self.sampler.release(seq.request_id)
            if batch.seqs:
                seqs = batch.seqs  # judged only if a request arrives: nothing more per step
                self._interrupt.arm(
                    lambda priority, tenant, weight: self.scheduler.pauses_any(priority, seqs, tenant, weight),
                    self.stats.interrupted_time_s,
                    self.stats.step_time_s,
                )
                try:
                    events += self._run(batch.seqs, batch.num_new_tokens)
                finally:
                    self._interrupt.disarm()
            self.stats.steps += 1
            self.stats.batch_tokens = batch.num_tokens
            self.stats.batch_seqs = len(batch.seqs)
            self.stats.step_time_s += time.perf_counter() - started
            self._refresh_load()
            return events

    # --- speculation ----------------------------------------------------------------------------
    def _speculates(self, params: SamplingParams) -> bool:
        """Penalties and the watermark read the tokens before each draw, which a draft's rows do not have."""
        wanted = params.speculate if params.speculate is not None else self.config.speculate_by_default
        return self.speculator is not None and wanted and not params.needs_history and not params.watermark

    def _propose(self, seq: Sequence, limit: int, decodes: int, drafted: int) -> list[int]:
        """The scheduler's question for a decode: tokens to check beside its next one (at most ``limit``),
        in a step of at most ``decodes`` decodes whose earlier decodes proposed ``drafted`` tokens."""
        if seq.speculation is None or self.speculator is None:
            return []
        # The step adds up to 1 + len(draft) tokens: within max_new_tokens and the model's length.
        room = min(seq.params.max_new_tokens - seq.num_output_tokens, self.max_model_len - seq.num_tokens) - 1
        limit = min(limit, room, self.speculator.length(seq.speculation, decodes))
        if decodes < self._fast_rows:  # a step of few rows stays on the small-matmul kernel (decode_linear)
            limit = min(limit, self._fast_rows - decodes - drafted)
        draft = self.speculator.propose(seq.speculation, seq.token_ids, limit)
        if draft and seq.matcher is not None:
            draft = allowed_prefix(seq.matcher, draft)  # a forbidden token would not be drawn: never check it
        return draft

    def _run(self, seqs: list[Sequence], num_new_tokens: list[int]) -> list[EngineEvent]:
        sample = [s.num_computed_tokens + n == s.num_tokens for s, n in zip(seqs, num_new_tokens, strict=True)]
        constrained = [s for s, f in zip(seqs, sample, strict=True) if f and s.matcher is not None]
        masks = (
            self.structured.fill_async([s.matcher for s in constrained], [s.draft for s in constrained])
            if constrained
            else None
        )
        started = time.perf_counter()
        try:
            logits = self.runner.run(seqs, num_new_tokens, sample, self._interrupt)
        except StepInterrupted:
            # Nothing was kept: tokens, sampling and the prefix cache are as before this step,
            # which the next one schedules again (an urgent arrival first).
            if masks is not None:
                masks.result()  # the helper thread reads the matchers: done before anyone changes them
            self.stats.interrupted_steps += 1
            self.stats.interrupted_time_s += time.perf_counter() - started
            for seq in seqs:
                seq.draft = []
            return []
        self.stats.forward_time_s += time.perf_counter() - started
        bitmask = self._await_masks(masks, len(constrained)) if masks is not None else None
        mask_row: dict[int, int] = {}  # a constrained sequence's first mask row (one more per draft token)
        first = 0
        for s in constrained:
            mask_row[id(s)] = first
            first += 1 + len(s.draft)
        sampling: list[Sequence] = []
        for seq, n, s in zip(seqs, num_new_tokens, sample, strict=True):
            seq.num_computed_tokens += n
            self.block_manager.register_computed(seq)
            if s:
                sampling.append(seq)
        if not sampling:
            return []
        rows = [
            SamplingRow(
                s.request_id, s.params, s.prompt_token_ids, s.output_token_ids, s.num_output_tokens,
                allowed=bitmask[mask_row[id(s)]] if bitmask is not None and id(s) in mask_row else None,
            )
            for s in sampling
        ] if not any(s.draft for s in sampling) else self._draft_rows(sampling, bitmask, mask_row)  # fmt: skip
        out = self.sampler.sample(logits, rows)
        events: list[EngineEvent] = []
        i = 0  # the sequence's first row
        for seq in sampling:
            num_rows = 1 + len(seq.draft)
            if seq.matcher is not None and seq.matcher.is_error():  # its mask could not be computed
                error = f"structured output failed: {seq.matcher.get_error()}"
                events.append(self._fail(seq, error, seq.num_output_tokens))
            elif num_rows == 1:
                events.append(self._on_token(seq, out.token_ids[i], *self._logprobs(out, i, seq)))
                self.stats.generated_tokens += 1
            else:
                events += self._accept(seq, out, i)
            self.stats.token_steps += 1
            i += num_rows
        return events

    def _draft_rows(self, seqs: list[Sequence], bitmask: Any, mask_row: dict[int, int]) -> list[SamplingRow]:
        """Each sequence's row at its next token, then one row after each of its draft tokens: row j is
        drawn as token index num_output_tokens + j would be, had the draft's first j tokens been drawn."""
        rows = []
        for s in seqs:
            output = s.output_token_ids
            first = mask_row.get(id(s)) if bitmask is not None else None
            for j in range(1 + len(s.draft)):
                allowed = bitmask[first + j] if first is not None else None
                history = output + s.draft[:j] if j else output
                rows.append(
                    SamplingRow(s.request_id, s.params, s.prompt_token_ids, history, s.num_output_tokens + j, allowed)
                )
        return rows

    def _accept(self, seq: Sequence, out: Any, first: int) -> list[EngineEvent]:
        """A drafted sequence's tokens: the draws of its rows while each equals the draft token it
        checks, then the first draw that differs (or the draw after the whole draft). Each row's draw
        is the one the sequence makes without a draft (same logits, same seeded number), so a token
        is kept exactly when that draw proposed it: greedy output is unchanged, and a sampled draft
        token is kept with its probability, else replaced by a draw from the rest (the
        speculative-sampling rule for a draft that proposes one token)."""
        draft = seq.draft
        drawn = out.token_ids[first : first + 1 + len(draft)]
        accepted = 0
        while accepted < len(draft) and drawn[accepted] == draft[accepted]:
            accepted += 1
        self.stats.draft_tokens += len(draft)
        self.stats.draft_accepted_tokens += accepted
        self.stats.draft_steps += 1
        assert self.speculator is not None and seq.speculation is not None
        self.speculator.record(seq.speculation, len(draft), accepted)
        events = []
        for j in range(accepted + 1):
            if j:  # the KV of the draft token just kept was computed by this step's row j
                seq.num_computed_tokens += 1
                self.block_manager.register_computed(seq)
            event = self._on_token(seq, drawn[j], *self._logprobs(out, first + j, seq))
            events.append(event)
            self.stats.generated_tokens += 1
            if event.finish_reason is not None:
                break
        seq.draft = []
        if not seq.is_finished:
            self.block_manager.trim(seq, seq.num_tokens)
        return events

    @staticmethod
    def _logprobs(out: Any, row: int, seq: Sequence) -> tuple[float | None, list[tuple[int, float]] | None]:
        logprob = out.logprobs[row] if out.logprobs is not None else None
        top = out.top_logprobs[row] if out.top_logprobs is not None and seq.params.logprobs else None
        return logprob, top

    def _on_token(
        self, seq: Sequence, token_id: int, logprob: float | None, top: list[tuple[int, float]] | None
    ) -> EngineEvent:
        seq.append_token(token_id)
        seq.status = SequenceStatus.DECODING
        params = seq.params
        finish: FinishReason | None = None
        if token_id in self.eos_token_ids and not params.ignore_eos:
            finish = "eos_token"
        elif token_id in params.stop_token_ids:
            finish = "stop_sequence"
        text, stopped = seq.detokenizer.add(token_id)
        if finish is None and stopped:
            finish = "stop_sequence"
        if seq.matcher is not None and finish is None:
            if not seq.matcher.consume_token(token_id):
                error = f"structured output failed: {seq.matcher.get_error()}"
                return self._fail(seq, error, seq.num_output_tokens - 1)
            if seq.matcher.is_stopped():  # the grammar is complete and nothing may follow: EOS was all it allowed
                finish = "eos_token"
        if finish is None and (seq.num_output_tokens >= params.max_new_tokens or seq.num_tokens >= self.max_model_len):
            finish = "length"
        if finish is not None and not stopped:
            text += seq.detokenizer.finish()
        top_named = [(t, self.tokenizer.decode([t]), lp) for t, lp in top] if top is not None else None
        event = EngineEvent(
            seq.request_id, seq.num_output_tokens - 1, token_id, text, logprob, top_named, finish,
            token_id in self.special_token_ids,
        )  # fmt: skip
        if finish is not None:
            seq.finish_reason = finish
            self._drop(seq)
        return event

    def _await_masks(self, masks: Any, rows: int) -> Any:
        waited = time.perf_counter()
        fill = masks.result()
        self.stats.mask_wait_s += time.perf_counter() - waited
        self.stats.mask_time_s += fill.fill_time_s
        self.stats.masked_rows += rows
        self.stats.masked_steps += 1
        return fill.bitmask

    def _fail(self, seq: Sequence, message: str, index: int) -> EngineEvent:
        """Ends one request with an error (``index``: tokens it had sent); the rest of the batch carries on."""
        seq.finish_reason = "error"
        self._drop(seq)
        return EngineEvent(seq.request_id, index, -1, "", finish_reason="error", error=message)

    def _drop(self, seq: Sequence) -> None:
        self.scheduler.remove(seq)
        self.sampler.release(seq.request_id)
        self._seqs.pop(seq.request_id, None)
        adapter = self._adapter_of.pop(seq.request_id, None)
        if adapter is not None:
            self.adapters.release(adapter)  # type: ignore[union-attr]
        seq.status = SequenceStatus.FINISHED


def _eos_ids(model: Any, tokenizer: Any) -> set[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        value = getattr(source, "eos_token_id", None)
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list | tuple):
            ids.update(int(v) for v in value)
    return ids
