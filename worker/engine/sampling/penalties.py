"""Repetition, frequency and presence penalties, with each request's token counts kept between
steps so a step folds in the newly drawn token instead of rebuilding counts from Python lists.

Semantics: repetition as in HF (over prompt + output, a seen token's logit divided by the penalty
when positive, multiplied when negative, so a penalty > 1 always makes it less likely);
frequency and presence as in OpenAI (over output tokens only: subtract frequency * count and
presence * [count > 0]). Only the seen tokens' logits are touched: a few hundred gathers instead
of several passes over the whole vocabulary."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from worker.engine.sampling.sampling_params import SamplingParams


class _History:
    __slots__ = ("num_counted", "seen", "seen_ids", "slot")

    def __init__(self, slot: int, prompt: Sequence[int], device: torch.device) -> None:
        self.slot = slot  # row of the tracker's dense count buffer
        self.num_counted = 0  # output tokens already folded in
        self.seen: set[int] = set(prompt)
        self.seen_ids = torch.tensor(sorted(self.seen), dtype=torch.long, device=device)


class PenaltyTracker:
    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self._histories: dict[str, _History] = {}
        self._free_slots: list[int] = []
        # Output-token counts, one row per tracked request (vocab_size * 4 bytes each).
        self._counts = torch.zeros(0, vocab_size, dtype=torch.int32, device=device)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._histories

    def release(self, request_id: str) -> None:
        history = self._histories.pop(request_id, None)
        if history is not None:
            self._counts[history.slot].zero_()
            self._free_slots.append(history.slot)

    def apply(
        self,
        logits: torch.Tensor,
        positions: Sequence[int],
        request_ids: Sequence[str],
        params: Sequence[SamplingParams],
        prompts: Sequence[Sequence[int]],
        outputs: Sequence[Sequence[int]],
    ) -> None:
        """Penalises rows ``positions`` of ``logits`` in place."""
        histories = [self._sync(r, p, o) for r, p, o in zip(request_ids, prompts, outputs, strict=True)]
        sizes = [len(h.seen_ids) for h in histories]
        if sum(sizes) == 0:
            return
        lengths = torch.tensor(sizes, device=self.device)
        ids = torch.cat([h.seen_ids for h in histories])
        which = torch.repeat_interleave(torch.arange(len(histories), device=self.device), lengths)
        slots = torch.tensor([h.slot for h in histories], device=self.device)[which]
        rows = torch.tensor(list(positions), device=logits.device)[which]

        dtype = logits.dtype
        rep = torch.tensor([p.repetition_penalty for p in params], dtype=dtype, device=logits.device)[which]
        freq = torch.tensor([p.frequency_penalty for p in params], dtype=dtype, device=logits.device)[which]
        pres = torch.tensor([p.presence_penalty for p in params], dtype=dtype, device=logits.device)[which]
        counts = self._counts[slots, ids].to(device=logits.device, dtype=dtype)
        values = logits[rows, ids]
        values = torch.where(values > 0, values / rep, values * rep)
        values = values - freq * counts - pres * (counts > 0).to(dtype)
        logits[rows, ids] = values

    def _sync(self, request_id: str, prompt: Sequence[int], output: Sequence[int]) -> _History:
        """The request's history, brought up to date with its output so far."""
        history = self._histories.get(request_id)
        if history is not None and history.num_counted > len(output):
            self.release(request_id)  # the output shrank (a preempted or resumed request): start over
            history = None
        if history is None:
            history = _History(self._take_slot(), prompt, self.device)
            self._histories[request_id] = history
        if history.num_counted < len(output):
            fresh = list(output[history.num_counted :])
            history.num_counted = len(output)
            tokens = torch.tensor(fresh, dtype=torch.long, device=self.device)
            ones = torch.ones_like(tokens, dtype=torch.int32)
            self._counts[history.slot].index_put_((tokens,), ones, accumulate=True)
            unseen = sorted(set(fresh) - history.seen)
            if unseen:
                history.seen.update(unseen)
                history.seen_ids = torch.cat([history.seen_ids, torch.tensor(unseen, device=self.device)])
        return history

    def _take_slot(self) -> int:
        if not self._free_slots:
            # Grow by doubling: only requests that use penalties ever hold a slot.
            old = self._counts.shape[0]
            new = max(4, old * 2)
            self._counts = torch.cat([self._counts, self._counts.new_zeros(new - old, self.vocab_size)])
            self._free_slots.extend(range(new - 1, old - 1, -1))
        return self._free_slots.pop()
