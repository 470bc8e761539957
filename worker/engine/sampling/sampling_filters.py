"""top_k, top_p, min_p and typical_p, applied in that order (HF's), each on what the previous
ones left, renormalised.

Two ways to apply them, with the same result:
- on the whole vocabulary (sorts of [rows, vocab], costly on a CPU), and
- on a row's top-K candidates only, when the row's first active filter provably drops every
  token outside them (top_k <= K; top_p reached within the candidates; min_p's threshold above
  the K-th probability; typical_p's cut before any outside token's distance to the entropy).
  That is the common case for top_p / top_k requests and costs one topk for the batch.
Whether a row qualifies depends only on its own logits and parameters, never on the batch."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from worker.engine.sampling.sampling_params import SamplingParams

NEG_INF = float("-inf")


def has_filter(p: SamplingParams, vocab_size: int) -> bool:
    return 0 < p.top_k < vocab_size or p.top_p < 1.0 or p.min_p > 0.0 or p.typical_p < 1.0


# -- whole vocabulary -----------------------------------------------------------------------------


def filter_full(x: torch.Tensor, params: Sequence[SamplingParams]) -> None:
    """Applies every active filter to rows of tempered logits ``x`` [rows, vocab], in place."""
    vocab = x.shape[1]
    top_k = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    if any(top_k):
        _rows(x, top_k, 0, _top_k_full)
    _rows(x, [p.top_p for p in params], 1.0, _top_p_full)
    _rows(x, [p.min_p for p in params], 0.0, _min_p_full)
    _rows(x, [p.typical_p for p in params], 1.0, _typical_p_full)


def _rows(x: torch.Tensor, values: Sequence[float], neutral: float, fn: object) -> None:
    """Runs ``fn`` on the rows whose value is not neutral (over a full row, a cumulative sum can
    round past 1.0 and drop tail tokens by accident, so neutral rows are left alone)."""
    active = [i for i, v in enumerate(values) if v != neutral]
    if not active:
        return
    param = torch.tensor([values[i] for i in active], dtype=x.dtype, device=x.device)[:, None]
    if len(active) == x.shape[0]:
        fn(x, param)  # type: ignore[operator]
        return
    idx = torch.tensor(active, device=x.device)
    sub = x.index_select(0, idx)
    fn(sub, param)  # type: ignore[operator]
    x.index_copy_(0, idx, sub)


def _top_k_full(x: torch.Tensor, k: torch.Tensor) -> None:
    """Keeps each row's k largest logits (and ties with the k-th, as HF does)."""
    k_max = int(k.max())
    kth = x.topk(k_max, dim=-1).values.gather(1, k.long() - 1)
    x.masked_fill_(x < kth, NEG_INF)


def _top_p_full(x: torch.Tensor, top_p: torch.Tensor) -> None:
    """Keeps the smallest set of most likely tokens whose probability reaches top_p."""
    sorted_logits, order = x.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    drop = probs.cumsum(dim=-1) - probs >= top_p  # mass of strictly more likely tokens
    drop[:, 0] = False
    x.masked_fill_(drop.scatter(1, order, drop), NEG_INF)


def _min_p_full(x: torch.Tensor, min_p: torch.Tensor) -> None:
    """Drops tokens less likely than min_p times the most likely one."""
    probs = x.softmax(dim=-1)
    x.masked_fill_(probs < probs.amax(dim=-1, keepdim=True) * min_p, NEG_INF)


def _typical_p_full(x: torch.Tensor, typical_p: torch.Tensor) -> None:
    """Locally typical sampling: the tokens whose surprise is closest to the entropy, until their
    mass reaches typical_p."""
    logp = x.log_softmax(dim=-1)
    p = logp.exp()
    entropy = -(p * logp).nan_to_num().sum(dim=-1, keepdim=True)
    order = (-logp - entropy).abs().argsort(dim=-1)  # dropped tokens: inf, so last
    sorted_p = p.gather(1, order)
    drop = sorted_p.cumsum(dim=-1) - sorted_p >= typical_p
    drop[:, 0] = False
    x.masked_fill_(drop.scatter(1, order, drop), NEG_INF)


# -- top-K candidates -----------------------------------------------------------------------------


@dataclass
class Candidates:
    token_ids: torch.Tensor  # [rows, K], most likely first
    logits: torch.Tensor  # [rows, K], -inf where filtered out
    exact: list[bool]  # per row: the candidates hold everything the filters keep


def filter_candidates(x: torch.Tensor, params: Sequence[SamplingParams], num_candidates: int) -> Candidates:
    """Applies the filters to each row's top-K of tempered logits ``x``; rows that are not
    ``exact`` must be redone with :func:`filter_full`."""
    rows, vocab = x.shape
    k_cand = min(num_candidates, vocab)
    full_logp = x.log_softmax(dim=-1)
    cand_logp, ids = full_logp.topk(k_cand, dim=-1)
    device, dtype = x.device, x.dtype
    keep = torch.ones(rows, k_cand, dtype=torch.bool, device=device)
    # restricted: a filter has already dropped everything outside the candidates, so later
    # filters work on the renormalised candidates. With a vocabulary of K tokens there is no outside.
    restricted = torch.full((rows,), k_cand == vocab, dtype=torch.bool, device=device)
    inexact = torch.zeros(rows, dtype=torch.bool, device=device)
    last = cand_logp[:, -1]  # the best any outside token can be

    def current() -> torch.Tensor:
        # Log-probs of what is left: candidates renormalised, or for unrestricted rows the full
        # distribution's values (the outside still holds mass).
        masked = cand_logp.masked_fill(~keep, NEG_INF)
        return torch.where(restricted[:, None], masked.log_softmax(dim=-1), cand_logp)

    def settle(active: torch.Tensor, kept: torch.Tensor, outside_dropped: torch.Tensor) -> None:
        nonlocal keep, restricted, inexact
        keep = keep & (kept | ~active[:, None])
        inexact = inexact | (active & ~restricted & ~outside_dropped)
        restricted = restricted | active

    def column(values: Sequence[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=device)

    top_k = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    if any(top_k):
        k = torch.tensor(top_k, device=device)
        kth = cand_logp.gather(1, (k.clamp(1, k_cand) - 1)[:, None])
        settle(k > 0, cand_logp >= kth, (k <= k_cand) & (last < kth[:, 0]))

    top_p = [p.top_p for p in params]
    if any(v < 1.0 for v in top_p):
        mass = column(top_p)
        prob = current().exp()
        kept = prob.cumsum(dim=-1) - prob < mass[:, None]
        kept[:, 0] = True
        settle(mass < 1.0, kept, prob.sum(dim=-1) >= mass)

    min_p = [p.min_p for p in params]
    if any(v > 0.0 for v in min_p):
        share = column(min_p)
        prob = current().exp()
        threshold = prob.amax(dim=-1) * share
        settle(share > 0.0, prob >= threshold[:, None], last.exp() < threshold)

    typical_p = [p.typical_p for p in params]
    if any(v < 1.0 for v in typical_p):
        mass = column(typical_p)
        logp = current()
        prob = logp.exp()
        # The entropy of what is left: all candidates when restricted, else the whole vocabulary.
        full_entropy = -(full_logp.exp() * full_logp).nan_to_num().sum(dim=-1)
        cand_entropy = -(prob * logp).nan_to_num().sum(dim=-1)
        entropy = torch.where(restricted, cand_entropy, full_entropy)
        distance = (-logp - entropy[:, None]).abs()
        sorted_distance, order = distance.sort(dim=-1)
        sorted_prob = prob.gather(1, order)
        cum = sorted_prob.cumsum(dim=-1)
        kept_sorted = cum - sorted_prob < mass[:, None]
        kept_sorted[:, 0] = True
        cut = kept_sorted.sum(dim=-1, keepdim=True) - 1
        reached = cum.gather(1, cut)[:, 0] >= mass
        # Outside tokens are at least as surprising as the last candidate.
        outside_distance = -last - entropy
        outside_dropped = reached & (sorted_distance.gather(1, cut)[:, 0] < outside_distance)
        settle(mass < 1.0, kept_sorted.scatter(1, order, kept_sorted), outside_dropped)

    logits = cand_logp.masked_fill(~keep, NEG_INF)
    exact = (restricted & ~inexact).tolist()
    return Candidates(ids, logits, exact)
