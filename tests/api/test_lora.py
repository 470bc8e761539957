"""LoRA adapters through every door: an adapter the worker's settings name and one registered at run
time (POST /v1/load_lora_adapter) answer on TGI's ``adapter_id``, as OpenAI's ``model`` and through the
Python client, greedy token for token what PEFT's model generates (float64, a real worker process);
/v1/models lists them with their base as ``parent``; an unknown adapter is a 404 naming it."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from inflightq_cli.redis_server import free_port
from shared.client import QueueClient
from shared.schemas import SamplingSpec
from tests.api.conftest import ApiServer
from tests.engine.conftest import reference
from tests.engine.test_lora import ADAPTERS, make_adapter
from worker.engine.model.model_loader import load_model

PROMPT = "The adapters of one base model"
METRICS_PORT = free_port()
MAX_NEW = 8


@pytest.fixture(scope="module")
def base_f64(tiny_model_dir: Path) -> Any:
    model, _ = load_model(str(tiny_model_dir), torch.float64, "cpu")
    return model


@pytest.fixture(scope="module")
def adapter_dirs(base_f64: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("api-adapters")
    return {
        name: make_adapter(base_f64, root / name, seed, *ADAPTERS[name]) for seed, name in enumerate(("all", "mlp"))
    }


@pytest.fixture(scope="module")
def expected(base_f64: Any, adapter_dirs: dict[str, Path], tiny_tokenizer: Any) -> dict[str | None, list[int]]:
    """PEFT's greedy tokens for PROMPT, per adapter (None: the base model), on the ids the API encodes."""
    from peft import PeftModel

    ids = tiny_tokenizer(PROMPT, add_special_tokens=True)["input_ids"]
    out: dict[str | None, list[int]] = {None: reference(base_f64, ids, MAX_NEW)}
    for name, path in adapter_dirs.items():
        out[name] = reference(PeftModel.from_pretrained(copy.deepcopy(base_f64), str(path)).eval(), ids, MAX_NEW)
    return out


@pytest.fixture(scope="module")
def live_worker_env(adapter_dirs: dict[str, Path]) -> dict[str, str]:
    """The module's worker (conftest's ``live_api``) names the adapter ``all`` in its settings."""
    return {
        "INFLIGHTQ_LORA_ADAPTERS": f"all={adapter_dirs['all']}",
        "INFLIGHTQ_MAX_LORAS": "2",
        "INFLIGHTQ_METRICS_PORT": str(METRICS_PORT),
    }


def generate(http: httpx.Client, adapter_id: str | None) -> httpx.Response:
    parameters = {"max_new_tokens": MAX_NEW, "details": True, "adapter_id": adapter_id}
    return http.post("/generate", json={"inputs": PROMPT, "parameters": parameters})


def tokens_of(response: httpx.Response) -> list[int]:
    assert response.status_code == 200, response.text
    return [t["id"] for t in response.json()["details"]["tokens"]]


def test_tgi_adapter_id_runs_the_adapter_as_peft_does(api: ApiServer, expected: dict[str | None, list[int]]) -> None:
    with api.client() as http:
        assert tokens_of(generate(http, "all")) == expected["all"]
        assert tokens_of(generate(http, None)) == expected[None]
    assert expected["all"] != expected[None]  # the adapter changes the answer


def test_openai_model_names_the_adapter_and_models_lists_it(api: ApiServer) -> None:
    with api.client() as http:
        tgi_text = generate(http, "all").json()["generated_text"]
        body = {"model": "all", "prompt": PROMPT, "max_tokens": MAX_NEW, "temperature": 0}
        completion = http.post("/v1/completions", json=body)
        assert completion.status_code == 200, completion.text
        assert completion.json()["choices"][0]["text"] == tgi_text
        cards = {card["id"]: card for card in http.get("/v1/models").json()["data"]}
        assert cards["all"]["parent"] == api.settings.model
        assert cards[api.settings.model]["parent"] is None
        assert http.get("/v1/models/all").json()["parent"] == api.settings.model


def test_an_unknown_adapter_is_a_404_naming_it(api: ApiServer) -> None:
    with api.client() as http:
        tgi = generate(http, "no-such-adapter")
        assert tgi.status_code == 404 and "no-such-adapter" in tgi.json()["error"]
        body = {"model": "no-such-adapter", "prompt": PROMPT, "max_tokens": 2}
        oai = http.post("/v1/completions", json=body)
        assert oai.status_code == 404 and "no-such-adapter" in oai.json()["error"]["message"]
        assert oai.json()["error"]["code"] == "model_not_found"


def test_an_adapter_registered_at_run_time_serves_until_unloaded(
    api: ApiServer, adapter_dirs: dict[str, Path], expected: dict[str | None, list[int]]
) -> None:
    with api.client() as http:
        assert generate(http, "mlp").status_code == 404
        loaded = http.post("/v1/load_lora_adapter", json={"lora_name": "mlp", "lora_path": str(adapter_dirs["mlp"])})
        assert loaded.status_code == 200, loaded.text
        assert loaded.json()["base"] == api.settings.model
        assert tokens_of(generate(http, "mlp")) == expected["mlp"]
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "mlp"}).status_code == 200
        assert generate(http, "mlp").status_code == 404
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "mlp"}).status_code == 404


def test_the_python_client_takes_the_adapter(
    api: ApiServer, tiny_tokenizer: Any, expected: dict[str | None, list[int]]
) -> None:
    ids = tiny_tokenizer(PROMPT, add_special_tokens=True)["input_ids"]
    with QueueClient(api.settings) as client:
        request_id = client.submit(api.settings.model, ids, SamplingSpec(max_new_tokens=MAX_NEW), adapter="all")
        assert client.result(request_id, timeout=60).token_ids == expected["all"]


def test_the_worker_counts_requests_and_tokens_per_adapter(api: ApiServer) -> None:
    with api.client() as http:
        assert generate(http, "all").status_code == 200
    scrape = httpx.get(f"http://127.0.0.1:{METRICS_PORT}/metrics", timeout=10).text
    samples = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in scrape.splitlines() if line[:1] != "#"}

    def value(name: str, **labels: str) -> float:
        return sum(
            v
            for k, v in samples.items()
            if k.startswith(name + "{") and all(f'{a}="{b}"' in k for a, b in labels.items())
        )

    assert value("inflightq_worker_adapter_requests_total", adapter="all") >= 1
    assert value("inflightq_worker_adapter_tokens_total", adapter="all", kind="generated") >= MAX_NEW
    assert value("inflightq_worker_adapter_loads_total") >= 2  # "all" at start, "mlp" on first use
    assert value("inflightq_worker_adapters_loaded") >= 1


def test_a_name_no_adapter_can_have_is_a_404_too(api: ApiServer) -> None:
    with api.client() as http:
        oai = http.post("/v1/completions", json={"model": "a b", "prompt": "hi", "max_tokens": 2})
        assert oai.status_code == 404 and "'a b'" in oai.json()["error"]["message"]
        tgi = http.post("/generate", json={"inputs": "hi", "parameters": {"adapter_id": "a b"}})
        assert tgi.status_code == 404 and "'a b'" in tgi.json()["error"]


def test_a_batch_line_names_the_adapter_as_its_model(api: ApiServer) -> None:
    from producer_api.batches.job import ApiLineHandler
    from shared.errors import ModelNotFoundError

    with QueueClient(api.settings) as client:
        handler = ApiLineHandler(api.settings, client.redis)
        line = {"model": "all", "prompt": PROMPT, "max_tokens": 2}
        prepared = handler.prepare("/v1/completions", line, None)
        assert (prepared.model, prepared.adapter) == (api.settings.model, "all")
        with pytest.raises(ModelNotFoundError, match="no-such-adapter"):
            handler.prepare("/v1/completions", {**line, "model": "no-such-adapter"}, None)
