"""envd, the daemon E2B's SDKs talk to inside a sandbox: processes and the filesystem over Connect
RPC (JSON), file contents over plain HTTP (``/files``), ``/health``.

Processes are the session interpreter's children (procs_helper.py): they see the workspace at
/home/user, run as the sandbox's user, and stream their output while they run; a stream that
ends (the client went away, or only wanted a background process) leaves the process running.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from sandloop.contract import PathRefused, SandboxError, TooLarge, WorkspaceFileNotFound
from sandloop.runtime.reach.mux import ReachError, Terminal
from sandloop.server.e2b.connect import ConnectError, read_request, stream, unary_error
from sandloop.server.e2b.control import e2b_error_response
from sandloop.server.e2b.envd_pty import Ptys
from sandloop.server.e2b.envd_shapes import (
    SIGNALS,
    entry_json,
    event_json,
    field,
    gunzip,
    metadata_of,
    signal_name,
    to_connect,
    user_of,
)
from sandloop.server.e2b.service import E2B, E2BError, command_cwd, sandbox_path, workspace_path
from sandloop.server.models import MAX_FILE_BYTES
from sandloop.sessions.watch import Watcher

#: Seconds between keepalive events on a quiet process stream (E2B's SDK asks for 50).
KEEPALIVE = 30.0
#: Longest a SIGKILL of a terminal waits for it to be gone.
KILL_WAIT = 10.0


def envd_routes(e2b: E2B, sandbox_of: Callable[[Request], Awaitable[Any]]) -> APIRouter:
    router = APIRouter(include_in_schema=False)
    ptys = e2b.ptys = Ptys(e2b)

    async def unary(request: Request, work: Callable[[Any, dict[str, Any]], dict[str, Any]], cost: int = 1) -> Response:
        try:
            user_of(request)
            box, token = await sandbox_of(request)
            message = await read_request(request)

            def run() -> dict[str, Any]:
                if not cost:
                    return work(box, message)
                with e2b.api.rates.use(token):
                    return work(box, message)

            return JSONResponse(await run_in_threadpool(run))
        except Exception as exc:  # noqa: BLE001 - every failure is a Connect error to the client
            return unary_error(to_connect(exc))

    def selector(message: dict[str, Any]) -> dict[str, Any]:
        sel = message.get("process") or {}
        if "pid" in sel:
            return {"pid": int(sel["pid"])}
        if "tag" in sel:
            return {"tag": str(sel["tag"])}
        raise ConnectError("invalid_argument", "name the process by pid or tag")

    def checked(reply: dict[str, Any]) -> dict[str, Any]:
        if "error" in reply:
            code = {"not_found": "not_found", "invalid": "failed_precondition"}.get(reply.get("kind", ""), "internal")
            if reply.get("kind") == "invalid_argument":
                code = "invalid_argument"
            raise ConnectError(code, reply["error"])
        return reply

    async def events(sandbox_id: str, pid: int, started: bool) -> AsyncIterator[dict[str, Any]]:
        if started:
            yield {"event": {"start": {"pid": pid}}}
        loop = asyncio.get_running_loop()
        replies: asyncio.Queue[dict[str, Any]] = asyncio.Queue()

        def deliver(reply: dict[str, Any]) -> None:
            loop.call_soon_threadsafe(replies.put_nowait, reply)

        unfollow = e2b.follow(sandbox_id, pid, deliver)
        try:
            while True:
                try:
                    reply = checked(await asyncio.wait_for(replies.get(), KEEPALIVE))
                except TimeoutError:
                    yield {"event": {"keepalive": {}}}
                    continue
                for name in ("stdout", "stderr"):
                    if reply.get(name):
                        yield {"event": {"data": {name: reply[name]}}}
                if "exit_code" in reply:
                    code = int(reply["exit_code"])
                    status = f"exit status {code}" if code >= 0 else f"signal: {signal_name(-code)}"
                    end = {"exitCode": code if code >= 0 else -1, "exited": code >= 0, "status": status}
                    yield {"event": {"end": end}}
                    return
        finally:
            unfollow()  # the client went away (or the process ended): it keeps running, unfollowed

    def loop_time() -> float:
        return asyncio.get_running_loop().time()

    def _deadline(request: Request) -> float | None:
        raw = request.headers.get("connect-timeout-ms", "")
        if not raw.isdigit() or int(raw) <= 0:
            return None
        return loop_time() + int(raw) / 1000

    pending_kills: set[asyncio.Task[Any]] = set()

    def kill_at(deadline: float, sandbox_id: str, pid: int, term: Terminal | None = None) -> None:
        """SIGKILL the process (or terminal) at ``deadline`` (loop time), as envd's process context does."""

        async def kill() -> None:
            await asyncio.sleep(max(0.0, deadline - loop_time()))
            op = {"op": "signal", "pid": pid, "signal": SIGNALS["SIGNAL_SIGKILL"]}
            with contextlib.suppress(Exception):  # ended already, or the sandbox is gone
                if term is not None:
                    await run_in_threadpool(term.signal, SIGNALS["SIGNAL_SIGKILL"])
                else:
                    await run_in_threadpool(e2b.procs, sandbox_id, op)

        task = asyncio.get_running_loop().create_task(kill())
        pending_kills.add(task)  # a reference, or the loop may drop the task
        task.add_done_callback(pending_kills.discard)

    def _stream_error(sandbox_id: str, exc: Exception) -> ConnectError:
        """Why a process stream ended early. The sandbox killed (or timed out) under it is what
        envd's proxy says: unavailable, which the SDK turns into "the sandbox was killed or
        reached its end of life" once its health check finds it gone (before: internal, "the
        sandbox's interpreter was restarted (out of memory?)")."""
        try:
            e2b.live(e2b.registry.get(sandbox_id), sandbox_id)
        except E2BError:
            return ConnectError(
                "unavailable", f"the connection to sandbox {sandbox_id} ended before the stream completed"
            )
        return exc if isinstance(exc, ConnectError) else to_connect(exc)

    async def start_stream(request: Request, connect: bool) -> Response:
        try:
            user_of(request)
            box, token = await sandbox_of(request)
            message = await read_request(request)
            e2b.check_stream_room(box.sandbox_id)  # before a process starts that no stream could follow
            term = None
            if connect:
                sel = selector(message)
                term = ptys.get(box.sandbox_id, sel["pid"]) if "pid" in sel else None
            if term is not None:  # a terminal followed again (envd_pty.py)
                pid, first = term.pid, None
            elif connect:
                peek = {"op": "poll", **sel, "wait": 0, "forget": False}
                reply = checked(await run_in_threadpool(e2b.procs, box.sandbox_id, peek))
                pid = int(reply["pid"])
                first = reply
            else:
                proc = message.get("process") or {}
                cmd = proc.get("cmd")
                if not isinstance(cmd, str) or not cmd:
                    raise ConnectError("invalid_argument", "process.cmd is required")
                args = proc.get("args") or []
                envs = proc.get("envs") or {}
                if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
                    raise ConnectError("invalid_argument", "process.args must be a list of strings")
                if not isinstance(envs, dict) or not all(isinstance(v, str) for v in envs.values()):
                    raise ConnectError("invalid_argument", "process.envs must be an object of strings")
                config = {
                    "cmd": cmd,
                    "args": args,
                    "envs": {"HOME": "/home/user", "USER": "user", **box.envs, **envs},
                    "cwd": command_cwd(proc.get("cwd")),
                }

                op = {"op": "start", "config": config, "stdin": bool(message.get("stdin")), "tag": message.get("tag")}
                pty = message.get("pty")
                if pty is not None and not isinstance(pty, dict):
                    raise ConnectError("invalid_argument", "pty must be an object with a size")

                def start() -> dict[str, Any]:
                    with e2b.api.rates.use(token):
                        if pty is not None:
                            return {"term": ptys.start(box.sandbox_id, config, pty)}
                        return checked(e2b.procs(box.sandbox_id, op))

                started = await run_in_threadpool(start)
                term = started.get("term")
                pid = term.pid if term is not None else int(started["pid"])
                first = None
        except Exception as exc:  # noqa: BLE001 - before the stream starts: a unary-style error
            return unary_error(to_connect(exc))

        # Connect's request deadline, as envd keeps it for a started process: past it the process
        # is killed whether anyone still follows it or not (the SDK gives up on its own at the same
        # time), and a stream still open ends with deadline_exceeded (the SDK's TimeoutException);
        # a reconnect's deadline only ends its stream.
        deadline = _deadline(request)
        if deadline is not None and not connect:
            kill_at(deadline, box.sandbox_id, pid, term)

        async def messages() -> AsyncIterator[dict[str, Any]]:
            try:
                with e2b.stream_slot(box.sandbox_id):
                    follow = replay_and_follow()
                    while True:
                        left = None if deadline is None else deadline - loop_time()
                        if left is not None and left <= 0:
                            raise TimeoutError
                        try:
                            event = await asyncio.wait_for(follow.__anext__(), left)
                        except StopAsyncIteration:
                            return
                        yield event
            except TimeoutError:
                with contextlib.suppress(Exception):
                    await follow.aclose()
                raise ConnectError(
                    "deadline_exceeded", f"the command ran past its timeout and was killed (pid {pid})"
                ) from None
            except Exception as exc:  # noqa: BLE001 - ends the stream with a Connect error
                raise _stream_error(box.sandbox_id, exc) from None

        async def replay_and_follow() -> AsyncGenerator[dict[str, Any], None]:
            if term is not None:
                async for event in ptys.events(box.sandbox_id, term, started=True):
                    yield event
                return
            if first is not None:  # a reconnect: what the first poll already took
                yield {"event": {"start": {"pid": pid}}}
                for name in ("stdout", "stderr"):
                    if first.get(name):
                        yield {"event": {"data": {name: first[name]}}}
            async for event in events(box.sandbox_id, pid, started=first is None):
                yield event

        return stream(messages())

    @router.post("/process.Process/Start")
    async def process_start(request: Request) -> Response:
        return await start_stream(request, connect=False)

    @router.post("/process.Process/Connect")
    async def process_connect(request: Request) -> Response:
        return await start_stream(request, connect=True)

    @router.post("/process.Process/List")
    async def process_list(request: Request) -> Response:
        def work(box: Any, message: dict[str, Any]) -> dict[str, Any]:
            reply = checked(e2b.procs(box.sandbox_id, {"op": "list"}))
            listed = [*reply["processes"], *ptys.listed(box.sandbox_id)]
            return {
                "processes": [
                    {"config": p["config"], "pid": p["pid"], **({"tag": p["tag"]} if p.get("tag") else {})}
                    for p in sorted(listed, key=lambda p: p["pid"])
                ]
            }

        return await unary(request, work)

    @router.post("/process.Process/SendSignal")
    async def process_signal(request: Request) -> Response:
        def work(box: Any, message: dict[str, Any]) -> dict[str, Any]:
            sig = SIGNALS.get(message.get("signal", "SIGNAL_SIGKILL"))
            if sig is None:
                raise ConnectError("invalid_argument", "signal must be SIGNAL_SIGKILL or SIGNAL_SIGTERM")
            sel = selector(message)
            term = ptys.get(box.sandbox_id, sel["pid"]) if "pid" in sel else None
            if term is not None and term.exit_code is None:
                term.signal(sig)
                if sig == SIGNALS["SIGNAL_SIGKILL"]:  # gone (and reaped) when the call returns, as envd's
                    with contextlib.suppress(TimeoutError, ReachError):
                        term.wait(KILL_WAIT)
                return {}
            checked(e2b.procs(box.sandbox_id, {"op": "signal", **sel, "signal": sig}))
            return {}

        return await unary(request, work)

    @router.post("/process.Process/SendInput")
    async def process_input(request: Request) -> Response:
        def work(box: Any, message: dict[str, Any]) -> dict[str, Any]:
            given = message.get("input") or {}
            if isinstance(given.get("pty"), str):
                ptys.send(box.sandbox_id, int(selector(message).get("pid", 0)), given["pty"])
                return {}
            data = given.get("stdin")
            if not isinstance(data, str):
                raise ConnectError("invalid_argument", "input.stdin or input.pty (base64 bytes) is required")
            checked(e2b.procs(box.sandbox_id, {"op": "input", **selector(message), "data": data}))
            return {}

        return await unary(request, work)

    @router.post("/process.Process/CloseStdin")
    async def process_close_stdin(request: Request) -> Response:
        def work(box: Any, message: dict[str, Any]) -> dict[str, Any]:
            checked(e2b.procs(box.sandbox_id, {"op": "input", **selector(message), "close": True}))
            return {}

        return await unary(request, work)

    @router.post("/process.Process/Update")
    async def process_update(request: Request) -> Response:
        def work(box: Any, message: dict[str, Any]) -> dict[str, Any]:
            size = (message.get("pty") or {}).get("size")
            if not isinstance(size, dict):
                raise ConnectError("invalid_argument", "pty.size is what a process can be updated with")
            ptys.resize(box.sandbox_id, int(selector(message).get("pid", 0)), size)
            return {}

        return await unary(request, work, cost=0)

    @router.post("/process.Process/{method}")
    async def process_other(method: str) -> Response:
        return unary_error(ConnectError("unimplemented", f"process.{method} is not supported by sandloop"))

    # -- filesystem -------------------------------------------------------------------------------
    def path_of(message: dict[str, Any], key: str = "path") -> str:
        try:
            return workspace_path(message.get(key, ""))
        except E2BError as exc:
            raise ConnectError("invalid_argument", exc.message) from None

    @router.post("/filesystem.Filesystem/Stat")
    async def fs_stat(request: Request) -> Response:
        def work(box: Any, message: dict[str, Any]) -> dict[str, Any]:
            rel = path_of(message)
            entry = e2b.session(box.sandbox_id).stat(rel)
            entry["path"] = rel
            return {"entry": entry_json(entry)}

        return await unary(request, work)

    @router.post("/filesystem.Filesystem/ListDir")
    async def fs_list(request: Request) -> Response:
        def work(box: Any, message: dict[str, Any]) -> dict[str, Any]:
            rel = path_of(message)
            depth = message.get("depth") or 1
            if isinstance(depth, str) and depth.isdigit():  # protobuf's JSON may send a number as text
                depth = int(depth)
            if not isinstance(depth, int) or isinstance(depth, bool) or depth < 1:
                raise ConnectError("invalid_argument", f"depth must be a whole number from 1, got {depth!r}")
            s = e2b.session(box.sandbox_id)
            if s.stat(rel)["type"] != "dir":
                raise ConnectError("invalid_argument", f"{message.get('path')} is not a directory")
            return {"entries": [entry_json(e) for e in s.list_tree(rel, min(depth, 64))]}

        return await unary(request, work)

    @router.post("/filesystem.Filesystem/MakeDir")
    async def fs_mkdir(request: Request) -> Response:
        def work(box: Any, message: dict[str, Any]) -> dict[str, Any]:
            rel = path_of(message)
            s = e2b.session(box.sandbox_id)
            if not s.make_dir(rel):
                raise ConnectError("already_exists", f"{message.get('path')} already exists")
            entry = s.stat(rel)
            entry["path"] = rel
            return {"entry": entry_json(entry)}

        return await unary(request, work)

    @router.post("/filesystem.Filesystem/Move")
    async def fs_move(request: Request) -> Response:
        def work(box: Any, message: dict[str, Any]) -> dict[str, Any]:
            src, dst = path_of(message, "source"), path_of(message, "destination")
            entry = e2b.session(box.sandbox_id).move(src, dst)
            entry["path"] = dst
            return {"entry": entry_json(entry)}

        return await unary(request, work)

    @router.post("/filesystem.Filesystem/Remove")
    async def fs_remove(request: Request) -> Response:
        def work(box: Any, message: dict[str, Any]) -> dict[str, Any]:
            with contextlib.suppress(WorkspaceFileNotFound):  # as envd: removing what is not there succeeds
                e2b.session(box.sandbox_id).delete_file(path_of(message))
            return {}

        return await unary(request, work)

    # -- watching (sessions/watch.py: inotify on the host's view of the workspace) ----------------
    def watch_of(box: Any, message: dict[str, Any]) -> Watcher:
        """A watcher as envd's WatchDir and CreateWatcher make one; E2B's errors: a missing path
        is not_found, a file invalid_argument."""
        shown = message.get("path", "")
        rel = path_of(message)
        try:
            return e2b.session(box.sandbox_id).watch(
                rel,
                recursive=bool(field(message, "recursive")),
                include_entry=bool(field(message, "include_entry")),
            )
        except WorkspaceFileNotFound:
            raise ConnectError("not_found", f"path {shown} not found") from None
        except PathRefused:
            raise ConnectError("invalid_argument", f"path {shown} not a directory") from None
        # allow_network_mounts: a workspace is never a network mount; the flag changes nothing

    @router.post("/filesystem.Filesystem/CreateWatcher")
    async def fs_create_watcher(request: Request) -> Response:
        def work(box: Any, message: dict[str, Any]) -> dict[str, Any]:
            return {"watcherId": e2b.add_watcher(box.sandbox_id, watch_of(box, message))}

        return await unary(request, work)

    @router.post("/filesystem.Filesystem/GetWatcherEvents")
    async def fs_watcher_events(request: Request) -> Response:
        def work(box: Any, message: dict[str, Any]) -> dict[str, Any]:
            watcher = e2b.watcher(box.sandbox_id, str(field(message, "watcher_id") or ""))
            try:
                events = watcher.events()
            except SandboxError as exc:
                raise ConnectError("internal", str(exc)) from None
            return {"events": [event_json(watcher, e) for e in events]}

        return await unary(request, work, cost=0)  # in this process, no sandbox run: not an operation

    @router.post("/filesystem.Filesystem/RemoveWatcher")
    async def fs_remove_watcher(request: Request) -> Response:
        def work(box: Any, message: dict[str, Any]) -> dict[str, Any]:
            e2b.watcher(box.sandbox_id, str(field(message, "watcher_id") or ""), remove=True).close()
            return {}

        return await unary(request, work, cost=0)

    @router.post("/filesystem.Filesystem/WatchDir")
    async def fs_watch_dir(request: Request) -> Response:
        try:
            user_of(request)
            box, token = await sandbox_of(request)
            message = await read_request(request)
            e2b.check_stream_room(box.sandbox_id)

            def start() -> Watcher:
                with e2b.api.rates.use(token):
                    return watch_of(box, message)

            watcher = await run_in_threadpool(start)
        except Exception as exc:  # noqa: BLE001 - before the stream starts: a unary-style error
            return unary_error(to_connect(exc))
        loop = asyncio.get_running_loop()
        woken = asyncio.Event()

        def wake() -> None:
            loop.call_soon_threadsafe(woken.set)

        watcher.notify = wake
        deadline = _deadline(request)

        async def messages() -> AsyncIterator[dict[str, Any]]:
            try:
                with e2b.stream_slot(box.sandbox_id):
                    yield {"start": {}}  # WatchDirResponse's oneof is its own field, not under "event"
                    while True:
                        woken.clear()
                        try:
                            events = await run_in_threadpool(watcher.events)
                        except SandboxError as exc:
                            raise _stream_error(box.sandbox_id, ConnectError("internal", str(exc))) from None
                        for event in events:
                            yield {"filesystem": event_json(watcher, event)}
                        left = KEEPALIVE if deadline is None else min(KEEPALIVE, deadline - loop_time())
                        if left <= 0:
                            raise ConnectError("deadline_exceeded", "the watch reached its timeout")
                        try:
                            await asyncio.wait_for(woken.wait(), left)
                        except TimeoutError:
                            yield {"keepalive": {}}
            finally:
                watcher.close()  # the client went away, or the stream ended

        return stream(messages())

    @router.post("/filesystem.Filesystem/{method}")
    async def fs_other(method: str) -> Response:
        return unary_error(ConnectError("unimplemented", f"filesystem.{method} is not supported by sandloop"))

    # -- file contents ----------------------------------------------------------------------------
    @router.get("/files")
    async def read_file(request: Request, path: str = "") -> Response:
        try:
            box, token = await sandbox_of(request)
            rel = workspace_path(path)

            def work() -> bytes:
                with e2b.api.rates.use(token):
                    return e2b.session(box.sandbox_id).read_file(rel)

            data = await run_in_threadpool(work)
        except (WorkspaceFileNotFound, PathRefused, TooLarge, E2BError, SandboxError) as exc:
            if isinstance(exc, PathRefused) and "is a directory" in str(exc):
                exc = E2BError(400, f"{path} is a directory")
            return e2b_error_response(exc)
        if "gzip" in request.headers.get("accept-encoding", "").lower() and len(data) > 64:
            packed = gzip.compress(data, compresslevel=5)
            return Response(packed, media_type="application/octet-stream", headers={"Content-Encoding": "gzip"})
        return Response(data, media_type="application/octet-stream")

    @router.post("/files")
    async def write_files(request: Request, path: str = "") -> Response:
        try:
            box, token = await sandbox_of(request)
            ctype = request.headers.get("content-type", "")
            uploads: list[tuple[str, bytes]] = []
            if ctype.startswith("multipart/form-data"):
                form = await request.form(max_files=1000, max_fields=1000)
                for _, value in form.multi_items():
                    if isinstance(value, str):
                        continue
                    target = path if path and len(form) == 1 else (value.filename or "")
                    uploads.append((target, await value.read()))
            else:
                if not path:
                    raise E2BError(400, "name the file: ?path=/home/user/...")
                body = await request.body()
                encoding = request.headers.get("content-encoding", "").strip().lower()
                if encoding == "gzip":  # the SDK's write(..., gzip=True): stored as what it unpacks to
                    body = gunzip(body, MAX_FILE_BYTES)
                elif encoding not in ("", "identity"):
                    raise E2BError(400, f"Content-Encoding {encoding!r} is not supported (gzip or none)")
                uploads.append((path, body))
            if not uploads:
                raise E2BError(400, "no file in the request")
            targets = [(workspace_path(p), data) for p, data in uploads]
            metadata = metadata_of(request)

            def work() -> list[dict[str, Any]]:
                # each file is a sandbox run, so each counts, all before the first is written (one
                # multipart request of 1000 files once counted as one operation: a 3-a-minute key
                # started 29 containers in a minute)
                with e2b.api.rates.use(token, operations=len(targets)):
                    s = e2b.session(box.sandbox_id)
                    out = []
                    for rel, data in targets:
                        s.write_file(rel, data, metadata=metadata)
                        written = {"name": rel.rsplit("/", 1)[-1], "type": "file", "path": sandbox_path(rel)}
                        out.append({**written, "metadata": metadata} if metadata else written)
                    return out

            return JSONResponse(await run_in_threadpool(work))
        except Exception as exc:  # noqa: BLE001 - E2B's error shape
            return e2b_error_response(exc)

    return router


__all__ = ["envd_routes"]
