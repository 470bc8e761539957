"""How long this worker's engine takes per prompt token it prefills, as the engine loop measures its
steps: the intake hands it to ``PULL``, where a busy worker leaves an offer to the worker holding its
prefix for as long as prefilling the prompt here would take (``policy.offer_stealable``)."""

from __future__ import annotations

# Weight of the newest step in the running mean: a few steps settle it, a change of load moves it.
SMOOTHING = 0.2
# A step counts when it computed at least this many tokens per sequence on average: mostly prefill,
# so its time per token is a prefill token's cost (decoding steps cost more per token, by the weights read).
MIN_TOKENS_PER_SEQ = 4


class PrefillRate:
    def __init__(self) -> None:
        self._ms_per_token = 0.0  # 0: no prefill step measured yet

    def observe(self, tokens: int, seqs: int, forward_s: float) -> None:
        """One engine step: the tokens its forward computed, over how many sequences, in how long."""
        if seqs <= 0 or tokens < MIN_TOKENS_PER_SEQ * seqs or forward_s <= 0:
            return
        ms, last = 1000 * forward_s / tokens, self._ms_per_token
        self._ms_per_token = last + SMOOTHING * (ms - last) if last else ms

    @property
    def ms_per_token(self) -> float:
        return self._ms_per_token
