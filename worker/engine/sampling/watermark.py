"""TGI's watermark (Kirchenbauer et al. 2023, "A Watermark for Large Language Models"), as a logits
processor: before each draw, the token before it seeds a generator (``HASH_KEY * previous token``),
a permutation of the vocabulary drawn from it names the "green list" (its first ``GAMMA`` share),
and the green tokens' logits are raised by ``DELTA``. Text so written holds more green tokens than
chance; a detector that knows the scheme counts them and computes a z-score.

Bit-for-bit TGI's (``text_generation_server/utils/watermark.py``: CPU ``torch.Generator``,
``torch.randperm``, the same defaults), so TGI's detection applies unchanged: the
``WatermarkDetector`` of Kirchenbauer's ``lm-watermarking`` with ``gamma=0.5``,
``seeding_scheme="simple_1"`` (hash key 15485863), ``z_threshold=4.0``, over the model's tokenizer
and vocabulary size. TGI reads WATERMARK_GAMMA / WATERMARK_DELTA; here they are the constants below."""

from __future__ import annotations

import torch

GAMMA = 0.5  # share of the vocabulary on the green list (TGI's default)
DELTA = 2.0  # added to each green token's logit (TGI's default)
HASH_KEY = 15485863  # the millionth prime; seeds the green list from the previous token


def greenlist(previous_token: int, vocab_size: int, gamma: float = GAMMA) -> torch.Tensor:
    """Ids of the green list that follows ``previous_token`` (CPU, as TGI draws it)."""
    rng = torch.Generator(device="cpu")
    rng.manual_seed(HASH_KEY * previous_token)
    return torch.randperm(vocab_size, generator=rng)[: int(vocab_size * gamma)]


def apply_watermark(logits: torch.Tensor, previous_tokens: list[int], delta: float = DELTA) -> None:
    """Raise the green tokens' logits of each row (in place); row i follows ``previous_tokens[i]``."""
    vocab_size = logits.shape[-1]
    for i, previous in enumerate(previous_tokens):
        green = greenlist(previous, vocab_size).to(logits.device)
        logits[i].index_add_(0, green, torch.full(green.shape, delta, dtype=logits.dtype, device=logits.device))
