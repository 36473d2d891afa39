"""What E2B's own SDK test suites found against sandloop (issue 23), each as our own test with the
official SDK, unchanged, against a real server: listing (order, paging, filters), a shorter
timeout, command timeouts, a sandbox killed under a running command, files (gzip both ways, the
mode, a symlink's target, removing what is not there), and a token made with plain defaults
surviving a burst of file calls."""

from __future__ import annotations

import time
import uuid
from datetime import timedelta

import pytest
from e2b import Sandbox, SandboxQuery, TimeoutException
from e2b.sandbox.filesystem.filesystem import WriteEntry

from sandloop.server.app import create_app
from sandloop.server.tokens import TokenStore
from tests.servers import e2b_environment, serve_in_thread


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tokens = TokenStore(tmp_path_factory.mktemp("e2b-conformance") / "tokens.sqlite")
    key, _ = tokens.create("plain-defaults")  # as `sandloop tokens create NAME` makes it
    with serve_in_thread(create_app(tokens)) as url, e2b_environment(url, key):
        yield url


@pytest.fixture
def made(server):
    boxes: list[Sandbox] = []

    def make(**kw) -> Sandbox:
        box = Sandbox.create(timeout=kw.pop("timeout", 300), **kw)
        boxes.append(box)
        return box

    yield make
    failed = []
    for box in boxes:  # each one, even when an earlier kill failed (a sandbox of its own is left else)
        try:
            box.kill()
        except Exception as exc:  # noqa: BLE001 - said below, after the others are killed
            failed.append(f"{box.sandbox_id}: {exc!r}")
    assert not failed, failed


def test_list_is_newest_first_pages_by_cursor_and_filters(made):
    tag = str(uuid.uuid4())
    first = made(metadata={"tag": tag})
    second = made(metadata={"tag": tag})
    query = SandboxQuery(metadata={"tag": tag})
    assert [s.sandbox_id for s in Sandbox.list(query=query).next_items()] == [second.sandbox_id, first.sandbox_id]
    ascending = Sandbox.list(query=query, order="asc").next_items()
    assert [s.sandbox_id for s in ascending] == [first.sandbox_id, second.sandbox_id]
    pages = Sandbox.list(query=query, limit=1)
    one = pages.next_items()
    assert [s.sandbox_id for s in one] == [second.sandbox_id] and pages.has_next and pages.next_token
    made(metadata={"tag": "another"})  # a sandbox made between pages moves no one
    two = pages.next_items()
    assert [s.sandbox_id for s in two] == [first.sandbox_id] and not pages.has_next and pages.next_token is None
    started = first.get_info().started_at
    after = Sandbox.list(query=SandboxQuery(metadata={"tag": tag}, started_after=started)).next_items()
    assert first.sandbox_id in [s.sandbox_id for s in after]
    later = started + timedelta(seconds=1)
    assert first.sandbox_id not in [
        s.sandbox_id for s in Sandbox.list(query=SandboxQuery(metadata={"tag": tag}, started_after=later)).next_items()
    ]
    template = first.get_info().template_id
    assert len(Sandbox.list(query=SandboxQuery(metadata={"tag": tag}, template=template)).next_items()) == 2
    assert Sandbox.list(query=SandboxQuery(metadata={"tag": tag}, template="unknown-template")).next_items() == []


def test_a_shorter_timeout_ends_the_sandbox_at_once_when_it_passes(made):
    box = made()
    box.set_timeout(2)  # before: only lengthening worked
    end = box.get_info().end_at
    assert (end - box.get_info().started_at).total_seconds() < 60
    while time.time() < end.timestamp() + 0.5:  # the clock is the mechanism here
        time.sleep(0.2)
    assert box.is_running(request_timeout=10) is False  # not after the next sweep: now


def test_a_command_past_its_timeout_raises_and_is_killed(made):
    box = made()
    with pytest.raises(TimeoutException):
        box.commands.run("sleep 300", timeout=2)  # before: it ran on and returned at its end
    with pytest.raises(TimeoutException):  # while following it; or at its start, on a busy host
        for _ in box.commands.run("sleep 300", timeout=2, background=True):
            pass
    # killed at its deadline by the server, whether the client still follows or not (the SDK
    # gives up at the same moment, so the kill is waited for, not assumed)
    deadline = time.monotonic() + 60
    while [p for p in box.commands.list() if "sleep 300" in " ".join([p.cmd, *p.args])]:
        assert time.monotonic() < deadline, "the timed-out commands were never killed"
        time.sleep(0.2)
    assert box.commands.run("echo fine", timeout=10).stdout == "fine\n"


def test_a_sandbox_killed_under_a_running_command_says_so(made):
    box = made()
    handle = box.commands.run("sleep 60", background=True)
    box.kill()
    with pytest.raises(TimeoutException) as ended:  # before: Code.INTERNAL "interpreter restarted"
        handle.wait()
    assert "killed or reached its end of life" in str(ended.value)
    assert box.is_running() is False


def test_files_as_envd_has_them(made):
    box = made()
    info = box.files.write("zipped.txt", "packed on the way in", gzip=True)
    assert info.path == "/home/user/zipped.txt"
    assert box.files.read("zipped.txt") == "packed on the way in"  # before: the gzip bytes were stored
    assert box.files.read("zipped.txt", gzip=True) == "packed on the way in"
    box.files.write("plain.txt", "x" * 1000)
    assert box.files.read("plain.txt", gzip=True) == "x" * 1000  # sent gzipped, unpacked by the SDK
    box.files.make_dir("d")
    assert box.files.get_info("plain.txt").mode == 0o644
    assert box.files.get_info("d").mode == 0o755  # before: 16877, the type bits included
    box.commands.run("ln -s plain.txt link.txt", cwd="/home/user/d")
    link = box.files.get_info("d/link.txt")
    assert link.symlink_target == "/home/user/d/plain.txt"  # absolute, as envd reports it
    box.files.remove("never-there.txt")  # before: not found
    assert not box.files.exists("never-there.txt")


def test_file_metadata_is_kept_in_extended_attributes(made):
    box = made()
    info = box.files.write("tagged.txt", "content", metadata={"Author": "mish", "purpose": "upload"})
    assert info.metadata == {"author": "mish", "purpose": "upload"}  # keys lowercased, as envd does
    assert box.files.get_info("tagged.txt").metadata == {"author": "mish", "purpose": "upload"}
    octet = box.files.write("octet.txt", "x", metadata={"k": "v"}, use_octet_stream=True)
    assert octet.metadata == {"k": "v"} and box.files.get_info("octet.txt").metadata == {"k": "v"}
    many = box.files.write_files(
        [WriteEntry(path="d/one.txt", data="1"), WriteEntry(path="d/two.txt", data="2")], metadata={"batch": "b"}
    )
    assert [m.metadata for m in many] == [{"batch": "b"}, {"batch": "b"}]
    assert {e.name: e.metadata for e in box.files.list("d")} == {"one.txt": {"batch": "b"}, "two.txt": {"batch": "b"}}
    assert box.files.rename("tagged.txt", "renamed.txt").metadata == {"author": "mish", "purpose": "upload"}
    assert box.files.write("renamed.txt", "again").metadata is None  # a write without metadata clears it
    assert box.files.get_info("renamed.txt").metadata is None
    # set inside the sandbox, under the same namespace: shown as metadata
    box.files.write("plain.txt", "no metadata yet")
    box.commands.run("python3 -c \"import os; os.setxattr('plain.txt', 'user.e2b.by', b'code')\"", cwd="/home/user")
    assert box.files.get_info("plain.txt").metadata == {"by": "code"}
    assert box.files.get_info("octet.txt").metadata == {"k": "v"}
    assert box.files.write("bare.txt", "none").metadata is None and box.files.get_info("bare.txt").metadata is None


def test_bad_file_metadata_is_refused_before_anything_is_written(made, server):
    import httpx
    from e2b.exceptions import InvalidArgumentException

    box = made()
    with pytest.raises(InvalidArgumentException):  # the SDK checks what it sends
        box.files.write("bad.txt", "x", metadata={"bad key": "v"})
    # what the SDK would not send, sent anyway: the server checks it too
    headers = {"X-Access-Token": box._envd_access_token or "", "E2b-Sandbox-Id": box.sandbox_id}
    headers |= {"E2b-Sandbox-Port": "49983", "X-Metadata-ok": "v", "X-Metadata-big": "v" * 3000}
    r = httpx.post(f"{server}/files?path=/home/user/bad.txt", content=b"x", headers=headers)
    assert r.status_code == 400 and "2048 bytes" in r.text, r.text
    assert not box.files.exists("bad.txt")


def test_file_metadata_through_the_async_sdk(server):
    import asyncio

    from e2b import AsyncSandbox

    async def main():
        box = await AsyncSandbox.create(timeout=120)
        try:
            written = await box.files.write("a.txt", "async", metadata={"mode": "async"})
            return written.metadata, (await box.files.get_info("a.txt")).metadata
        finally:
            await box.kill()

    assert asyncio.run(main()) == ({"mode": "async"}, {"mode": "async"})


def test_a_default_token_survives_a_burst_of_file_calls(made):
    """A files.write loop with a token made by plain `sandloop tokens create NAME` (before: 120
    operations a minute, hit within seconds)."""
    box = made()
    for i in range(60):
        box.files.write(f"burst/{i}.txt", str(i))
    assert sorted(int(e.name.split(".")[0]) for e in box.files.list("burst")) == list(range(60))
    box.files.write_files([WriteEntry(path=f"batch/{i}.txt", data=str(i)) for i in range(20)])
    assert box.files.read("batch/19.txt") == "19"


def test_hostile_envd_calls_get_a_clear_answer(server, made):
    """Issue 27 #6, through the SDK and envd's wire: a FIFO read is refused at once (it blocked
    60 s, then 500), a silly ListDir depth is a 400 (500), over-deep JSON is a 400 (500)."""
    import httpx
    from e2b.exceptions import InvalidArgumentException

    box = made()
    box.commands.run("mkfifo pipe")
    started = time.monotonic()
    with pytest.raises(InvalidArgumentException, match="not a regular file"):
        box.files.read("pipe")
    assert time.monotonic() - started < 30  # not the old 60 s wait for a writer
    headers = {
        "E2b-Sandbox-Id": box.sandbox_id,
        "E2b-Sandbox-Port": "49983",
        "X-Access-Token": box._envd_access_token,
        "Content-Type": "application/json",
    }
    r = httpx.post(
        f"{server}/filesystem.Filesystem/ListDir", json={"path": "/home/user", "depth": "1e9"}, headers=headers
    )
    assert r.status_code == 400 and r.json()["code"] == "invalid_argument", r.text
    deep = b'{"path": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    r = httpx.post(f"{server}/filesystem.Filesystem/ListDir", content=deep, headers=headers)
    assert r.status_code == 400, r.text


def test_a_key_over_its_rate_gets_429_and_may_still_kill(tmp_path_factory, monkeypatch):
    import httpx

    tokens = TokenStore(tmp_path_factory.mktemp("e2b-rate") / "tokens.sqlite")
    key, _ = tokens.create("slow", runs_per_minute=6)
    with serve_in_thread(create_app(tokens)) as url:
        for name, value in (("E2B_API_URL", url), ("E2B_SANDBOX_URL", url), ("E2B_API_KEY", key)):
            monkeypatch.setenv(name, value)
        box = Sandbox.create(timeout=120)  # 1 operation
        try:
            statuses = []
            for i in range(8):  # files.write: one operation each; the rate runs out
                try:
                    box.files.write(f"f{i}.txt", "x")
                    statuses.append(200)
                except Exception as exc:  # noqa: BLE001 - the SDK's mapping of the answer
                    statuses.append(getattr(exc, "status_code", None) or type(exc).__name__)
            assert "RateLimitException" in [s if isinstance(s, str) else "" for s in statuses] or 429 in statuses
            headers = {"E2b-Sandbox-Id": box.sandbox_id, "E2b-Sandbox-Port": "49983",
                       "X-Access-Token": box._envd_access_token, "Content-Type": "application/json"}  # fmt: skip
            r = httpx.post(f"{url}/process.Process/List", json={}, headers=headers)
            assert r.status_code == 429 and r.json()["code"] == "resource_exhausted", r.text  # before: 500
        finally:
            box.kill()  # not metered: a key over its rate can still give back what it holds
        assert box.is_running() is False


def test_watching_a_directory_as_envd_does(made):
    """envd's CreateWatcher / GetWatcherEvents: each change is there by the next call; a new
    file is create, chmod, write (envd sets its owner; sandloop its mode); a rewrite is a write
    of the file itself; a recursive watch picks up a directory made after it started."""
    from e2b import FileNotFoundException, FilesystemEventType, FileType, SandboxException

    box = made()
    box.files.make_dir("w/nested")
    handle = box.files.watch_dir("w", include_entry=True)
    box.files.write("w/f.txt", "one")
    events = handle.get_new_events()
    assert [(e.name, e.type) for e in events] == [
        ("f.txt", FilesystemEventType.CREATE),
        ("f.txt", FilesystemEventType.CHMOD),
        ("f.txt", FilesystemEventType.WRITE),
    ]
    box.files.write("w/f.txt", "two")
    (write,) = handle.get_new_events()
    assert write.type == FilesystemEventType.WRITE and write.entry is not None
    assert write.entry.path == "/home/user/w/f.txt" and write.entry.type == FileType.FILE and write.entry.size == 3
    handle.stop()
    with pytest.raises(SandboxException, match="stopped"):
        handle.get_new_events()

    deep = box.files.watch_dir("w", recursive=True)
    box.files.make_dir("w/later")
    box.files.write("w/later/g.txt", "x")
    box.commands.run("echo hi > /home/user/w/nested/h.txt")
    kinds = [(e.name, e.type) for e in deep.get_new_events()]
    assert ("later", FilesystemEventType.CREATE) in kinds
    assert ("later/g.txt", FilesystemEventType.WRITE) in kinds
    assert ("nested/h.txt", FilesystemEventType.WRITE) in kinds
    deep.stop()

    with pytest.raises(FileNotFoundException):
        box.files.watch_dir("missing")
    with pytest.raises(SandboxException):
        box.files.watch_dir("w/f.txt")


def test_a_watcher_is_its_sandboxs_alone_and_ends_with_it(made, server):
    import httpx

    from sandloop.sessions.watch import live_watchers

    a, b = made(), made()
    handle = a.files.watch_dir(".")
    assert live_watchers(a.sandbox_id) == 1
    headers = {  # b's own token, a's watcher id
        "E2b-Sandbox-Id": b.sandbox_id,
        "E2b-Sandbox-Port": "49983",
        "X-Access-Token": b._envd_access_token,
        "Content-Type": "application/json",
    }
    r = httpx.post(
        f"{server}/filesystem.Filesystem/GetWatcherEvents", json={"watcherId": handle._watcher_id}, headers=headers
    )
    assert r.status_code == 404 and r.json()["code"] == "not_found", r.text
    a.kill()
    assert live_watchers(a.sandbox_id) == 0


def test_watching_through_the_async_sdks_stream(server):
    import asyncio

    from e2b import AsyncSandbox, FilesystemEventType

    async def main():
        box = await AsyncSandbox.create(timeout=120)
        try:
            got: list[tuple[str, object]] = []
            seen = asyncio.Event()

            def on_event(e):
                got.append((e.name, e.type))
                if e.type == FilesystemEventType.WRITE:
                    seen.set()

            handle = await box.files.watch_dir(".", on_event=on_event)
            await box.files.write("a.txt", "async")
            await asyncio.wait_for(seen.wait(), 60)
            await handle.stop()
            return got
        finally:
            await box.kill()

    assert asyncio.run(main())[:3] == [
        ("a.txt", FilesystemEventType.CREATE),
        ("a.txt", FilesystemEventType.CHMOD),
        ("a.txt", FilesystemEventType.WRITE),
    ]


def test_signed_file_urls_as_envd_signs_them(made):
    """download_url / upload_url: the URL names no sandbox (the SDK's sandbox URL is one for
    all), its signature does; a changed path, another sandbox's or a killed sandbox's signature,
    and one past its expiration are refused with envd's error shape."""
    import httpx

    a, b = made(), made()
    a.files.write("report.txt", "from a")
    b.files.write("report.txt", "from b")
    url = a.download_url("report.txt", "user")
    assert "E2b-Sandbox-Id" not in url and "signature=v1_" in url
    r = httpx.get(url)
    assert r.status_code == 200 and r.text == "from a"
    assert httpx.get(b.download_url("report.txt", "user", 60)).text == "from b"

    up = a.upload_url("uploaded.txt", "user", 60)
    r = httpx.post(up, files={"file": ("uploaded.txt", b"by url")})
    assert r.status_code == 200, r.text
    assert a.files.read("uploaded.txt") == "by url" and not b.files.exists("uploaded.txt")

    r = httpx.get(a.download_url("report.txt", "user", use_signature_expiration=-120))
    assert r.status_code == 401 and r.json() == {"code": 401, "message": "signature is already expired"}
    r = httpx.get(url.replace("report.txt", "other.txt"))  # the path is signed
    assert r.status_code == 401 and r.json()["message"] == "invalid signature"
    r = httpx.post(url, files={"file": ("x", b"x")})  # a read signature does not write
    assert r.status_code == 401
    a.kill()
    assert httpx.get(url).status_code == 401  # its token signs nothing any more


def test_python_and_sudo_are_commands_and_sudo_gives_no_root(made):
    """E2B's images have `python` and `sudo`; here sudo cannot give root (uid 65534, no new
    privileges): it says so and runs the command as the sandbox's user."""
    box = made()
    assert box.commands.run("python -c 'print(6 * 7)'").stdout.strip() == "42"
    for cmd in ("sudo id -u", "sudo -u root -E id -u", "sudo -- id -u"):
        r = box.commands.run(cmd)
        assert r.stdout.strip() == "65534" and "no root" in r.stderr, (cmd, r)
    assert box.commands.run("echo $FOO", envs={"FOO": "bar"}).stdout.strip() == "bar"
    assert box.commands.run('sudo echo "$FOO"').stdout.strip() == ""  # scoped to its command
    from e2b import CommandExitException

    with pytest.raises(CommandExitException):
        box.commands.run("sudo touch /etc/owned")  # read-only root, unprivileged: it fails


def test_an_mcp_gateway_is_refused_before_any_sandbox_exists(server):
    from e2b import SandboxException

    tag = str(uuid.uuid4())
    with pytest.raises(SandboxException, match="Failed to start MCP gateway"):
        Sandbox.create(timeout=60, metadata={"t": tag}, mcp={"invalid_server": {}})
    assert Sandbox.list(query=SandboxQuery(metadata={"t": tag})).next_items() == []
