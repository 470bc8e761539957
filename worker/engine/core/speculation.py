"""Speculative decoding from the sequence itself (n-gram / prompt lookup): no draft model.

A decoding sequence proposes up to ``num_tokens`` tokens: those that followed the most recent
earlier occurrence of its latest ``n`` tokens (longest ``n`` first, from ``ngram_max`` down to
``ngram_min``) in its prompt + output. Text that copies from its input (extraction, quoting
summaries, code edits, JSON echoing field names) repeats such runs; the step checks the proposal
beside the sequence's ordinary next token (``llm_engine``) and keeps the agreeing prefix.

Each sequence keeps an index from n-gram to where it last ended, extended by the tokens added
since the previous proposal, so a proposal costs a few dictionary look-ups, not a scan.

Adaptive, per sequence and per step: each proposed token is one more row of the step whether it is
kept or not, and a row costs more of the step the more rows the step already has (a step of R rows
costs about ``row_worth + R`` rows' worth of arithmetic; one row is mostly the read of the weights).
A sequence's j-th proposed token is kept with probability about q**j, q its recent share of tokens
kept before the first rejection; it is worth its row when q**j >= R / (row_worth + R) for a step of R
decodes: long proposals for one stream that copies, short or none in a large batch, and a sequence
whose proposals are mostly rejected stops proposing for a while (doubling each time it fails again),
so traffic that does not copy from its input pays for a short probe now and then.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# Weight of the latest step in a sequence's running acceptance rate.
_RATE_WEIGHT = 0.5
# How much of a sequence's kept/missed record each new proposal leaves standing.
_HISTORY_DECAY = 0.7
_FIRST_PAUSE_STEPS = 4
_MAX_PAUSE_STEPS = 256


@dataclass(frozen=True)
class SpeculationConfig:
    num_tokens: int = 4  # tokens proposed per step at most (k)
    ngram_max: int = 3  # longest suffix looked up
    ngram_min: int = 2  # shortest suffix whose match is trusted
    min_acceptance: float = 0.3  # below this running share of proposed tokens accepted, pause
    # A step's fixed cost (the weights' read, per-step work) in rows: a step of R rows costs about
    # row_worth + R rows (this CPU's decode steps, 1-24 rows: docs/benchmarks.md).
    row_worth: float = 8.0


@dataclass
class SpeculationState:
    """One sequence's n-gram index and its acceptance record."""

    maps: list[dict[Any, int]] = field(default_factory=list)  # per n: n-gram -> end of its latest occurrence
    indexed: int = 1  # n-grams ending before this position are in the index
    rate: float = 1.0  # running share of proposed tokens accepted
    # Decayed counts of tokens kept and of proposals cut by a rejection: q = kept / (kept + missed),
    # started at 2/3: a fresh sequence proposes in full at one stream, a token in a batch of 8.
    kept: float = 1.0
    missed: float = 0.5
    paused: int = 0  # steps left without proposing
    pause_steps: int = _FIRST_PAUSE_STEPS  # the next pause's length
    proposed: int = 0
    accepted: int = 0


class Speculator:
    def __init__(self, config: SpeculationConfig) -> None:
        assert 1 <= config.ngram_min <= config.ngram_max
        self.config = config

    def new_state(self) -> SpeculationState:
        return SpeculationState(maps=[{} for _ in range(self.config.ngram_max + 1)])

    def length(self, state: SpeculationState, decodes: int) -> int:
        """How many tokens the sequence should propose in a step of ``decodes`` decoding sequences: the
        most j (up to num_tokens) whose chance of being kept, q**j, beats the row's share of the step."""
        q = state.kept / (state.kept + state.missed)
        worth = decodes / (self.config.row_worth + decodes)
        j, chance = 0, q
        while j < self.config.num_tokens and chance >= worth:
            j += 1
            chance *= q
        return j

    def propose(self, state: SpeculationState, tokens: list[int], limit: int) -> list[int]:
        """Up to ``min(num_tokens, limit)`` tokens likely to follow ``tokens``; [] when paused or unmatched."""
        limit = min(limit, self.config.num_tokens)
        if limit <= 0:
            return []
        if state.paused:
            state.paused -= 1
            return []
        self._index(state, tokens)
        end = len(tokens)
        for n in range(min(self.config.ngram_max, end), self.config.ngram_min - 1, -1):
            key = tokens[end - 1] if n == 1 else tuple(tokens[end - n :])
            start = state.maps[n].get(key)
            if start is not None:
                return tokens[start : start + limit]
        return []

    def record(self, state: SpeculationState, proposed: int, accepted: int) -> None:
        """A verified proposal: ``accepted`` of its ``proposed`` tokens agreed with the model."""
        state.proposed += proposed
        state.accepted += accepted
        state.rate = (1 - _RATE_WEIGHT) * state.rate + _RATE_WEIGHT * accepted / proposed
        state.kept = _HISTORY_DECAY * state.kept + accepted
        state.missed = _HISTORY_DECAY * state.missed + (accepted < proposed)
        if state.rate >= self.config.min_acceptance:
            state.pause_steps = _FIRST_PAUSE_STEPS
            return
        state.paused = state.pause_steps
        state.pause_steps = min(2 * state.pause_steps, _MAX_PAUSE_STEPS)
        # The probe after the pause decides alone: one good proposal resumes, one bad one pauses again.
        state.rate = self.config.min_acceptance

    def _index(self, state: SpeculationState, tokens: list[int]) -> None:
        """Adds the n-grams that end before the last token (each followed by at least one token)."""
        maps, low, high = state.maps, self.config.ngram_min, self.config.ngram_max
        for end in range(state.indexed, len(tokens)):
            if low == 1:
                maps[1][tokens[end - 1]] = end
            for n in range(max(low, 2), min(high, end) + 1):
                maps[n][tuple(tokens[end - n : end])] = end
        state.indexed = max(state.indexed, len(tokens))
