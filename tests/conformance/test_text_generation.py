"""Hugging Face's TGI client (`text-generation`), used as its README shows, against the real stack."""

from __future__ import annotations

import asyncio
import json

import pytest

text_generation = pytest.importorskip("text_generation")
from text_generation import AsyncClient, Client  # noqa: E402
from text_generation.errors import ValidationError  # noqa: E402
from text_generation.types import Grammar, GrammarType, Message  # noqa: E402


@pytest.fixture(scope="module")
def client(live_api) -> Client:
    return Client(live_api.url, timeout=120)


def test_generate(client: Client) -> None:
    response = client.generate("What is Deep Learning?", max_new_tokens=8)
    assert isinstance(response.generated_text, str)
    assert response.details.generated_tokens <= 8  # the client always asks for details


def test_generate_stream(client: Client) -> None:
    text = ""
    last = None
    for response in client.generate_stream("What is Deep Learning?", max_new_tokens=6):
        if not response.token.special:
            text += response.token.text
        last = response
    assert last is not None and last.details is not None
    assert last.generated_text is not None
    assert last.details.generated_tokens == 6 or last.details.finish_reason != "length"


def test_async_client(live_api) -> None:
    async def run() -> tuple[str, int]:
        client = AsyncClient(live_api.url, timeout=120)
        response = await client.generate("What is Deep Learning?", max_new_tokens=5)
        count = 0
        async for _ in client.generate_stream("What is Deep Learning?", max_new_tokens=5):
            count += 1
        return response.generated_text, count

    text, count = asyncio.run(run())
    assert isinstance(text, str) and 1 <= count <= 5


def test_details_decoder_input_details_top_n_tokens(client: Client) -> None:
    response = client.generate("What is Deep Learning?", max_new_tokens=4, decoder_input_details=True, top_n_tokens=3)
    details = response.details
    assert details.prefill and details.prefill[0].logprob is None
    assert len(details.tokens) == details.generated_tokens
    assert all(t.logprob is not None and t.logprob <= 0 for t in details.tokens)
    assert details.top_tokens is not None and len(details.top_tokens) == len(details.tokens)
    assert all(len(top) == 3 for top in details.top_tokens)
    # greedy: the chosen token is the most likely one
    assert all(top[0].id == tok.id for top, tok in zip(details.top_tokens, details.tokens, strict=True))


def test_stop_sequences(client: Client) -> None:
    free = client.generate("What is Deep Learning?", max_new_tokens=12).generated_text
    words = free.split()
    if len(words) < 2:
        pytest.skip("the tiny model's text has no word to stop at")
    stop = words[1]
    response = client.generate("What is Deep Learning?", max_new_tokens=12, stop_sequences=[stop])
    assert response.details.finish_reason == "stop_sequence"
    assert stop not in response.generated_text


def test_truncate(client: Client) -> None:
    long = "word " * 50
    response = client.generate(long, max_new_tokens=2, truncate=5, decoder_input_details=True)
    assert len(response.details.prefill) == 5


def test_seed(client: Client) -> None:
    a = client.generate("Once", max_new_tokens=8, do_sample=True, seed=7)
    b = client.generate("Once", max_new_tokens=8, do_sample=True, seed=7)
    assert a.generated_text == b.generated_text
    assert a.details.seed == 7


def test_best_of(client: Client) -> None:
    response = client.generate("Once", max_new_tokens=6, do_sample=True, best_of=3)
    details = response.details
    assert details.best_of_sequences is not None and len(details.best_of_sequences) == 2
    best = sum(t.logprob for t in details.tokens)
    for other in details.best_of_sequences:
        assert isinstance(other.generated_text, str) and other.seed is not None
        assert sum(t.logprob for t in other.tokens) <= best + 1e-9


def test_best_of_rules_are_the_clients(client: Client) -> None:
    with pytest.raises(ValidationError, match="sampling"):
        client.generate("Once", best_of=2)


def test_watermark(client: Client) -> None:
    plain = client.generate("Once", max_new_tokens=8)
    marked = client.generate("Once", max_new_tokens=8, watermark=True)
    again = client.generate("Once", max_new_tokens=8, watermark=True)
    assert marked.generated_text == again.generated_text  # greedy + watermark is deterministic
    assert marked.details.generated_tokens >= 1 and plain.details.generated_tokens >= 1


def test_grammar_regex_and_json(client: Client) -> None:
    response = client.generate(
        "Code:", max_new_tokens=10, grammar=Grammar(type=GrammarType.Regex, value="[A-Z]{2}-[0-9]{3}")
    )
    assert len(response.generated_text) == 6 and response.generated_text[2] == "-"
    schema = {
        "type": "object",
        "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["age"],
        "additionalProperties": False,
    }
    response = client.generate("Age:", max_new_tokens=20, grammar=Grammar(type=GrammarType.Json, value=schema))
    assert isinstance(json.loads(response.generated_text)["age"], int)


def test_chat(client: Client) -> None:
    response = client.chat(messages=[Message(role="user", content="What is Deep Learning?")], max_tokens=8)
    assert isinstance(response.choices[0].message.content, str)
    assert isinstance(response.system_fingerprint, str)


def test_chat_stream(client: Client) -> None:
    """Every chunk parses. The stream ends with OpenAI's `data: [DONE]`, as TGI's own (since 2.x) does,
    which this client version cannot parse: it raises after the last chunk (the README says so)."""
    chunks = []
    stream = client.chat(messages=[Message(role="user", content="What is Deep Learning?")], max_tokens=6, stream=True)
    with pytest.raises(json.JSONDecodeError):
        for chunk in stream:
            chunks.append(chunk)
    assert chunks and all(isinstance(c.system_fingerprint, str) for c in chunks)
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")


def test_async_chat(live_api) -> None:
    async def run():
        return await AsyncClient(live_api.url, timeout=120).chat(
            messages=[Message(role="user", content="Hi")], max_tokens=4
        )

    assert isinstance(asyncio.run(run()).choices[0].message.content, str)


def test_watermark_is_tgis_green_list(client: Client, live_api) -> None:
    """Greedy tokens under the watermark fall on TGI's green list (seeded by the token before) far more
    often than plain greedy tokens do: what TGI's detector counts."""
    import httpx

    from worker.engine.sampling.watermark import greenlist

    prompt = "Once upon a time"
    with httpx.Client(base_url=live_api.url) as http:
        last_prompt_token = http.post("/tokenize", json={"inputs": prompt}).json()[-1]["id"]

    def green_share(watermark: bool) -> float:
        tokens = client.generate(prompt, max_new_tokens=24, watermark=watermark).details.tokens
        previous = [last_prompt_token] + [t.id for t in tokens[:-1]]
        vocab = 49152
        hits = [t.id in set(greenlist(p, vocab).tolist()) for p, t in zip(previous, tokens, strict=True)]
        return sum(hits) / len(hits)

    assert green_share(True) >= 0.8 and green_share(True) > green_share(False)
