"""Logits in, one token per sequence out, for the whole batch at once.

Order of processing (that of HF and vLLM): grammar mask -> watermark (TGI's) -> penalties -> temperature -> top_k
-> top_p -> min_p -> typical_p -> draw. The mask (structured.py) is a hard constraint that no
penalty can undo. Greedy rows (temperature 0) take the argmax after penalties, as HF does.

Logprobs are ``log_softmax`` of the RAW logits, before penalties, temperature and filters: what
OpenAI and vLLM (``logprobs_mode="raw_logprobs"``) report, and the only choice under which a
greedy and a sampled request report the same numbers for the same model state.

Seeded draws: a draw is an inverse-CDF lookup of one uniform number per row, and a seeded row's
number is a hash of (seed, index). Its token therefore depends only on its own logits, seed and
position, never on its neighbours in the batch, and a request resumed at index k after a crash
draws exactly what it would have. One number per row instead of a vocabulary's worth of noise
(an exponential race) makes a full-vocabulary draw a softmax, a cumsum and a search.

On a CPU with the kernels built, rows without typical_p are filtered and drawn by one op,
``sample_rows`` (sample_rows.cpp), straight from the model's bf16 or fp32 logits: the same
filters and the same inverse-CDF draw of the same uniform number, at a fraction of the torch
path's cost (which stays for typical_p, float64 and other devices)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from worker.engine.sampling.penalties import PenaltyTracker
from worker.engine.sampling.sampling_filters import filter_candidates, filter_full, has_filter
from worker.engine.sampling.sampling_params import SamplingParams
from worker.engine.sampling.structured import banned_tokens
from worker.engine.sampling.watermark import apply_watermark

_MASK64 = (1 << 64) - 1

# Rows with top_k / top_p / min_p / typical_p are filtered and drawn among their top-K tokens
# when that is exact (sampling_filters.py); 256 holds the top_p = 0.95 nucleus of a chat model
# at ordinary temperatures, and a topk of 256 costs a fraction of a full sort.
NUM_CANDIDATES = 256


@dataclass
class SamplingRow:
    """One sequence sampling this step, built by the engine."""

    request_id: str
    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    index: int  # position among generated tokens of the token being drawn == len(output_token_ids)
    # A constrained row's allowed tokens as llguidance bit words (structured.py); None: any token.
    allowed: torch.Tensor | None = None


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


def greedy_pick(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax: the CPU kernels' ``greedy_argmax`` where they are loaded (the same pick,
    many times faster than torch's over a vocabulary, and no fp32 copy of bf16 logits), else torch's."""
    if (
        logits.device.type == "cpu"
        and logits.dtype in (torch.float32, torch.bfloat16)
        and logits.dim() == 2
        and logits.shape[-1] > 0
        and hasattr(torch.ops.inflightq, "greedy_argmax")
    ):
        return torch.ops.inflightq.greedy_argmax(logits)
    if logits.element_size() < 4:
        logits = logits.float()  # half-precision argmax is slower than convert + argmax on CPU
    return logits.argmax(dim=-1)


class Sampler:
    def __init__(
        self,
        vocab_size: int,
        device: torch.device | str,
        num_candidates: int = NUM_CANDIDATES,
        *,
        kernel: bool = True,
    ) -> None:
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.num_candidates = num_candidates
        self.kernel = kernel  # False: always the torch path (tests compare the two)
        self._penalties = PenaltyTracker(vocab_size, self.device)

    def release(self, request_id: str) -> None:
        self._penalties.release(request_id)

    def sample(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SamplerOutput:
        if logits.shape[-1] != self.vocab_size:
            logits = logits[:, : self.vocab_size]  # models pad their embedding past the tokenizer's vocab
        needs_fp32 = any(r.params.logprobs is not None or _is_special(r) for r in rows)
        if needs_fp32 or any(r.params.temperature != 0.0 for r in rows):
            if needs_fp32 and logits.element_size() < 4:
                logits = logits.float()  # logprobs, masks and penalties work on an fp32 copy
            return self._sample_general(logits, rows)
        # The engine step is bound by overhead: all-greedy batches pay one argmax and nothing else.
        return SamplerOutput(greedy_pick(logits).tolist(), None, None)

    def _sample_general(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SamplerOutput:
        # fp64 stays fp64 so exact greedy tests stay exact. bf16 reaches here only for rows that just
        # sample (no logprobs, penalties, watermark or grammar): sample_rows reads it as it is.
        want_logprobs = any(r.params.logprobs is not None for r in rows)
        logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None

        x = logits
        constrained = [i for i, r in enumerate(rows) if r.allowed is not None]
        penalized = [i for i, r in enumerate(rows) if r.params.needs_history]
        marked = [i for i, r in enumerate(rows) if r.params.watermark]
        if constrained or penalized or marked:
            x = logits.clone()
        if constrained:
            # The grammar goes first, as a hard constraint the penalties cannot undo.
            words = torch.stack([rows[i].allowed for i in constrained])  # type: ignore[misc]
            banned = banned_tokens(words.to(x.device), self.vocab_size)
            if len(constrained) == len(rows):
                x.masked_fill_(banned, float("-inf"))
            else:  # in place, row by row: no gathered copy of the constrained rows
                for j, i in enumerate(constrained):
                    x[i].masked_fill_(banned[j], float("-inf"))
        if marked:
            # TGI's order: the watermark before the penalties; it follows the token before the draw.
            previous = [_previous_token(rows[i]) for i in marked]
            if len(marked) == len(rows):
                apply_watermark(x, previous)
            else:
                for i, token in zip(marked, previous, strict=True):
                    apply_watermark(x[i : i + 1], [token])
        if penalized:
            chosen_rows = [rows[i] for i in penalized]
            self._penalties.apply(
                x,
                penalized,
                [r.request_id for r in chosen_rows],
                [r.params for r in chosen_rows],
                [r.prompt_token_ids for r in chosen_rows],
                [r.output_token_ids for r in chosen_rows],
            )

        sampled = [i for i, r in enumerate(rows) if r.params.temperature != 0.0]
        if len(sampled) == len(rows):
            tokens = self._draw(x, sampled, rows)
        else:
            tokens = greedy_pick(x)
            if sampled:
                tokens[sampled] = self._draw(x, sampled, rows)
        token_list = tokens.tolist()

        if logprobs is None:
            return SamplerOutput(token_list, None, None)
        chosen = logprobs.gather(1, tokens[:, None]).squeeze(1).tolist()
        top_n = max(r.params.logprobs or 0 for r in rows)
        top: list[list[tuple[int, float]]] = [[] for _ in rows]
        if top_n > 0:
            values, ids = logprobs.topk(top_n, dim=-1)  # sorted, best first
            all_values, all_ids = values.tolist(), ids.tolist()
            for i, r in enumerate(rows):
                n = r.params.logprobs or 0
                top[i] = list(zip(all_ids[i][:n], all_values[i][:n], strict=True))
        return SamplerOutput(token_list, chosen, top)

    def _draw(self, x: torch.Tensor, sampled: Sequence[int], rows: Sequence[SamplingRow]) -> torch.Tensor:
        """One token for each row of ``x`` (logits after penalties) listed in ``sampled``."""
        kernel = self._kernel_takes(x)
        by_kernel = [i for i in sampled if kernel and rows[i].params.typical_p >= 1.0]
        if len(by_kernel) == len(sampled):
            return self._draw_kernel(x, sampled, rows)
        rest = [i for i in sampled if not (kernel and rows[i].params.typical_p >= 1.0)]
        tokens = torch.empty(len(x), dtype=torch.long, device=x.device)
        if by_kernel:
            tokens[by_kernel] = self._draw_kernel(x, by_kernel, rows)
        sub = x[rest]
        if sub.element_size() < 4:
            sub = sub.float()
        tokens[rest] = self._draw_torch(sub, [rows[i] for i in rest])
        return tokens[list(sampled)]

    def _draw_kernel(self, x: torch.Tensor, chosen: Sequence[int], rows: Sequence[SamplingRow]) -> torch.Tensor:
        params = [rows[i].params for i in chosen]
        uniforms = _uniforms([rows[i] for i in chosen])
        settings = [
            [p.temperature, p.top_k if 0 < p.top_k < self.vocab_size else 0, p.top_p, p.min_p, u]
            for p, u in zip(params, uniforms, strict=True)
        ]
        return torch.ops.inflightq.sample_rows(
            x, torch.tensor(chosen, dtype=torch.long), torch.tensor(settings, dtype=torch.float64)
        )

    def _kernel_takes(self, x: torch.Tensor) -> bool:
        """Whether sample_rows can draw from ``x`` (then it takes every row without typical_p)."""
        return (
            self.kernel
            and x.device.type == "cpu"
            and x.dtype in (torch.float32, torch.bfloat16)
            and hasattr(torch.ops.inflightq, "sample_rows")
        )

    def _draw_torch(self, x: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """One token per row of ``x`` (logits after penalties, rows with temperature > 0)."""
        params = [r.params for r in rows]
        temperature = torch.tensor([p.temperature for p in params], dtype=x.dtype, device=x.device)
        x = x / temperature[:, None]
        tokens = torch.empty(len(rows), dtype=torch.long, device=x.device)

        pending = [i for i, p in enumerate(params) if has_filter(p, self.vocab_size)]
        full = [i for i, p in enumerate(params) if not has_filter(p, self.vocab_size)]
        # Flat distributions overflow the first candidate set; a 16x larger one still costs a
        # fraction of a full sort, which is left for what overflows both.
        for num_candidates in (self.num_candidates, self.num_candidates * 16):
            if not pending or num_candidates >= self.vocab_size:
                break
            sub = x if len(pending) == len(rows) else x[pending]
            cands = filter_candidates(sub, [params[i] for i in pending], num_candidates)
            exact = [j for j, ok in enumerate(cands.exact) if ok]
            if exact:
                chosen = self._race(cands.logits[exact], [rows[pending[j]] for j in exact])
                tokens[[pending[j] for j in exact]] = cands.token_ids[exact].gather(1, chosen[:, None])[:, 0]
            pending = [pending[j] for j, ok in enumerate(cands.exact) if not ok]
        full += pending
        if full:
            sub = x[full]
            filter_full(sub, [params[i] for i in full])
            tokens[full] = self._race(sub, [rows[i] for i in full])
        return tokens

    def _race(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """Index of a draw from softmax(logits) per row: inverse CDF, one uniform number per row.
        A seeded row's number is a hash of (seed, index), so it needs no generator state at all."""
        probs = torch.softmax(logits, dim=-1)
        cdf = probs.cumsum(dim=-1)
        u = torch.tensor(_uniforms(rows), dtype=torch.float64)
        target = u.to(device=cdf.device, dtype=cdf.dtype)[:, None] * cdf[:, -1:]
        picked = torch.searchsorted(cdf, target, right=True).clamp_(max=cdf.shape[1] - 1)
        # Rounding can land the target on the CDF's flat tail (zero-probability tokens): take the
        # most likely token instead, a correction of the order of float epsilon.
        bad = probs.gather(1, picked) == 0
        if bool(bad.any()):
            picked = torch.where(bad, probs.argmax(dim=-1, keepdim=True), picked)
        return picked[:, 0]


def _is_special(row: SamplingRow) -> bool:
    """A row that needs the logits copied and edited before the draw: penalties, watermark, grammar."""
    return row.params.needs_history or row.params.watermark or row.allowed is not None


def _uniforms(rows: Sequence[SamplingRow]) -> list[float]:
    """Each row's number in [0, 1) for its draw: a seeded row's from (seed, index), the others' from
    torch's global generator, one call for all of them, in row order. Plain lists: at one row,
    tensor masking here cost as much as the draw itself."""
    unseeded = sum(1 for r in rows if r.params.seed is None)
    fresh = iter(torch.rand(unseeded, dtype=torch.float64).tolist() if unseeded else [])
    return [_uniform(r.params.seed, r.index) if r.params.seed is not None else next(fresh) for r in rows]


def _previous_token(row: SamplingRow) -> int:
    return int(row.output_token_ids[-1] if len(row.output_token_ids) else row.prompt_token_ids[-1])


def _uniform(seed: int, index: int) -> float:
    """A number in [0, 1) fixed by (seed, index): 53 bits of derive_seed."""
    return (derive_seed(seed, index) >> 10) / float(1 << 53)
