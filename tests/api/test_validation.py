"""Everything wrong with a request is a JSON error naming the problem, before anything is queued: a
422 on TGI's routes and the jobs API, a 400 on OpenAI's (as OpenAI answers; 413/404 on both); nothing
hostile gets a 5xx. No worker is needed."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from shared.settings import Settings
from tests.api.conftest import ApiServer


@pytest.fixture(scope="module")
def api(
    redis_url: str, module_prefix: str, tiny_model_dir: Path, start_api: Callable[[Settings], ApiServer]
) -> ApiServer:
    settings = Settings(
        redis_url=redis_url,
        key_prefix=module_prefix,
        model=str(tiny_model_dir),
        max_input_tokens=32,
        max_total_tokens=48,
        max_new_tokens=24,
        max_stop_sequences=2,
        max_body_bytes=4096,
        no_worker_wait_s=0.2,
    )
    return start_api(settings)


@pytest.fixture
def http(api: ApiServer) -> Iterator[httpx.Client]:
    with api.client() as client:
        yield client


JSON = {"content-type": "application/json"}


def tgi_error(response: httpx.Response, status: int = 422) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) >= {"error", "error_type"}, body
    return body


def openai_error(response: httpx.Response, status: int = 400) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    return error


def test_malformed_json_is_422(http: httpx.Client) -> None:
    body = tgi_error(http.post("/generate", content=b'{"inputs": "hi",', headers={"content-type": "application/json"}))
    assert body["error_type"] == "validation"
    assert "JSON" in body["error"]


def test_missing_body_is_422(http: httpx.Client) -> None:
    assert tgi_error(http.post("/generate"))["error_type"] == "validation"


def test_wrong_type_names_the_field(http: httpx.Client) -> None:
    body = tgi_error(http.post("/generate", json={"inputs": "hi", "parameters": {"max_new_tokens": "many"}}))
    assert body["field"] == "parameters.max_new_tokens"


def test_unknown_parameter_is_refused(http: httpx.Client) -> None:
    body = tgi_error(http.post("/generate", json={"inputs": "hi", "parameters": {"max_new_tokenz": 3}}))
    assert "max_new_tokenz" in body["error"]


def test_prompt_over_max_input_tokens(http: httpx.Client) -> None:
    body = tgi_error(http.post("/generate", json={"inputs": "word " * 100}))
    assert body["field"] == "inputs"
    assert "32" in body["error"]


def test_prompt_plus_max_new_tokens_over_max_total(http: httpx.Client) -> None:
    body = tgi_error(http.post("/generate", json={"inputs": "word " * 30, "parameters": {"max_new_tokens": 20}}))
    assert body["field"] == "parameters.max_new_tokens"
    assert "48" in body["error"]


@pytest.mark.parametrize("value", [0, -1, 25])
def test_max_new_tokens_not_positive_or_over_the_cap(http: httpx.Client, value: int) -> None:
    body = tgi_error(http.post("/generate", json={"inputs": "hi", "parameters": {"max_new_tokens": value}}))
    assert body["field"] == "parameters.max_new_tokens"


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("temperature", -0.5),
        ("temperature", 0),
        ("top_p", 1.5),
        ("top_p", 0),
        ("top_k", -3),
        ("repetition_penalty", 0),
        ("frequency_penalty", 3),
        ("typical_p", 2),
        ("seed", -1),
        ("priority", -1),
        ("priority", 9),
        ("timeout", 0),
        ("best_of", 2),  # without sampling, as TGI
        ("best_of", 5),  # past max_best_of
        ("top_n_tokens", 100),
    ],
)
def test_out_of_range_sampling_values(http: httpx.Client, name: str, value: float) -> None:
    body = tgi_error(http.post("/generate", json={"inputs": "hi", "parameters": {name: value}}))
    assert body["field"] == f"parameters.{name}" or body["field"] == name, body


def test_deadline_in_the_past(http: httpx.Client) -> None:
    body = tgi_error(http.post("/generate", json={"inputs": "hi", "parameters": {"deadline": 1000.0}}))
    assert body["field"] == "deadline"


def test_too_many_stop_sequences(http: httpx.Client) -> None:
    body = tgi_error(http.post("/generate", json={"inputs": "hi", "parameters": {"stop": ["a", "b", "c"]}}))
    assert body["field"] == "parameters.stop"


def test_empty_stop_sequence(http: httpx.Client) -> None:
    tgi_error(http.post("/generate_stream", json={"inputs": "hi", "parameters": {"stop": [""]}}))


def test_invalid_or_unsupported_tgi_features_are_refused_not_ignored(http: httpx.Client) -> None:
    tgi_error(http.post("/generate", json={"inputs": "hi", "parameters": {"grammar": {"type": "regex", "value": "("}}}))
    # An adapter the deployment does not have: a 404 naming the parameter, never a run of the base model.
    body = tgi_error(http.post("/generate", json={"inputs": "hi", "parameters": {"adapter_id": "lora"}}), 404)
    assert body["field"] == "parameters.adapter_id" and "'lora'" in body["error"]


@pytest.mark.parametrize(
    ("path", "parameters", "field"),
    [
        ("/generate", {"best_of": 2, "do_sample": True, "seed": 1}, "parameters.seed"),
        ("/generate_stream", {"best_of": 2, "do_sample": True}, "parameters.best_of"),
    ],
)
def test_best_of_follows_tgis_rules(http: httpx.Client, path: str, parameters: dict, field: str) -> None:
    assert tgi_error(http.post(path, json={"inputs": "hi", "parameters": parameters}))["field"] == field


def test_empty_inputs(http: httpx.Client) -> None:
    assert tgi_error(http.post("/", json={"inputs": ""}))["field"] == "inputs"


def test_openai_unknown_model_is_404_model_not_found(http: httpx.Client) -> None:
    messages = [{"role": "user", "content": "hi"}]
    for path, body in [
        ("/v1/chat/completions", {"model": "gpt-9", "messages": messages}),
        ("/v1/completions", {"model": "gpt-9", "prompt": "hi"}),
    ]:
        error = openai_error(http.post(path, json=body), status=404)
        assert error["param"] == "model"
        assert error["type"] == "invalid_request_error"
        assert error["code"] == "model_not_found"


def test_openai_malformed_json_is_400(http: httpx.Client) -> None:
    for path in ("/v1/chat/completions", "/v1/completions"):
        error = openai_error(http.post(path, content=b'{"model": "x",', headers=JSON), status=400)
        assert error["type"] == "invalid_request_error" and error["code"] == "invalid_json"
        assert "JSON" in error["message"]
        openai_error(http.post(path), status=400)  # no body at all


def test_openai_validation_errors_are_400_invalid_request_error_naming_the_param(
    http: httpx.Client, api: ApiServer
) -> None:
    model = api.settings.model
    for path, body, param in [
        ("/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": "hi"}], "n": 0}, "n"),
        ("/v1/completions", {"model": model, "prompt": "hi", "top_p": 7}, "top_p"),
        ("/v1/responses", {"model": model, "input": "hi", "temperature": 9}, "temperature"),
    ]:
        error = openai_error(http.post(path, json=body), status=400)
        assert error["type"] == "invalid_request_error" and error["param"] == param, error


def test_error_metrics_name_each_failure_by_its_own_type(http: httpx.Client) -> None:
    http.post("/v1/chat/completions", json={"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]})
    http.post("/v1/completions", content=b"{", headers=JSON)
    http.post("/v1/completions", json={"model": "m", "prompt": "hi", "n": 0})
    text = http.get("/metrics").text
    for series in (
        '{error_type="model_not_found",route="/v1/chat/completions",status="404"}',
        '{error_type="invalid_json",route="/v1/completions",status="400"}',
        '{error_type="validation",route="/v1/completions",status="400"}',
    ):
        assert f"inflightq_api_requests_total{series}" in text, series


def test_tgi_routes_keep_tgis_codes_for_the_same_mistakes(http: httpx.Client) -> None:
    """TGI answers 422 for an unknown model and for a body it cannot parse; its routes here do too."""
    assert tgi_error(http.post("/generate", content=b"{", headers=JSON))["error_type"] == "validation"
    body = {"model": "gpt-9", "prompt": "hi"}
    assert tgi_error(http.post("/v1/jobs", json=body))["field"] == "model"


def test_openai_bad_role(http: httpx.Client, api: ApiServer) -> None:
    messages = [{"role": "user", "content": "hi"}, {"role": "wizard", "content": "x"}]
    error = openai_error(http.post("/v1/chat/completions", json={"model": api.settings.model, "messages": messages}))
    assert error["param"] == "messages.1.role"


def test_openai_empty_messages(http: httpx.Client, api: ApiServer) -> None:
    error = openai_error(http.post("/v1/chat/completions", json={"model": api.settings.model, "messages": []}))
    assert error["param"] == "messages"


def test_openai_wrong_types(http: httpx.Client, api: ApiServer) -> None:
    body = {"model": api.settings.model, "prompt": "hi", "max_tokens": "ten"}
    assert openai_error(http.post("/v1/completions", json=body))["param"] == "max_tokens"
    body = {"model": api.settings.model, "prompt": "hi", "temperature": 3}
    assert openai_error(http.post("/v1/completions", json=body))["param"] == "temperature"
    body = {"model": api.settings.model, "prompt": "hi", "n": 0}
    assert openai_error(http.post("/v1/completions", json=body))["param"] == "n"


def test_openai_prompt_too_long(http: httpx.Client, api: ApiServer) -> None:
    error = openai_error(http.post("/v1/completions", json={"model": api.settings.model, "prompt": "word " * 100}))
    assert error["param"] == "prompt"


def test_openai_max_tokens_over_the_cap(http: httpx.Client, api: ApiServer) -> None:
    body = {"model": api.settings.model, "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 99}
    assert openai_error(http.post("/v1/chat/completions", json=body))["param"] == "max_completion_tokens"


def test_openai_token_ids_outside_the_vocabulary(http: httpx.Client, api: ApiServer) -> None:
    error = openai_error(http.post("/v1/completions", json={"model": api.settings.model, "prompt": [1, 10**9]}))
    assert error["param"] == "prompt"


def test_openai_too_many_stops(http: httpx.Client, api: ApiServer) -> None:
    body = {"model": api.settings.model, "prompt": "hi", "stop": ["a", "b", "c"]}
    assert openai_error(http.post("/v1/completions", json=body))["param"] == "stop"


def test_openai_malformed_tools_are_refused(http: httpx.Client, api: ApiServer) -> None:
    body = {
        "model": api.settings.model,
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"type": "function"}],
    }
    assert openai_error(http.post("/v1/chat/completions", json=body))["param"] == "tools"


def test_jobs_need_exactly_one_of_prompt_or_messages(http: httpx.Client) -> None:
    tgi_error(http.post("/v1/jobs", json={"max_new_tokens": 3}))
    tgi_error(http.post("/v1/jobs", json={"prompt": "a", "messages": [{"role": "user", "content": "b"}]}))


def test_jobs_validate_sampling_fields(http: httpx.Client) -> None:
    assert tgi_error(http.post("/v1/jobs", json={"prompt": "a", "top_p": 0}))["field"] == "top_p"
    assert tgi_error(http.post("/v1/jobs", json={"prompt": "a", "model": "nope"}))["field"] == "model"
    assert tgi_error(http.post("/v1/jobs", json={"prompt": "a", "max_new_tokens": 1000}))["field"] == "max_new_tokens"
    assert tgi_error(http.post("/v1/jobs", json={"prompt": "a", "stop_token_ids": [-5]}))["field"] == "stop_token_ids"
    assert tgi_error(http.post("/v1/jobs", json={"prompt": [10**9]}))["field"] == "prompt"
    infinite = http.post("/v1/jobs", content=b'{"prompt": "a", "timeout": 1e400}', headers=JSON)
    assert tgi_error(infinite)["field"] == "timeout"


def test_body_over_the_limit_by_content_length_is_413(http: httpx.Client) -> None:
    body = tgi_error(http.post("/generate", json={"inputs": "x" * 10_000}), status=413)
    assert body["error_type"] == "payload_too_large"


def test_body_over_the_limit_without_content_length_is_413(http: httpx.Client) -> None:
    def chunks() -> Iterator[bytes]:
        yield b'{"inputs": "'
        for _ in range(10):
            yield b"x" * 1000
        yield b'"}'

    # A generator body is sent chunked: no Content-Length, so the server must count.
    response = http.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert openai_error(response, status=413)["code"] == "payload_too_large"


def test_unknown_job_is_404_json(http: httpx.Client) -> None:
    assert tgi_error(http.get("/v1/jobs/" + "x" * 500), status=404)["error_type"] == "not_found"
    assert tgi_error(http.get("/v1/jobs/does-not-exist"), status=404)["error_type"] == "not_found"
    assert tgi_error(http.delete("/v1/jobs/does-not-exist"), status=404)["error_type"] == "not_found"
    assert tgi_error(http.get("/v1/jobs/does-not-exist/stream"), status=404)["error_type"] == "not_found"


def test_unknown_route_is_404_json(http: httpx.Client) -> None:
    assert tgi_error(http.get("/nope"), status=404)["error_type"] == "not_found"


@pytest.mark.parametrize(
    "payload",
    [
        b"[]",
        b"null",
        b'"a string"',
        b'{"inputs": null}',
        b'{"inputs": ["a"]}',
        b'{"inputs": "hi", "parameters": []}',
        b'{"inputs": "hi", "parameters": {"stop": "a"}}',
        b'{"inputs": "\\ud800"}',
        b"\xff\xfe\x00garbage",
        b'{"inputs": "hi", "parameters": {"max_new_tokens": 1e309}}',
        b'{"inputs": "hi", "parameters": {"seed": 99999999999999999999999}}',
        b'{"inputs": "hi", "parameters": {"repetition_penalty": Infinity}}',
        b'{"inputs": "hi", "parameters": {"temperature": NaN}}',
        b'{"inputs": "hi", "timeout": 1e400, "prompt": "x", "model": "m", "messages": []}',
        b"[" * 3000 + b"]" * 3000,
    ],
)
def test_hostile_bodies_never_5xx(http: httpx.Client, payload: bytes) -> None:
    for path in (
        "/generate",
        "/generate_stream",
        "/",
        "/tokenize",
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/jobs",
    ):
        response = http.post(path, content=payload, headers={"content-type": "application/json"})
        assert 400 <= response.status_code < 500, (path, response.status_code, response.text)
        assert "Traceback" not in response.text


def test_tokenize_returns_tgi_tokens(http: httpx.Client) -> None:
    tokens = http.post("/tokenize", json={"inputs": "hello world"}).json()
    assert [t["text"] for t in tokens] == ["hello", " world"]
    assert tokens[1]["start"] == 5 and tokens[1]["stop"] == 11


def test_info_reports_limits(http: httpx.Client, api: ApiServer) -> None:
    info = http.get("/info").json()
    assert info["model_id"] == api.settings.model
    assert info["max_input_tokens"] == 32
    assert info["max_total_tokens"] == 48
    assert info["max_stop_sequences"] == 2


def test_health_is_ok_while_redis_answers(http: httpx.Client, api: ApiServer) -> None:
    health = http.get("/health").json()
    assert health == {"status": "ok", "redis": True, "workers": {api.settings.model: 0}}


def test_metrics_expose_api_series(http: httpx.Client) -> None:
    http.post("/generate", json={"inputs": ""})
    text = http.get("/metrics").text
    assert 'inflightq_api_requests_total{error_type="validation",route="/generate",status="422"}' in text
    for name in (
        "inflightq_api_request_duration_seconds",
        "inflightq_api_time_to_first_token_seconds",
        "inflightq_api_inter_token_latency_seconds",
        "inflightq_api_generated_tokens_total",
        "inflightq_api_streams_in_flight",
    ):
        assert name in text


def test_openapi_documents_every_route_with_response_models(http: httpx.Client) -> None:
    spec = http.get("/openapi.json").json()
    paths = spec["paths"]
    for path in (
        "/",
        "/generate",
        "/generate_stream",
        "/info",
        "/health",
        "/metrics",
        "/tokenize",
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/models",
        "/v1/jobs",
        "/v1/jobs/{job_id}",
        "/v1/jobs/{job_id}/stream",
    ):
        assert path in paths, path
    generate = paths["/generate"]["post"]
    assert "GenerateResponse" in str(generate["responses"]["200"])
    assert {"422", "429", "503"} <= set(generate["responses"])
    assert "ChatCompletion" in str(paths["/v1/chat/completions"]["post"]["responses"]["200"])
    assert http.get("/docs").status_code == 200


def client_port(response: httpx.Response) -> int:
    """The local port of the connection that carried ``response``."""
    return int(response.extensions["network_stream"].get_extra_info("client_addr")[1])


def test_an_unexpected_failure_is_a_500_in_the_routes_shape_and_the_connection_stays_usable(
    redis_url: str, key_prefix: str, tiny_model_dir: Path, start_api: Callable[[Settings], ApiServer]
) -> None:
    api = start_api(Settings(redis_url=redis_url, key_prefix=key_prefix, model=str(tiny_model_dir)))

    async def broken(*args: object, **kwargs: object) -> str:
        raise RuntimeError("secret internals")

    dispatcher = api.app.state.inflightq.dispatcher
    dispatcher.client.enqueue = broken  # the jobs route queues without waiting for a worker
    dispatcher.wait_for_worker = broken  # the OpenAI routes wait for one first
    internal = {"message": "internal server error", "type": "server_error", "param": None, "code": "internal"}
    ports = set()
    with api.client() as http:  # one keep-alive connection, as long as the server keeps it open
        for path, body, answer in [
            ("/v1/jobs", {"prompt": "hi"}, {"error": "internal server error", "error_type": "internal"}),
            ("/v1/completions", {"model": api.settings.model, "prompt": "hi"}, {"error": internal}),
            ("/v1/jobs", {"prompt": "hi"}, {"error": "internal server error", "error_type": "internal"}),
        ]:
            failed = http.post(path, json=body)
            assert failed.status_code == 500 and failed.json() == answer, failed.text
            fine = http.post("/tokenize", json={"inputs": "hello world"})
            assert fine.status_code == 200, fine.text
            ports |= {client_port(failed), client_port(fine)}
    assert len(ports) == 1, "a failed request must not cost the client its connection"


def test_an_internal_failure_is_a_json_500_without_details(
    redis_url: str, key_prefix: str, tiny_model_dir: Path, start_api: Callable[[Settings], ApiServer]
) -> None:
    api = start_api(Settings(redis_url=redis_url, key_prefix=key_prefix, model=str(tiny_model_dir)))

    async def broken(*args: object, **kwargs: object) -> str:
        raise RuntimeError("secret internals")

    api.app.state.inflightq.dispatcher.client.enqueue = broken  # what the API queues a request with
    with api.client() as http:
        response = http.post("/v1/jobs", json={"prompt": "hi"})
    assert response.status_code == 500
    assert response.json() == {"error": "internal server error", "error_type": "internal"}
