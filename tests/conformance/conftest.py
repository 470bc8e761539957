"""Conformance fixtures: the real stack of tests/api (API + Redis + one worker on the tiny model)."""

from __future__ import annotations

import os

import pytest

from tests.api.conftest import live_api, live_worker_env, module_prefix, start_api, tiny_tokenizer  # noqa: F401

# litellm fetches a price list from GitHub at import unless told to use its bundled copy.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")


@pytest.fixture(scope="module")
def model(live_api) -> str:  # noqa: F811
    return live_api.settings.model
