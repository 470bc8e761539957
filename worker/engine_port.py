"""What the worker uses of the engine: ``worker.engine.LLMEngine`` satisfies it; tests may pass another."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from worker.engine.core.block_manager import CacheChanges
from worker.engine.core.outputs import EngineEvent, EngineStats
from worker.engine.core.policy import EngineLoad
from worker.engine.sampling.sampling_params import SamplingParams


class Engine(Protocol):
    stats: EngineStats
    load: EngineLoad  # replaced after every step, add and abort; read without a lock

    @property
    def max_num_seqs(self) -> int: ...

    @property
    def num_unfinished(self) -> int: ...

    @property
    def num_free_blocks(self) -> int: ...

    @property
    def num_total_blocks(self) -> int: ...

    def has_unfinished(self) -> bool: ...

    def prefix_cache_changes(self, full: bool = False) -> CacheChanges: ...

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams | None = None,
        priority: int = 0,
        deadline: float | None = None,
        tenant: str | None = None,
        prior_output_token_ids: Sequence[int] = (),
        lora: Any = None,  # a worker.engine.LoRARequest
        share: float = 0.0,
        weight: float = 1.0,
    ) -> None: ...

    def interrupt_for(self, priority: int, tenant: str | None = None, weight: float = 1.0) -> bool: ...

    def abort(self, request_id: str) -> bool: ...

    def step(self) -> list[EngineEvent]: ...
