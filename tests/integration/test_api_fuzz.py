"""Schema-based fuzzing of the OpenAPI spec (schemathesis): no input may produce a 5xx."""

from __future__ import annotations

import atexit
import contextlib
import shutil
import tempfile
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, settings

from sandloop.server.app import create_app
from sandloop.server.tokens import TokenStore

_DIR = Path(tempfile.mkdtemp(prefix="fuzz-tokens-"))
# Made when the module is imported, so in every process that collects it (each xdist worker, and
# passes that select none of its tests): gone when that process ends, whichever ran the tests.
atexit.register(shutil.rmtree, _DIR, ignore_errors=True)
TOKENS = TokenStore(_DIR / "tokens.sqlite")
SECRET, TOKEN = TOKENS.create("fuzz", max_concurrent=4, runs_per_minute=100_000, max_memory="512m", max_timeout=20)
schema = schemathesis.openapi.from_asgi("/openapi.json", create_app(TOKENS))


@pytest.fixture(scope="module", autouse=True)
def _cleanup():
    yield
    from sandloop.sessions import Session

    for sid in TOKENS.sessions_of(TOKEN.id):  # sessions the fuzzer created
        with contextlib.suppress(Exception):
            Session.attach(sid).delete()
    from sandloop.root import default_root

    templates = default_root().templates  # and the templates it built (its own)
    for info in templates.list(owner=TOKEN.id):
        if info.owner == TOKEN.id:
            with contextlib.suppress(Exception):
                templates.remove(info.ref, owner=TOKEN.id)
    shutil.rmtree(_DIR, ignore_errors=True)


@schema.parametrize()
@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_input_gives_a_server_error(case):
    if case.path == "/v1/agent/runs" and isinstance(case.body, dict):
        case.body["base_url"] = "http://127.0.0.1:9/v1"  # never let fuzzed input send traffic anywhere else
    response = case.call(headers={"Authorization": f"Bearer {SECRET}"})
    assert response.status_code < 500, (case.method, case.path, response.status_code, response.text[:500])
