"""E2B's Template SDK, unchanged, against `sandloop serve` on loopback: a template built from the
SDK's own steps (pip_install, npm_install, apt_install, copy, run_cmd, envs, workdir, a start
command) and Sandbox.create from it; background builds and their status; exists; tags; delete;
what cannot be had here refused in E2B's words. Packages come from local files only."""

from __future__ import annotations

import asyncio
import time
import uuid

import httpx
import pytest
from e2b import AsyncTemplate, Sandbox, Template, wait_for_port
from e2b.exceptions import BuildException, TemplateException
from e2b_code_interpreter import Sandbox as CodeSandbox

from sandloop import Sandloop, Settings
from sandloop.server.app import create_app
from sandloop.server.tokens import TokenStore
from tests.servers import e2b_environment, serve_in_thread
from tests.template_packages import make_wheel

NAME = f"e2b-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tokens = TokenStore(tmp_path_factory.mktemp("e2b-templates") / "tokens.sqlite")
    alice, _ = tokens.create("alice", max_concurrent=8, runs_per_minute=1000, max_timeout=300, max_memory="1g")
    bob, _ = tokens.create("bob")
    with Sandloop(Settings(pool_size=0)) as root:
        with serve_in_thread(create_app(tokens, sandloop=root)) as url, e2b_environment(url, alice):
            yield {"url": url, "alice": alice, "bob": bob, "root": root}
            # as a user would: E2B's delete, which takes the builds' records with the templates
            # (this server's home is the host's: nothing of this module's may stay there)
            for suffix in ("", "-bg", "-bad", "-tags", "-async", "-refused", "-net", "-mine"):
                done = httpx.delete(f"{url}/templates/{NAME}{suffix}", headers={"X-API-Key": alice})
                assert done.status_code in (204, 404), done.text
        for info in root.templates.list():
            if info.ref.startswith(NAME):
                root.templates.remove(info.ref)
        records = root.settings.home / "e2b-builds"
        left = [p.name for p in records.glob("*.json") if f'"{NAME}' in p.read_text()]
        assert left == [], f"build records left in {records}: {left}"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("context")
    make_wheel(path)
    (path / "folder").mkdir()
    (path / "folder" / "test.txt").write_text("This is a test file.")
    (path / "folder" / "symlink.txt").symlink_to("test.txt")
    return path


@pytest.mark.serial  # its rebuild must find every step in the host's step cache, which other builds share
def test_a_template_from_the_sdk_runs_sandboxes(server, folder):
    logs = []
    template = (
        Template(file_context_path=str(folder))
        .from_template("code-interpreter-v1")
        .copy("tinypkg-1.0-py3-none-any.whl", "/opt/wheels/")
        .pip_install(["/opt/wheels/tinypkg-1.0-py3-none-any.whl"])  # a wheel the template holds
        .apt_install(["bash"])  # installed already: resolved on the host, nothing to fetch
        .copy("folder/*", "folder")
        .run_cmd("cat folder/test.txt && cat folder/symlink.txt")
        .set_envs({"MY_FLAG": "on"})
        .make_symlink("/usr/bin/python3", "/home/user/py")
        .set_workdir("/app")
        .set_start_cmd("python3 -m http.server 8000 --bind 127.0.0.1", wait_for_port(8000))
    )
    info = Template.build(template, f"{NAME}:v1", on_build_logs=logs.append)
    assert info.template_id == NAME and info.build_id
    assert any("This is a test file." in entry.message for entry in logs), "\n".join(e.message for e in logs)
    assert Template.exists(NAME) and Template.exists("base")
    assert not Template.exists(f"nonexistent-{uuid.uuid4().hex[:8]}")
    with CodeSandbox.create(f"{NAME}:v1", timeout=120) as sbx:
        execution = sbx.run_code("import tinypkg, os; print(tinypkg.ANSWER, os.environ['MY_FLAG'])")
        assert execution.logs.stdout == ["42 on\n"], execution
        assert sbx.files.read("/home/user/folder/test.txt") == "This is a test file."
        out = sbx.commands.run("ls /home/user && id -u")
        assert "folder" in out.stdout and out.stdout.split()[-1] == "65534"
        served = sbx.commands.run(
            "python3 -c \"import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:8000').status)\""
        )
        assert served.stdout.strip() == "200", served
    # a rebuild is cached
    logs.clear()
    Template.build(template, f"{NAME}:v1", on_build_logs=logs.append)
    assert sum("(cached)" in e.message for e in logs) >= 8, [e.message for e in logs]


def test_background_build_status_and_failure_with_its_step(server):
    template = Template().from_base_image().skip_cache().run_cmd("sleep 2").run_cmd("echo broken-marker; exit 3")
    info = Template.build_in_background(template, f"{NAME}-bg:v1", cpu_count=1, memory_mb=1024)
    status = Template.get_build_status(info)
    assert status.status.value in ("building", "waiting")
    deadline = time.monotonic() + 120
    while status.status.value in ("building", "waiting") and time.monotonic() < deadline:
        time.sleep(0.2)
        status = Template.get_build_status(info)
    assert status.status.value == "error"
    assert status.reason is not None and status.reason.step is not None
    assert "broken-marker" in status.reason.message and "exited 3" in status.reason.message
    with pytest.raises(BuildException, match="exited 3"):
        Template.build(Template().from_base_image().run_cmd("exit 3"), f"{NAME}-bad")
    assert not Template.exists(f"{NAME}-bad")


def test_tags_and_delete(server):
    ref = f"{NAME}-tags:v1-{uuid.uuid4().hex[:6]}"
    Template.build(Template().from_base_image().run_cmd("true"), ref)
    tagged = Template.assign_tags(ref, ["production", "stable"])
    assert set(tagged.tags) == {"production", "stable"} and tagged.build_id
    with pytest.raises(TemplateException):
        Template.assign_tags(ref, ":invalid-tag")
    with pytest.raises(TemplateException):
        Template.assign_tags(ref, f"{NAME}-tags:")
    assert {t.tag for t in Template.get_tags(f"{NAME}-tags")} >= {"production", "stable", ref.split(":")[1]}
    with Sandbox.create(f"{NAME}-tags:production", timeout=60) as sbx:
        assert sbx.commands.run("echo ok").stdout == "ok\n"
    Template.remove_tags(f"{NAME}-tags", ["stable"])
    assert "stable" not in {t.tag for t in Template.get_tags(f"{NAME}-tags")}


def test_async_template_sdk(server):
    async def main() -> None:
        info = await AsyncTemplate.build(
            AsyncTemplate().from_template("base").run_cmd("echo async > /home/user/a.txt"), f"{NAME}-async"
        )
        assert info.template_id == f"{NAME}-async"
        assert await AsyncTemplate.exists(f"{NAME}-async")

    asyncio.run(main())
    with Sandbox.create(f"{NAME}-async", timeout=60) as sbx:
        assert sbx.files.read("/home/user/a.txt") == "async\n"


@pytest.mark.parametrize(
    "template,words",
    [
        (lambda: Template().from_image("ubuntu:22.04").run_cmd("true"), "pulls from no registry"),
        (lambda: Template().from_image("ghcr.io/x/y", username="u", password="p"), "registry"),
        (lambda: Template().from_base_image().pip_install(), "named packages only"),
        (lambda: Template().from_base_image().run_cmd("pip install --index-url http://evil/ x"), "other options"),
        (lambda: Template().from_template("nope-nope"), "not found"),
        (lambda: Template().from_template("mcp-gateway").add_mcp_server("exa"), "sandloop serves MCP itself"),
        (lambda: Template().from_base_image().git_clone("https://github.com/e2b-dev/E2B"), "git clone cannot run"),
    ],
)
def test_what_cannot_be_had_is_refused_in_e2bs_words(server, template, words):
    with pytest.raises((BuildException, TemplateException), match=words):
        Template.build(template(), f"{NAME}-refused")


def test_a_build_reaches_no_host_and_another_key_sees_nothing(server):
    with pytest.raises(BuildException, match="exited"):
        Template.build(
            Template()
            .from_base_image()
            .run_cmd("python3 -c \"import socket; socket.create_connection(('1.1.1.1', 53), 3)\""),
            f"{NAME}-net",
        )
    Template.build(Template().from_base_image().run_cmd("true"), f"{NAME}-mine")
    assert not Template.exists(f"{NAME}-mine", api_key=server["bob"])
    with pytest.raises(Exception, match="not found"):
        Sandbox.create(f"{NAME}-mine", api_key=server["bob"])
