"""The serving benchmark's workload: seeded synthetic chat requests with exact prompt and output lengths.

Like ``vllm bench serve --dataset-name random``, but each prompt is a real chat turn: the user
message is a run of whole-word vocabulary tokens, sized so that the chat-templated prompt (what the
API's chat route tokenizes) has the drawn number of tokens. Outputs are exact too: every request
sets ``ignore_eos`` and its own ``max_new_tokens``."""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Any

# Byte-level BPE marks a leading space with "Ġ"; such lowercase words stay one token each when
# joined with spaces, so a prompt's length is close to its word count and cheap to correct.
_WORD_TOKEN = re.compile(r"^Ġ[a-z]{3,9}$")
_FALLBACK_WORDS = (
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "lazy",
    "dog",
    "river",
    "mountain",
    "city",
    "garden",
    "window",
    "music",
    "paper",
    "light",
    "water",
    "story",
    "planet",
    "engine",
    "signal",
    "market",
    "winter",
    "summer",
    "forest",
    "ocean",
    "bridge",
    "letter",
    "number",
    "language",
    "school",
)


@dataclass(frozen=True)
class ChatSample:
    messages: list[dict[str, str]]
    prompt_text: str  # the chat-templated prompt, for TGI's /generate_stream (which takes raw text)
    prompt_token_ids: list[int]  # what the chat route, the queue client and the offline engines get
    output_len: int

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


def word_pool(tokenizer: Any) -> list[str]:
    vocab = tokenizer.get_vocab()
    words = sorted(" " + tok[1:] for tok in vocab if _WORD_TOKEN.match(tok))
    return words if len(words) >= 200 else [" " + w for w in _FALLBACK_WORDS]


def templated_ids(tokenizer: Any, messages: list[dict[str, str]]) -> tuple[str, list[int]]:
    # As the API's chat route does (producer_api/tokenization.py): template as text, then encode
    # without special tokens, because the template already wrote them.
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return text, list(tokenizer(text, add_special_tokens=False)["input_ids"])


def make_sample(tokenizer: Any, rng: random.Random, pool: list[str], prompt_len: int, output_len: int) -> ChatSample:
    overhead = len(templated_ids(tokenizer, [{"role": "user", "content": ""}])[1])
    words = rng.choices(pool, k=max(1, prompt_len - overhead))
    for _ in range(16):  # a few corrections: a word pair may merge or split at the template's edges
        messages = [{"role": "user", "content": "".join(words).strip()}]
        text, ids = templated_ids(tokenizer, messages)
        if len(ids) == prompt_len:
            break
        if len(ids) > prompt_len and len(words) > 1:
            words.pop()
        elif len(ids) < prompt_len:
            words.append(rng.choice(pool))
        else:
            break
    return ChatSample(messages, text, ids, output_len)


def synthetic_chat(
    tokenizer: Any,
    num_requests: int,
    *,
    input_len: tuple[int, int] = (50, 500),
    output_len: tuple[int, int] = (10, 200),
    seed: int = 0,
) -> list[ChatSample]:
    """``num_requests`` samples; prompt and output lengths uniform over the inclusive ranges."""
    rng = random.Random(seed)
    pool = word_pool(tokenizer)
    lengths = [(rng.randint(*input_len), rng.randint(*output_len)) for _ in range(num_requests)]
    return [make_sample(tokenizer, rng, pool, p, o) for p, o in lengths]


def describe(samples: list[ChatSample]) -> dict[str, Any]:
    prompts = [s.prompt_len for s in samples]
    outputs = [s.output_len for s in samples]
    return {
        "requests": len(samples),
        "prompt_tokens": {"total": sum(prompts), "min": min(prompts), "max": max(prompts)},
        "output_tokens": {"total": sum(outputs), "min": min(outputs), "max": max(outputs)},
    }
