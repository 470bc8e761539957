"""Real clients, unmodified, against the API with a real worker (tiny model, float64) on real Redis:
the openai package, huggingface_hub's InferenceClient, SSE resume, cancellation on disconnect."""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import redis
from huggingface_hub import InferenceClient
from prometheus_client.parser import text_string_to_metric_families

from shared.keys import Keys
from tests.api.conftest import ApiServer

pytestmark = pytest.mark.timeout(300)

LONG = {"max_new_tokens": 1500, "ignore_eos": True}  # long enough to still be running when we leave


@pytest.fixture
def http(api: ApiServer) -> Iterator[httpx.Client]:
    with api.client() as client:
        yield client


def sse_events(response: httpx.Response) -> Iterator[tuple[str | None, str]]:
    """(id, data) of each event of an SSE response."""
    event_id, data = None, []
    for line in response.iter_lines():
        if line.startswith("id:"):
            event_id = line[3:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].strip())
        elif line == "" and data:
            yield event_id, "\n".join(data)
            event_id, data = None, []


def wait_for_status(http: httpx.Client, request_id: str, wanted: set[str], timeout: float = 30) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        job = http.get(f"/v1/jobs/{request_id}").json()
        if job["status"] in wanted or time.monotonic() > deadline:
            return job
        time.sleep(0.1)


# OpenAI ----------------------------------------------------------------------------------------


def test_openai_chat_completion(oai: openai.OpenAI, api: ApiServer) -> None:
    reply = oai.chat.completions.create(
        model=api.settings.model,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}],
        max_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    choice = reply.choices[0]
    assert isinstance(choice.message.content, str) and choice.message.content
    assert choice.message.role == "assistant"
    assert choice.finish_reason == "length"
    assert reply.usage.completion_tokens == 8
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + 8
    assert reply.id.startswith("chatcmpl-")


def test_openai_chat_stream_matches_non_stream_and_reports_usage(oai: openai.OpenAI, api: ApiServer) -> None:
    request: dict[str, Any] = {
        "model": api.settings.model,
        "messages": [{"role": "user", "content": "Count to five"}],
        "max_completion_tokens": 10,
        "temperature": 0,
    }
    whole = oai.chat.completions.create(**request)
    chunks = list(oai.chat.completions.create(**request, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_openai_chat_logprobs(oai: openai.OpenAI, api: ApiServer) -> None:
    reply = oai.chat.completions.create(
        model=api.settings.model,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
    )
    content = reply.choices[0].logprobs.content
    assert len(content) == 4
    for item in content:
        assert item.logprob <= 0
        assert len(item.top_logprobs) == 3
        # Greedy: the chosen token is the most likely one.
        assert item.logprob == pytest.approx(max(t.logprob for t in item.top_logprobs), abs=1e-6)


def test_openai_completion_with_logprobs_stop_and_echo(oai: openai.OpenAI, api: ApiServer) -> None:
    reply = oai.completions.create(
        model=api.settings.model, prompt="Once upon a time", max_tokens=6, temperature=0, logprobs=2, echo=True
    )
    choice = reply.choices[0]
    assert choice.text.startswith("Once upon a time")
    assert len(choice.logprobs.tokens) == reply.usage.completion_tokens
    assert all(len(top) <= 2 for top in choice.logprobs.top_logprobs)
    generated = choice.text[len("Once upon a time") :]
    if len(generated) > 2:
        stop = generated[1:3]
        stopped = oai.completions.create(
            model=api.settings.model, prompt="Once upon a time", max_tokens=6, temperature=0, stop=stop
        )
        assert stop not in stopped.choices[0].text
        assert stopped.choices[0].finish_reason == "stop"


def test_openai_completion_stream(oai: openai.OpenAI, api: ApiServer) -> None:
    whole = oai.completions.create(model=api.settings.model, prompt="The sky is", max_tokens=8, temperature=0)
    chunks = list(
        oai.completions.create(model=api.settings.model, prompt="The sky is", max_tokens=8, temperature=0, stream=True)
    )
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_openai_n_choices_with_seed_are_reproducible(oai: openai.OpenAI, api: ApiServer) -> None:
    request: dict[str, Any] = {
        "model": api.settings.model,
        "prompt": "Random words:",
        "max_tokens": 6,
        "temperature": 1.0,
        "n": 3,
        "seed": 1234,
        "extra_body": {"ignore_eos": True},
    }
    first = oai.completions.create(**request)
    second = oai.completions.create(**request)
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.text for c in first.choices] == [c.text for c in second.choices]
    assert first.usage.completion_tokens == 18
    streamed = list(oai.completions.create(**request, stream=True))
    assert {c.choices[0].index for c in streamed} == {0, 1, 2}


def test_openai_models_lists_the_live_model(oai: openai.OpenAI, api: ApiServer) -> None:
    assert [m.id for m in oai.models.list()] == [api.settings.model]


def test_openai_errors_reach_the_sdk_as_its_exceptions(oai: openai.OpenAI, api: ApiServer) -> None:
    with pytest.raises(openai.BadRequestError) as info:  # a 400, as OpenAI and vLLM answer
        oai.completions.create(model=api.settings.model, prompt="x", max_tokens=10**6)
    assert "max_tokens" in str(info.value)
    with pytest.raises(openai.NotFoundError) as not_found:
        oai.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "hi"}])
    assert not_found.value.code == "model_not_found" and not_found.value.param == "model"
    with pytest.raises(openai.NotFoundError):
        oai.completions.create(model="gpt-9", prompt="hi")
    with pytest.raises(openai.BadRequestError) as bad_json:
        oai.post(
            "/chat/completions",
            cast_to=object,
            content=b'{"model": "x", "messages": [',
            options={"headers": {"Content-Type": "application/json"}},
        )
    assert "JSON" in bad_json.value.message


# huggingface_hub -------------------------------------------------------------------------------


def test_inference_client_text_generation(api: ApiServer) -> None:
    client = InferenceClient(base_url=api.url)
    text = client.text_generation("Hello", max_new_tokens=5)
    out = client.text_generation("Hello", max_new_tokens=5, details=True, decoder_input_details=True)
    assert out.generated_text == text  # greedy: the same text twice
    assert text == "".join(t.text for t in out.details.tokens if not t.special)  # its tokens, nothing else
    assert out.details.generated_tokens == len(out.details.tokens) <= 5
    assert out.details.finish_reason in ("length", "eos_token", "stop_sequence")
    assert [t.id for t in out.details.prefill] == [
        t["id"] for t in httpx.post(f"{api.url}/tokenize", json={"inputs": "Hello"}).json()
    ]
    assert all(t.logprob <= 0 for t in out.details.tokens)


def test_inference_client_text_generation_stream(api: ApiServer) -> None:
    client = InferenceClient(base_url=api.url)
    whole = client.text_generation("Hello there", max_new_tokens=6, details=True)
    events = list(client.text_generation("Hello there", max_new_tokens=6, details=True, stream=True))
    assert [e.token.id for e in events] == [t.id for t in whole.details.tokens]
    assert all(e.generated_text is None and e.details is None for e in events[:-1])
    assert events[-1].generated_text == whole.generated_text
    assert events[-1].details.finish_reason == whole.details.finish_reason
    assert events[-1].details.generated_tokens == whole.details.generated_tokens
    tokens = list(client.text_generation("Hello there", max_new_tokens=6, stream=True))
    assert "".join(tokens) == whole.generated_text


def test_inference_client_sampling_reports_its_seed(api: ApiServer) -> None:
    client = InferenceClient(base_url=api.url)
    out = client.text_generation("Hi", max_new_tokens=4, do_sample=True, details=True)
    assert out.details.seed is not None
    again = client.text_generation("Hi", max_new_tokens=4, do_sample=True, seed=out.details.seed, details=True)
    assert again.generated_text == out.generated_text


# TGI routes ------------------------------------------------------------------------------------


def test_generate_sets_tgi_timing_headers(http: httpx.Client) -> None:
    response = http.post("/generate", json={"inputs": "Hi", "parameters": {"max_new_tokens": 3, "ignore_eos": True}})
    assert response.status_code == 200, response.text
    headers = response.headers
    for name in (
        "x-compute-time",
        "x-total-time",
        "x-validation-time",
        "x-queue-time",
        "x-inference-time",
        "x-time-per-token",
    ):
        assert float(headers[name]) >= 0, name
    assert headers["x-compute-type"] == "cpu"
    assert headers["x-generated-tokens"] == "3"
    assert int(headers["x-prompt-tokens"]) == 1
    assert int(headers["x-total-time"]) >= int(headers["x-inference-time"])


def test_generate_stream_event_shape(http: httpx.Client) -> None:
    body = {"inputs": "Hi", "parameters": {"max_new_tokens": 3, "ignore_eos": True, "top_n_tokens": 2}}
    with http.stream("POST", "/generate_stream", json=body) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [json.loads(data) for _, data in sse_events(response)]
    assert [e["index"] for e in events] == [0, 1, 2]
    for event in events:
        assert set(event) == {"index", "token", "generated_text", "details", "top_tokens"}
        assert set(event["token"]) == {"id", "text", "logprob", "special"}
        assert len(event["top_tokens"]) == 2
    assert events[-1]["details"] == {"finish_reason": "length", "generated_tokens": 3, "input_length": 1, "seed": None}


def test_compat_route_answers_a_list_or_a_stream(http: httpx.Client) -> None:
    parameters = {"max_new_tokens": 2, "ignore_eos": True}
    response = http.post("/", json={"inputs": "Hi", "parameters": parameters})
    (answer,) = response.json()  # TGI's compat route answers a list
    with http.stream("POST", "/", json={"inputs": "Hi", "parameters": parameters, "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [json.loads(data) for _, data in sse_events(r)]
    # The stream is /generate_stream's: one event per token, the last with the same text (greedy).
    assert [e["index"] for e in events] == [0, 1]
    assert events[-1]["generated_text"] == answer["generated_text"]


# Jobs ------------------------------------------------------------------------------------------


def test_job_lifecycle_and_resumable_stream(http: httpx.Client) -> None:
    created = http.post("/v1/jobs", json={"prompt": "Tell me", "max_new_tokens": 6, "ignore_eos": True, "priority": 0})
    assert created.status_code == 202
    job_id = created.json()["id"]
    job = wait_for_status(http, job_id, {"done"})
    result = job["result"]
    assert job["priority"] == 0 and job["worker"]
    assert result["finish_reason"] == "length" and len(result["token_ids"]) == 6
    assert result["usage"]["completion_tokens"] == 6

    with http.stream("GET", f"/v1/jobs/{job_id}/stream") as response:
        events = list(sse_events(response))
    assert [event_id for event_id, _ in events] == ["0", "1", "2", "3", "4", "5"]
    assert json.loads(events[-1][1])["generated_text"] == result["generated_text"]

    with http.stream("GET", f"/v1/jobs/{job_id}/stream", headers={"last-event-id": "2"}) as response:
        resumed = list(sse_events(response))
    assert [event_id for event_id, _ in resumed] == ["3", "4", "5"]
    assert [json.loads(d)["token"]["id"] for _, d in resumed] == result["token_ids"][3:]


def test_job_messages_use_the_chat_template(http: httpx.Client) -> None:
    created = http.post("/v1/jobs", json={"messages": [{"role": "user", "content": "hi"}], "max_new_tokens": 2})
    assert created.json()["prompt_tokens"] > 10  # the template's system prompt and role markers
    assert wait_for_status(http, created.json()["id"], {"done"})["status"] == "done"


def test_delete_cancels_a_running_job(http: httpx.Client) -> None:
    job_id = http.post("/v1/jobs", json={"prompt": "Go on", **LONG}).json()["id"]
    wait_for_status(http, job_id, {"running"})
    assert http.delete(f"/v1/jobs/{job_id}").json()["cancelled"] is True
    job = wait_for_status(http, job_id, {"cancelled"})
    assert job["status"] == "cancelled"
    assert http.delete(f"/v1/jobs/{job_id}").json()["cancelled"] is False


# Disconnects -----------------------------------------------------------------------------------


def test_leaving_a_stream_cancels_its_request(http: httpx.Client) -> None:
    with http.stream("POST", "/generate_stream", json={"inputs": "Go", "parameters": LONG}) as response:
        request_id = response.headers["x-request-id"]
        next(sse_events(response))
    assert wait_for_status(http, request_id, {"cancelled"})["status"] == "cancelled"


def test_leaving_a_chat_stream_cancels_every_choice(oai: openai.OpenAI, api: ApiServer, http: httpx.Client) -> None:
    stream = oai.chat.completions.create(
        model=api.settings.model,
        messages=[{"role": "user", "content": "Go"}],
        n=2,
        stream=True,
        max_tokens=LONG["max_new_tokens"],
        extra_body={"ignore_eos": True},
    )
    with stream:
        request_id = stream.response.headers["x-request-id"]
        next(iter(stream))
    assert wait_for_status(http, request_id, {"cancelled"})["status"] == "cancelled"


CANCELLED_ON_DISCONNECT = ("inflightq_api_cancelled_on_disconnect_total", frozenset())


@pytest.mark.parametrize("n", [1, 2])
def test_a_stream_left_by_its_client_counts_one_cancellation_per_choice(
    oai: openai.OpenAI, api: ApiServer, http: httpx.Client, n: int
) -> None:
    before = metric_samples(http)[CANCELLED_ON_DISCONNECT]
    stream = oai.chat.completions.create(
        model=api.settings.model,
        messages=[{"role": "user", "content": "Go"}],
        n=n,
        stream=True,
        max_tokens=LONG["max_new_tokens"],
        extra_body={"ignore_eos": True},
    )
    with stream:
        request_id = stream.response.headers["x-request-id"]
        next(iter(stream))
    assert wait_for_status(http, request_id, {"cancelled"})["status"] == "cancelled"
    deadline = time.monotonic() + 30  # counted as the API gives up each choice, beside the cancel
    while (counted := metric_samples(http)[CANCELLED_ON_DISCONNECT]) < before + n and time.monotonic() < deadline:
        time.sleep(0.05)
    assert counted == before + n  # a second count for the same choice would come with the first


def test_a_non_stream_client_that_leaves_cancels_its_request(api: ApiServer, http: httpx.Client) -> None:
    keys = Keys.for_prefix(api.settings.key_prefix)
    r = redis.Redis.from_url(api.settings.redis_url, decode_responses=True)
    before = set(r.scan_iter(match=keys.request_pattern()))
    with pytest.raises(httpx.ReadTimeout), httpx.Client(base_url=api.url, timeout=1.5) as impatient:
        impatient.post("/generate", json={"inputs": "Go", "parameters": LONG})
    (key,) = set(r.scan_iter(match=keys.request_pattern())) - before
    deadline = time.monotonic() + 30
    while r.hget(key, "status") != "cancelled" and time.monotonic() < deadline:
        time.sleep(0.1)
    assert r.hget(key, "status") == "cancelled"
    r.close()


def metric_samples(http: httpx.Client) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample of /metrics by (name, labels)."""
    families = text_string_to_metric_families(http.get("/metrics").text)
    return {(s.name, frozenset(s.labels.items())): s.value for f in families for s in f.samples}


def test_metrics_count_tokens_and_latencies(http: httpx.Client, api: ApiServer) -> None:
    """Counted, not merely registered: one more request, exactly its tokens, one more TTFT and
    two inter-token gaps observed for its route (a metric name alone is there from the start)."""
    before = metric_samples(http)
    body = {"inputs": "Hi", "parameters": {"max_new_tokens": 3, "ignore_eos": True}}
    assert http.post("/generate", json=body).status_code == 200
    after = metric_samples(http)
    route = frozenset({("route", "/generate")})
    model = frozenset({("model", api.settings.model)})

    def delta(name: str, labels: frozenset[tuple[str, str]]) -> float:
        return after.get((name, labels), 0.0) - before.get((name, labels), 0.0)

    ok = frozenset({("error_type", ""), ("route", "/generate"), ("status", "200")})
    assert delta("inflightq_api_requests_total", ok) == 1
    assert delta("inflightq_api_generated_tokens_total", model) == 3
    assert delta("inflightq_api_time_to_first_token_seconds_count", route) == 1
    assert delta("inflightq_api_inter_token_latency_seconds_count", route) == 2
    assert delta("inflightq_api_time_to_first_token_seconds_sum", route) > 0


def test_a_request_past_its_timeout_is_408_expired(http: httpx.Client, oai: openai.OpenAI, api: ApiServer) -> None:
    # A client error: its own deadline passed. Not a 5xx, which would page operators.
    response = http.post("/generate", json={"inputs": "Go", "parameters": {**LONG, "timeout": 0.5}})
    assert response.status_code == 408, response.text
    assert response.json()["error_type"] == "expired"
    with pytest.raises(openai.APIStatusError) as info:
        oai.completions.create(
            model=api.settings.model, prompt="Go", max_tokens=1500, extra_body={"ignore_eos": True, "timeout": 0.5}
        )
    assert info.value.status_code == 408


def test_inference_client_chat_completion(api: ApiServer) -> None:
    # With a base_url, huggingface_hub sends the placeholder model name "dummy": it means the default model.
    client = InferenceClient(base_url=api.url)
    reply = client.chat_completion([{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0)
    assert reply.choices[0].message.role == "assistant"
    assert reply.model == api.settings.model
    chunks = list(client.chat_completion([{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == reply.choices[0].message.content


@pytest.mark.slow
def test_many_concurrent_streams_each_get_their_own_tokens(api: ApiServer) -> None:
    async def one(client: httpx.AsyncClient, i: int) -> tuple[int, list[int], str]:
        body = {"inputs": f"Request number {i}", "parameters": {"max_new_tokens": 8, "ignore_eos": True}}
        async with client.stream("POST", "/generate_stream", json=body) as response:
            events = [json.loads(line[5:]) async for line in response.aiter_lines() if line.startswith("data:")]
        return i, [e["token"]["id"] for e in events], events[-1]["generated_text"]

    async def run() -> list[tuple[int, list[int], str]]:
        async with httpx.AsyncClient(base_url=api.url, timeout=120) as client:
            return await asyncio.gather(*(one(client, i) for i in range(12)))

    results = asyncio.run(run())
    with httpx.Client(base_url=api.url, timeout=120) as http:
        for i, token_ids, text in results:
            assert len(token_ids) == 8
            # Greedy and float64: the same request alone gives the same tokens (no cross-talk between streams).
            alone = http.post(
                "/generate",
                json={
                    "inputs": f"Request number {i}",
                    "parameters": {"max_new_tokens": 8, "ignore_eos": True, "details": True},
                },
            ).json()
            assert [t["id"] for t in alone["details"]["tokens"]] == token_ids
            assert alone["generated_text"] == text


def test_resuming_a_running_jobs_stream_continues_after_the_last_seen_token(http: httpx.Client) -> None:
    job_id = http.post("/v1/jobs", json={"prompt": "Go on", **LONG}).json()["id"]
    with http.stream("GET", f"/v1/jobs/{job_id}/stream") as response:
        events = sse_events(response)
        first = [next(events) for _ in range(3)]
    assert http.get(f"/v1/jobs/{job_id}").json()["status"] == "running"  # leaving did not cancel it
    with http.stream("GET", f"/v1/jobs/{job_id}/stream", headers={"last-event-id": first[-1][0]}) as response:
        resumed = list(itertools.islice(sse_events(response), 3))
    # On failure, say what the stream ended with and where the job stood (a bare StopIteration said nothing).
    job = {k: v for k, v in http.get(f"/v1/jobs/{job_id}").json().items() if k != "result"}
    assert [event_id for event_id, _ in first + resumed] == ["0", "1", "2", "3", "4", "5"], (resumed, job)
    http.delete(f"/v1/jobs/{job_id}")
