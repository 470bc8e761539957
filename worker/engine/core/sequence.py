"""One request's state inside the engine; the only place that state lives.

Lifecycle (who moves it: the scheduler, except FINISHED which the engine sets):

    WAITING --admitted--> PREFILLING --all tokens computed--> DECODING --stop/length--> FINISHED
       ^                      |                                   |
       +------ preempted -----+-----------------------------------+   (blocks freed, tokens kept, recomputed)

A request resumed after a crash starts WAITING with its earlier output as context.
"""

from __future__ import annotations

import enum
from typing import Any

from worker.engine.sampling.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    FINISHED = "finished"


class Sequence:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        arrival: int,
        priority: int = 0,
        deadline: float | None = None,
        tenant: str | None = None,
        adapter: str | None = None,
        prior_output_token_ids: list[int] | None = None,
        detokenizer: Any = None,
    ) -> None:
        self.request_id = request_id
        self.params = params
        self.priority = priority
        self.arrival = arrival  # the engine's arrival order, increasing; ties in priority go by it
        self.deadline = deadline
        self.tenant = tenant
        self.adapter = adapter  # the LoRA adapter's key (``LoRARequest.key``) it runs with; None: the base model
        self.num_prompt_tokens = len(prompt_token_ids)
        # One flat list (prompt + output) so the runner slices it without concatenating per step.
        self.token_ids: list[int] = list(prompt_token_ids) + list(prior_output_token_ids or ())
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0  # tokens whose KV is in the cache
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []  # chained hashes of this sequence's full blocks, computed lazily
        self.arrival_step = 0  # scheduler step at arrival, for aging
        self.share = 0.0  # its tenant's virtual time when pulled (policy: the fair part of its urgency)
        self.weight = 1.0  # its tenant's weight (policy: the fair clause counts running requests per weight)
        self.fair_displaced = False  # preempted once for fair share: never again for it
        self.detokenizer = detokenizer
        self.finish_reason: str | None = None
        self.matcher: Any = None  # llguidance matcher of a constrained sequence, in step with its output
        self.speculation: Any = None  # its n-gram index and acceptance record (speculation.py); None: never proposes
        self.draft: list[int] = []  # tokens proposed to follow it, checked by this step beside its next token

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id!r}, {self.status.value}, prio={self.priority}, "
            f"tokens={self.num_tokens}, computed={self.num_computed_tokens}, blocks={len(self.block_table)})"
        )
