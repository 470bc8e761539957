"""/docs (Swagger UI) and /redoc render in a real headless Chromium with every host but the API's own
unreachable: their assets come from the fastapi-offline wheel, not a CDN. Screenshots land in the
test's output directory (printed)."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from shared.settings import Settings
from tests.api.conftest import ApiServer

CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--no-first-run",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    # The machine without internet: every host name but the API's loopback address fails to resolve.
    "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
    "--window-size=1280,1000",
    "--virtual-time-budget=15000",
]


def chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if not found:
        if os.environ.get("CI"):
            pytest.fail(".ci/run installs Debian's chromium; it is missing")
        pytest.skip("no chromium here (apt-get install chromium)")
    return found


def browse(binary: str, url: str, profile: Path, *extra: str) -> str:
    run = subprocess.run(
        [binary, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *extra, url],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout


@pytest.fixture(scope="module")
def api(
    redis_url: str, module_prefix: str, tiny_model_dir: Path, start_api: Callable[[Settings], ApiServer]
) -> ApiServer:
    return start_api(Settings(redis_url=redis_url, key_prefix=module_prefix, model=str(tiny_model_dir)))


def test_docs_pages_reference_no_other_host(api: ApiServer) -> None:
    for page in ("/docs", "/redoc"):
        html = httpx.get(api.url + page).text
        assert "cdn." not in html and "https://" not in html, html
        for asset in ("swagger-ui-bundle.js", "swagger-ui.css") if page == "/docs" else ("redoc.standalone.js",):
            assert asset in html
            response = httpx.get(f"{api.url}/docs-assets/{asset}")
            assert response.status_code == 200 and len(response.content) > 100_000


@pytest.mark.parametrize(
    ("page", "rendered"),
    [
        # Swagger UI builds one block per operation, each with its path; the raw page holds none of this.
        ("/docs", ['class="opblock-summary-path"', "/generate_stream", "/v1/chat/completions"]),
        # ReDoc renders the API's description and one entry per operation from /openapi.json.
        ("/redoc", ["continuous batching", "Submit a job; answers at once with its id"]),
    ],
)
def test_docs_render_offline_in_chromium(api: ApiServer, tmp_path: Path, page: str, rendered: list[str]) -> None:
    binary = chromium()
    dom = browse(binary, api.url + page, tmp_path / "profile-dom", "--dump-dom")
    for text in rendered:
        assert text in dom, f"{page} did not render {text!r} offline: {dom[:2000]}"
    shot = tmp_path / f"{page.strip('/')}.png"
    browse(binary, api.url + page, tmp_path / "profile-shot", f"--screenshot={shot}")
    assert shot.stat().st_size > 10_000, "a blank page is a few KB"
    print(f"screenshot: {shot}")
