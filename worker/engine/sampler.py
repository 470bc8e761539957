"""Logits in, one token per sequence out, for the whole batch at once.

Order of processing (that of HF and vLLM): penalties -> temperature -> top_k -> top_p -> min_p
-> typical_p -> draw. Greedy rows (temperature 0) take the argmax after penalties, as HF does.

Logprobs are ``log_softmax`` of the RAW logits, before penalties, temperature and filters: what
OpenAI and vLLM (``logprobs_mode="raw_logprobs"``) report, and the only choice under which a
greedy and a sampled request report the same numbers for the same model state.

Seeded draws: a row's randomness comes from a generator seeded with a hash of (seed, index), so
its token depends only on its own logits, seed and position, never on its neighbours in the
batch, and a request resumed at index k after a crash draws exactly what it would have."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from worker.engine.sampling_params import SamplingParams

_MASK64 = (1 << 64) - 1

# Filters work in place on a [rows, vocab] block of logits, given a [rows, 1] block of their parameter.
_RowFilter = Callable[[torch.Tensor, torch.Tensor], None]


@dataclass
class SamplingRow:
    """One sequence sampling this step, built by the engine."""

    request_id: str
    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    index: int  # position among generated tokens of the token being drawn == len(output_token_ids)


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[float] | None  # sampled token's logprob, for every row, when any row asked
    top_logprobs: list[list[tuple[int, float]]] | None  # per row, best first; [] for rows that asked for none


def derive_seed(seed: int, index: int) -> int:
    """A 63-bit seed for drawing token ``index`` of a request seeded with ``seed`` (splitmix64)."""
    z = (seed * 0x9E3779B97F4A7C15 + index + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


class _PenaltyState:
    """Token counts of a request, kept as rows of the sampler's dense buffers so a step updates
    them with the newly drawn token instead of rebuilding them from Python lists."""

    __slots__ = ("num_counted", "slot")

    def __init__(self, slot: int) -> None:
        self.slot = slot
        self.num_counted = 0  # output tokens already folded into the slot's counts


class Sampler:
    def __init__(self, vocab_size: int, device: torch.device | str) -> None:
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self._generator = torch.Generator(device=self.device)
        # Per-request penalty state: output token counts and a "seen in prompt or output" mask.
        self._states: dict[str, _PenaltyState] = {}
        self._free_slots: list[int] = []
        self._counts = torch.zeros(0, vocab_size, dtype=torch.int32, device=self.device)
        self._seen = torch.zeros(0, vocab_size, dtype=torch.bool, device=self.device)

    def release(self, request_id: str) -> None:
        state = self._states.pop(request_id, None)
        if state is not None:
            self._free_slots.append(state.slot)

    def sample(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SamplerOutput:
        if logits.shape[-1] != self.vocab_size:
            logits = logits[:, : self.vocab_size]  # models pad their embedding past the tokenizer's vocab
        plain = True
        for row in rows:
            p = row.params
            if p.temperature != 0.0 or p.logprobs is not None or p.needs_history:
                plain = False
                break
        if plain:
            # The engine step is bound by overhead: all-greedy batches pay one argmax and nothing else.
            return SamplerOutput(logits.argmax(dim=-1).tolist(), None, None)
        return self._sample_general(logits, rows)

    def _sample_general(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SamplerOutput:
        # Half-precision logits are processed in fp32; fp64 stays fp64 so exact tests stay exact.
        work_dtype = torch.float32 if logits.element_size() < 4 else logits.dtype
        raw = logits.to(work_dtype)
        want_logprobs = any(r.params.logprobs is not None for r in rows)
        logprobs = torch.log_softmax(raw, dim=-1) if want_logprobs else None

        x = raw.clone()
        penalized = [i for i, r in enumerate(rows) if r.params.needs_history]
        if penalized:
            self._apply_penalties(x, [rows[i] for i in penalized], penalized)

        tokens = x.argmax(dim=-1)
        sampled = [i for i, r in enumerate(rows) if r.params.temperature != 0.0]
        if sampled:
            tokens[sampled] = self._draw(x[sampled], [rows[i] for i in sampled])
        token_list = tokens.tolist()

        if logprobs is None:
            return SamplerOutput(token_list, None, None)
        chosen = logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1).tolist()
        top_n = max(r.params.logprobs or 0 for r in rows)
        top: list[list[tuple[int, float]]] = [[] for _ in rows]
        if top_n > 0:
            values, ids = logprobs.topk(top_n, dim=-1)  # sorted, best first
            all_values, all_ids = values.tolist(), ids.tolist()
            for i, r in enumerate(rows):
                n = r.params.logprobs or 0
                top[i] = list(zip(all_ids[i][:n], all_values[i][:n], strict=True))
        return SamplerOutput(token_list, chosen, top)

    # -- penalties -------------------------------------------------------------------------

    def _apply_penalties(self, x: torch.Tensor, rows: list[SamplingRow], positions: list[int]) -> None:
        slots = self._update_counts(rows)
        slot_t = torch.tensor(slots, device=self.device)
        pos_t = torch.tensor(positions, device=x.device)
        counts = self._counts.index_select(0, slot_t).to(x.dtype)
        seen = self._seen.index_select(0, slot_t)
        rep = torch.tensor([r.params.repetition_penalty for r in rows], dtype=x.dtype, device=x.device)[:, None]
        freq = torch.tensor([r.params.frequency_penalty for r in rows], dtype=x.dtype, device=x.device)[:, None]
        pres = torch.tensor([r.params.presence_penalty for r in rows], dtype=x.dtype, device=x.device)[:, None]
        sub = x.index_select(0, pos_t)
        # HF: a seen token's logit is divided by the penalty when positive, multiplied when negative,
        # so a penalty > 1 always makes it less likely.
        sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
        # OpenAI: subtract frequency * count and presence * [count > 0], output tokens only.
        sub = sub - freq * counts - pres * (counts > 0).to(x.dtype)
        x.index_copy_(0, pos_t, sub)

    def _update_counts(self, rows: list[SamplingRow]) -> list[int]:
        """Brings each row's counts up to date with its output so far; returns the rows' slots."""
        slots: list[int] = []
        new_slots: list[int] = []
        new_tokens: list[int] = []
        for row in rows:
            state = self._states.get(row.request_id)
            out = row.output_token_ids
            if state is None or state.num_counted > len(out):
                # First sight, or the output shrank under us (a resumed request): rebuild from lists.
                if state is None:
                    state = _PenaltyState(self._take_slot())
                    self._states[row.request_id] = state
                self._counts[state.slot].zero_()
                self._seen[state.slot].zero_()
                if len(row.prompt_token_ids):
                    prompt = torch.as_tensor(list(row.prompt_token_ids), dtype=torch.long, device=self.device)
                    self._seen[state.slot, prompt] = True
                state.num_counted = 0
            if state.num_counted < len(out):
                fresh = list(out[state.num_counted :])
                new_tokens.extend(fresh)
                new_slots.extend([state.slot] * len(fresh))
                state.num_counted = len(out)
            slots.append(state.slot)
        if new_tokens:
            slot_t = torch.tensor(new_slots, dtype=torch.long, device=self.device)
            tok_t = torch.tensor(new_tokens, dtype=torch.long, device=self.device)
            ones = torch.ones(len(new_tokens), dtype=self._counts.dtype, device=self.device)
            self._counts.index_put_((slot_t, tok_t), ones, accumulate=True)
            self._seen[slot_t, tok_t] = True
        return slots

    def _take_slot(self) -> int:
        if not self._free_slots:
            # Grow by doubling: penalty buffers cost vocab_size * 5 bytes per slot, so only
            # requests that use penalties ever hold one.
            old = self._counts.shape[0]
            new = max(4, old * 2)
            grow = new - old
            self._counts = torch.cat([self._counts, self._counts.new_zeros(grow, self.vocab_size)])
            self._seen = torch.cat([self._seen, self._seen.new_zeros(grow, self.vocab_size)])
            self._free_slots.extend(range(new - 1, old - 1, -1))
        return self._free_slots.pop()

    # -- temperature, filters, draw ----------------------------------------------------------

    def _draw(self, x: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Draws one token per row of ``x`` (processed logits of rows with temperature > 0)."""
        params = [r.params for r in rows]
        temp = torch.tensor([p.temperature for p in params], dtype=x.dtype, device=x.device)
        x = x / temp[:, None]

        top_k = [p.top_k for p in params]
        if any(0 < k < x.shape[1] for k in top_k):
            _filter_top_k(x, top_k)
        self._filter_rows(x, [p.top_p for p in params], 1.0, _filter_top_p)
        self._filter_rows(x, [p.min_p for p in params], 0.0, _filter_min_p)
        self._filter_rows(x, [p.typical_p for p in params], 1.0, _filter_typical_p)

        probs = torch.softmax(x, dim=-1)
        # Exponential race: argmax(p_i / E_i) with E_i ~ Exp(1) is a draw from p, and it lets each
        # row take its noise from its own generator while the argmax stays one batched op.
        noise = torch.empty_like(probs)
        unseeded = [i for i, p in enumerate(params) if p.seed is None]
        if unseeded:
            noise[unseeded] = torch.empty(len(unseeded), x.shape[1], dtype=x.dtype, device=x.device).exponential_()
        for i, row in enumerate(rows):
            seed = row.params.seed
            if seed is not None:
                self._generator.manual_seed(derive_seed(seed, row.index))
                noise[i].exponential_(generator=self._generator)
        return (probs / noise.clamp_min_(torch.finfo(noise.dtype).tiny)).argmax(dim=-1)

    @staticmethod
    def _filter_rows(x: torch.Tensor, values: list[float], neutral: float, fn: _RowFilter) -> None:
        """Applies ``fn`` to the rows whose value is not the neutral one; leaves the rest untouched
        (a cumulative sum over a full row can round past 1.0 and drop tail tokens by accident)."""
        active = [i for i, v in enumerate(values) if v != neutral]
        if not active:
            return
        if len(active) == x.shape[0]:
            fn(x, torch.tensor(values, dtype=x.dtype, device=x.device)[:, None])
            return
        idx = torch.tensor(active, device=x.device)
        sub = x.index_select(0, idx)
        fn(sub, torch.tensor([values[i] for i in active], dtype=x.dtype, device=x.device)[:, None])
        x.index_copy_(0, idx, sub)


def _filter_top_k(x: torch.Tensor, top_k: list[int]) -> None:
    """Keeps each row's k largest logits (ties at the k-th value kept too, as HF does)."""
    vocab = x.shape[1]
    ks = [k if 0 < k < vocab else vocab for k in top_k]
    k_max = max(ks)
    values = x.topk(k_max, dim=-1).values
    kth = values.gather(1, torch.tensor(ks, device=x.device)[:, None] - 1)
    x.masked_fill_(x < kth, float("-inf"))


def _filter_top_p(x: torch.Tensor, top_p: torch.Tensor) -> None:
    """Keeps the smallest set of most likely tokens whose probability reaches top_p."""
    sorted_logits, order = x.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass of strictly more likely tokens
    drop_sorted = before >= top_p
    drop_sorted[:, 0] = False  # the most likely token always stays
    x.masked_fill_(drop_sorted.scatter(1, order, drop_sorted), float("-inf"))


def _filter_min_p(x: torch.Tensor, min_p: torch.Tensor) -> None:
    """Drops tokens less likely than min_p times the most likely one."""
    probs = x.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p
    x.masked_fill_(probs < threshold, float("-inf"))


def _filter_typical_p(x: torch.Tensor, typical_p: torch.Tensor) -> None:
    """Locally typical sampling: keep the tokens whose surprise is closest to the entropy until
    their mass reaches typical_p."""
    logp = x.log_softmax(dim=-1)
    p = logp.exp()
    entropy = -(p * logp).nan_to_num().sum(dim=-1, keepdim=True)
    distance = (-logp - entropy).abs()  # inf for already-dropped tokens: they sort last
    _, order = distance.sort(dim=-1)
    sorted_p = p.gather(1, order)
    before = sorted_p.cumsum(dim=-1) - sorted_p
    drop_sorted = before >= typical_p
    drop_sorted[:, 0] = False
    x.masked_fill_(drop_sorted.scatter(1, order, drop_sorted), float("-inf"))
