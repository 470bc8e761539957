"""The foundation: settings, wire contract, key names, lifecycle, private Redis, model sources."""

from __future__ import annotations

import fnmatch
import uuid

import pytest
import redis
from pydantic import ValidationError
from redis.crc import key_slot

from inflightq_cli.redis_server import PrivateRedis, redis_answers
from shared import model_source
from shared.keys import Keys
from shared.request_lifecycle import FINAL_STATUSES, RequestStatus, can_move
from shared.schemas import DoneEvent, ErrorEvent, QueuedRequest, SamplingSpec, TokenEvent, parse_event
from shared.settings import Settings
from worker.engine.model import model_loader
from worker.models import locate


def test_settings_read_prefixed_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INFLIGHTQ_REDIS_URL", "redis://example:1234/2")
    monkeypatch.setenv("INFLIGHTQ_MAX_QUEUE_DEPTH", "7")
    monkeypatch.setenv("INFLIGHTQ_MODELS", "a, b")
    monkeypatch.setenv("INFLIGHTQ_RECLAIM_AFTER_S", "2.5")
    settings = Settings()
    assert settings.redis_url == "redis://example:1234/2"
    assert settings.max_queue_depth == 7
    assert settings.served_models == ["smollm2-135m-instruct", "a", "b"]
    assert settings.reclaim_after_s == 2.5


def test_settings_reject_nonsense(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INFLIGHTQ_MAX_QUEUE_DEPTH", "0")
    with pytest.raises(ValidationError):
        Settings()


def test_keys_share_a_slot_per_model_per_request_shard_and_per_deployment() -> None:
    keys = Keys.for_prefix("prod")
    queue = [keys.stream("m", 0), keys.stream("m", 3), keys.notify("m"), keys.dead_letters("m")]
    request = [keys.request("r"), keys.tokens_channel("r"), keys.replay_log("r")]
    deployment = [keys.cancel_channel(), keys.worker("w"), keys.workers(), keys.models()]
    names = queue + request + deployment
    assert all(name.startswith("{prod") for name in names)
    assert len(set(names)) == len(names)
    for group in (queue, request, deployment):
        assert len({key_slot(name.encode()) for name in group}) == 1
    assert key_slot(queue[0].encode()) != key_slot(request[0].encode())


def test_requests_spread_evenly_over_the_slot_ranges_of_three_masters() -> None:
    keys = Keys.for_prefix("prod")
    thirds = [0, 0, 0]
    for _ in range(3000):
        thirds[key_slot(keys.request(uuid.uuid4().hex).encode()) * 3 // 16384] += 1
    assert all(800 < n < 1200 for n in thirds), thirds


def test_a_prefix_glob_matches_every_key_of_its_deployment_and_none_of_another() -> None:
    keys, other = Keys.for_prefix("prod"), Keys.for_prefix("prod2")
    names = [keys.stream("m", 0), keys.request("r"), keys.workers()]
    assert all(fnmatch.fnmatchcase(name, keys.pattern().replace("\\", "")) for name in names)
    assert not any(fnmatch.fnmatchcase(name, keys.pattern().replace("\\", "")) for name in
                   [other.stream("m", 0), other.request("r"), other.workers()])  # fmt: skip


def test_events_round_trip_as_json_and_are_told_apart_by_type() -> None:
    token = TokenEvent(request_id="r", index=3, token_id=42, text=" hi", logprob=-0.5)
    assert parse_event(token.to_json()) == token
    error = ErrorEvent(request_id="r", error_type="cancelled", message="cancelled by client")
    assert isinstance(parse_event(error.to_json()), ErrorEvent)
    assert isinstance(
        parse_event(
            b'{"type":"done","request_id":"r","result":{"request_id":"r",'
            b'"model":"m","text":"","token_ids":[],"finish_reason":"length",'
            b'"usage":{"prompt_tokens":1,"completion_tokens":0,"total_tokens":1},'
            b'"timings":{"submitted_at":1.0}}}'
        ),
        DoneEvent,
    )


def test_queued_request_rejects_bad_fields() -> None:
    with pytest.raises(ValidationError):
        QueuedRequest(model="m", prompt_token_ids=[])
    with pytest.raises(ValidationError):
        SamplingSpec(top_p=0)
    with pytest.raises(ValidationError):
        SamplingSpec(stop=[""])
    with pytest.raises(ValidationError):
        QueuedRequest.model_validate_json('{"model": "m", "prompt_token_ids": [1], "pickle": "x"}')


def test_lifecycle_final_states_are_final() -> None:
    for status in FINAL_STATUSES:
        assert not any(can_move(status, other) for other in RequestStatus)
    assert can_move(RequestStatus.QUEUED, RequestStatus.RUNNING)
    assert not can_move(RequestStatus.QUEUED, RequestStatus.DONE)


def test_private_redis_is_a_real_server() -> None:
    server = PrivateRedis().start()
    try:
        client = redis.Redis.from_url(server.url)
        client.xadd("s", {"a": "1"})
        assert client.xlen("s") == 1
        assert int(client.info("server")["redis_version"].split(".")[0]) >= 6
    finally:
        server.stop()
    assert not redis_answers(server.url)


def test_the_engine_resolves_model_names_through_the_one_shared_table() -> None:
    source = model_source.resolve("smollm2-135m-instruct")
    # The distribution declares the worker's locate as the engine's default (pyproject.toml's entry point).
    assert model_loader.installed_resolver() is locate
    assert locate("smollm2-135m-instruct") == (source.file, str(source.converted_dir))
    assert not hasattr(model_loader, "ALIASES")


def test_a_resolver_passed_to_the_loader_maps_names_instead_of_the_installed_one(tiny_model_dir) -> None:
    asked: list[str] = []

    def resolve(name: str) -> tuple[str, str | None]:
        asked.append(name)
        return str(tiny_model_dir), None

    tokenizer = model_loader.load_tokenizer("a-name-only-this-resolver-knows", resolve=resolve)
    assert asked == ["a-name-only-this-resolver-knows"]
    assert tokenizer.encode("The quick brown fox")


def test_the_engine_imports_neither_shared_nor_redis_and_reads_no_environment() -> None:
    import re
    from pathlib import Path

    # Reads only: the compiled forward points inductor's cache at EngineConfig.compile_cache_dir by setting
    # the one variable inductor reads it from (a write, for a library, not a setting the engine reads).
    forbidden = re.compile(
        r"^\s*(from|import)\s+(shared|redis)\b|os\.environ(?!\[\"TORCHINDUCTOR_CACHE_DIR\"\] = )|getenv",
        re.MULTILINE,
    )
    engine = Path(model_loader.__file__).parent
    offenders = [str(p) for p in engine.rglob("*.py") if forbidden.search(p.read_text())]
    assert offenders == []


def test_default_model_alias_resolves_to_the_packaged_gguf() -> None:
    source = model_source.resolve("smollm2-135m-instruct")
    assert source.gguf_file == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert (source.converted_dir.parent.name) == "models"


def test_default_model_tokenizer_has_a_chat_template() -> None:
    tokenizer = model_source.load_tokenizer("smollm2-135m-instruct")
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert "<|im_start|>assistant" in text


def test_tiny_model_greedy_is_deterministic(tiny_model_dir) -> None:
    import torch

    model, tokenizer = model_loader.load_model(str(tiny_model_dir), dtype=torch.float64)
    ids = torch.tensor([tokenizer.encode("The quick brown fox")])
    first = model.generate(ids, max_new_tokens=8, do_sample=False)
    again = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert first.tolist() == again.tolist()
    assert first.shape[1] == ids.shape[1] + 8
