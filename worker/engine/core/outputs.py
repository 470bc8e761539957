"""What the engine hands out: per-token events (streaming), whole results (offline) and counters.
(The report of what it holds, ``EngineLoad``, is the policy's input and lives in ``policy``.)"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

# "error": this request failed alone (its grammar matcher broke); ``EngineEvent.error`` says why.
FinishReason = Literal["length", "eos_token", "stop_sequence", "expired", "error"]


@dataclass
class EngineEvent:
    request_id: str
    index: int  # position among generated tokens; continues after prior tokens on resume
    token_id: int  # -1 when the event only reports an end (expiry, or held-back text on finish)
    text: str  # text delta safe to show now
    logprob: float | None = None
    top_logprobs: list[tuple[int, str, float]] | None = None
    finish_reason: FinishReason | None = None
    special: bool = False
    error: str | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: FinishReason | None = None
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, str, float]]] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class EngineStats:
    """Counters since start; cumulative unless named for the last step. The worker's metrics read these."""

    steps: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, tokens found cached (counted in tokens, not blocks)
    preemptions: int = 0
    preemptions_by_reason: dict[str, int] = field(
        default_factory=lambda: {"kv_blocks": 0, "urgency": 0, "fair_share": 0}
    )
    recomputed_tokens: int = 0  # tokens whose KV a preemption threw away (computed again on resume)
    expired: int = 0
    forward_time_s: float = 0.0  # model forward incl. logits, summed over steps
    step_time_s: float = 0.0  # whole step() wall time, summed
    generated_tokens: int = 0
    mask_time_s: float = 0.0  # filling constrained rows' token masks (on a helper thread, beside the forward)
    mask_wait_s: float = 0.0  # of that, time the step waited for the masks after its forward
    masked_rows: int = 0  # constrained rows masked, summed over steps
    masked_steps: int = 0  # steps with at least one constrained row
    batch_tokens: int = 0  # tokens in the last step's forward
    batch_seqs: int = 0  # sequences in the last step's forward
    num_running: int = 0
    num_waiting: int = 0
    warmup_s: float = 0.0  # compiling the forward at start (0 when the forward runs eager)
    interrupted_steps: int = 0  # steps stopped between layers for an urgent arrival (their work thrown away)
    interrupted_time_s: float = 0.0  # forward time those steps had spent: the cost of stopping them
    token_steps: int = 0  # (sequence, step) pairs that produced tokens; generated_tokens / token_steps: tokens per step
    draft_steps: int = 0  # of those, pairs that checked a draft (speculation.py)
    draft_tokens: int = 0  # draft tokens checked
    draft_accepted_tokens: int = 0  # of those, tokens kept

    @property
    def forward_share(self) -> float:
        return self.forward_time_s / self.step_time_s if self.step_time_s else 0.0
