"""Templates over the HTTP API, through a real client against uvicorn on loopback: a token builds
with its files in the body and runs code and sessions from its template; another token cannot
see, use or remove it; a failed build says which step; bad input is a 400 in the API's shape."""

from __future__ import annotations

import base64
import uuid

import httpx
import pytest

from sandloop import Sandloop, Settings
from sandloop.server.app import create_app
from sandloop.server.tokens import TokenStore
from tests.servers import serve_in_thread
from tests.template_packages import make_wheel

NAME = f"api-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tokens = TokenStore(tmp_path_factory.mktemp("api") / "tokens.sqlite")
    with Sandloop(Settings(pool_size=0)) as root:
        with serve_in_thread(create_app(tokens, sandloop=root)) as url:
            yield url, tokens, root
        for info in root.templates.list():
            if info.ref.startswith(NAME):
                root.templates.remove(info.ref)


def client(server, name):
    url, tokens, _ = server
    secret, _ = tokens.create(name, max_memory="1g", max_timeout=120)
    return httpx.Client(base_url=url, headers={"Authorization": f"Bearer {secret}"}, timeout=300)


def test_a_token_builds_and_uses_its_template_and_no_other_token_can(server, tmp_path):
    wheel = make_wheel(tmp_path)
    files = {
        wheel[2:]: base64.b64encode((tmp_path / wheel[2:]).read_bytes()).decode(),
        "conf/settings.txt": base64.b64encode(b"mode=api\n").decode(),
    }
    body = {
        "name": f"{NAME}:v1",
        "steps": [{"pip_install": [wheel]}, {"copy": {"src": "conf", "dest": "/opt/conf"}}, {"env": {"X": "1"}}],
        "files": files,
    }
    with client(server, "alice") as alice, client(server, "bob") as bob:
        r = alice.post("/v1/templates", json=body)
        assert r.status_code == 201, r.text
        assert r.json()["ref"] == f"{NAME}:v1" and r.json()["built_steps"] == 3
        code = (
            "import tinypkg, os; print(tinypkg.ANSWER, open('/opt/conf/settings.txt').read().strip(), os.environ['X'])"
        )
        r = alice.post("/v1/runs", json={"code": code, "template": f"{NAME}:v1"})
        assert r.status_code == 200 and r.json()["stdout"] == "42 mode=api 1\n", r.text
        r = alice.post("/v1/sessions", json={"template": f"{NAME}:v1"})
        assert r.status_code == 201, r.text
        session = r.json()["id"]
        r = alice.post(f"/v1/sessions/{session}/cells", json={"code": "import tinypkg; print(tinypkg.ANSWER)"})
        assert r.json()["stdout"] == "42\n", r.text
        assert alice.delete(f"/v1/templates/{NAME}:v1").status_code == 409  # in use
        assert alice.delete(f"/v1/sessions/{session}").status_code == 204
        # its own (the host operator's, built with the CLI, are listed too, not owned)
        assert [t["ref"] for t in alice.get("/v1/templates").json() if t["owned"]] == [f"{NAME}:v1"]
        # bob: not his to see, use, take over or remove
        assert [t for t in bob.get("/v1/templates").json() if t["owned"] or t["ref"].startswith(NAME)] == []
        assert bob.get(f"/v1/templates/{NAME}:v1").status_code == 404
        r = bob.post("/v1/runs", json={"code": "print(1)", "template": f"{NAME}:v1"})
        assert (r.status_code, r.json()["code"]) == (404, "not_found") and "no template" in r.json()["message"]
        assert bob.post("/v1/sessions", json={"template": f"{NAME}:v1"}).status_code == 404
        assert bob.post("/v1/templates", json={**body, "files": files}).status_code == 409
        assert bob.delete(f"/v1/templates/{NAME}:v1").status_code == 404
        assert alice.delete(f"/v1/templates/{NAME}:v1").status_code == 204
        assert alice.get(f"/v1/templates/{NAME}:v1").status_code == 404


def test_a_failed_build_and_bad_bodies_are_the_apis_errors(server):
    with client(server, "carol") as carol:
        r = carol.post("/v1/templates", json={"name": f"{NAME}-f", "steps": [{"run": "echo nope-marker; exit 4"}]})
        assert r.status_code == 400 and r.json()["code"] == "template_build_failed", r.text
        assert "step 1" in r.json()["message"] and "nope-marker" in r.json()["message"]
        for body, words in [
            ({"name": "Bad Name", "steps": []}, "not valid"),
            ({"name": f"{NAME}-x", "steps": [{"copy": {"src": "a", "dest": "/a"}}], "files": {"../a": "eA=="}}, "'..'"),
            ({"name": f"{NAME}-x", "steps": [], "files": {"a": "not base64!"}}, "not base64"),
            ({"name": f"{NAME}-x", "steps": [{"pip_install": ["--index-url=http://x"]}]}, "not a package"),
            ({"name": f"{NAME}-x", "steps": [], "colour": "red"}, "unknown field"),
            ({"name": f"{NAME}-x", "from": "nope-nope", "steps": []}, "no template"),
        ]:
            r = carol.post("/v1/templates", json=body)
            assert r.status_code in (400, 404) and words in r.json()["message"], (body, r.text)
        assert [t for t in carol.get("/v1/templates").json() if t["owned"]] == []
