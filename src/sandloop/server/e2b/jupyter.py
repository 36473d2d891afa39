"""The code interpreter's endpoint (E2B's port 49999): ``POST /execute`` runs a cell in the
session's interpreter and streams newline-delimited JSON as it runs: ``stdout``/``stderr`` (each
with a timestamp), ``result`` (charts as PNG, then the last expression as text), ``error`` (name,
value, traceback), ``end_of_execution``. One Python context per sandbox (the session's
interpreter): ``/contexts`` answers with it; other languages are refused.
"""

from __future__ import annotations

import asyncio
import base64
import datetime
import json
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from sandloop.server.e2b.control import e2b_error_response
from sandloop.server.e2b.service import CODE_OUTPUT, E2B, HOME, E2BError

CONTEXT_ID = "default"


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat().replace("+00:00", "Z")


def jupyter_routes(e2b: E2B, sandbox_of: Callable[[Request], Awaitable[Any]]) -> APIRouter:
    router = APIRouter(include_in_schema=False)

    def context_json() -> dict[str, Any]:
        return {"id": CONTEXT_ID, "language": "python", "cwd": HOME}

    @router.post("/execute")
    async def execute(request: Request) -> Response:
        try:
            box, token = await sandbox_of(request)
            try:
                body = await request.json()
            except (ValueError, RecursionError):
                raise E2BError(400, 'the body must be JSON: {"code": ...}') from None
            code = body.get("code") if isinstance(body, dict) else None
            if not isinstance(code, str):
                raise E2BError(400, "code (a string) is required")
            language = body.get("language")
            if language not in (None, "python", "python3"):
                raise E2BError(400, f"language {language!r} is not supported: the code interpreter runs Python")
            if body.get("context_id") not in (None, CONTEXT_ID):
                raise E2BError(404, f"no context {body.get('context_id')!r}; the sandbox has one, {CONTEXT_ID!r}")
            envs = body.get("env_vars") or {}
            if not isinstance(envs, dict) or not all(isinstance(v, str) for v in envs.values()):
                raise E2BError(400, "env_vars must be an object of strings")
        except Exception as exc:  # noqa: BLE001 - E2B's error shape
            return e2b_error_response(exc)
        envs = {**box.envs, **envs}
        timeout = e2b.api.clamp_timeout(token, min(300.0, token.max_timeout))
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        cancel = threading.Event()

        partial = {"stdout": b"", "stderr": b""}

        def emit(kind: str, data: bytes) -> None:
            """Whole lines, as Jupyter's stream messages usually are (print writes a line in two)."""
            data = partial[kind] + data
            cut = data.rfind(b"\n") + 1
            partial[kind] = data[cut:]
            if cut:
                text = data[:cut].decode("utf-8", "replace")
                loop.call_soon_threadsafe(queue.put_nowait, {"type": kind, "text": text, "timestamp": _now()})

        def flush() -> None:
            for kind, rest in partial.items():
                if rest:
                    partial[kind] = b""
                    text = rest.decode("utf-8", "replace")
                    loop.call_soon_threadsafe(queue.put_nowait, {"type": kind, "text": text, "timestamp": _now()})

        def work() -> None:
            try:
                with e2b.api.rates.use(token):
                    session = e2b.session(box.sandbox_id)
                    if envs:  # set for this execution and restored after it, as E2B's envs are
                        session.run_cell(_SET_ENVS % json.dumps(json.dumps(envs)), 10, detach=True)
                    try:
                        result = session.run_cell(
                            code, timeout, on_output=emit, cancel=cancel, output_limit=CODE_OUTPUT, detach=True
                        )
                    finally:
                        flush()
                        if envs:
                            session.run_cell(_RESTORE_ENVS, 10, detach=True)
                outcome = "timeout" if result.timed_out else "ok" if result.ok else "error"
                e2b.api.metrics.run(outcome, result.duration_seconds)
                for a in result.artifacts:
                    if a.mime_type == "image/png":
                        png = base64.b64encode(a.data).decode()
                        chart = {"type": "result", "png": png, "text": "<Figure>", "is_main_result": False}
                        loop.call_soon_threadsafe(queue.put_nowait, chart)
                if result.error is not None:
                    err = result.error
                    loop.call_soon_threadsafe(
                        queue.put_nowait,
                        {"type": "error", "name": err.name, "value": err.value, "traceback": err.traceback},
                    )
                elif result.interpreter_restarted:
                    loop.call_soon_threadsafe(
                        queue.put_nowait,
                        {
                            "type": "error",
                            "name": "InterpreterRestarted",
                            "value": (
                                f"the interpreter reached the {result.limits.memory} memory limit"
                                if result.oom_killed
                                else "the interpreter was killed (or ignored its interrupt)"
                            )
                            + " and was restarted; its state is gone",
                            "traceback": "",
                        },
                    )
                elif result.value is not None:
                    loop.call_soon_threadsafe(
                        queue.put_nowait, {"type": "result", "text": _plain(result.value), "is_main_result": True}
                    )
                loop.call_soon_threadsafe(queue.put_nowait, {"type": "end_of_execution"})
            except Exception as exc:  # noqa: BLE001 - reported in the stream
                loop.call_soon_threadsafe(
                    queue.put_nowait, {"type": "error", "name": type(exc).__name__, "value": str(exc), "traceback": ""}
                )
            finally:
                loop.call_soon_threadsafe(queue.put_nowait, None)

        async def lines() -> AsyncIterator[bytes]:
            worker = asyncio.ensure_future(run_in_threadpool(work))
            try:
                while (item := await queue.get()) is not None:
                    yield json.dumps(item).encode() + b"\n"
            finally:
                cancel.set()  # the client went away (its timeout): interrupt the cell, keep the state
                await worker

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    @router.post("/contexts")
    async def create_context(request: Request) -> Response:
        try:
            await sandbox_of(request)
            body = await request.json() if await request.body() else {}
            language = body.get("language") if isinstance(body, dict) else None
            if language not in (None, "python", "python3"):
                raise E2BError(400, f"language {language!r} is not supported: the code interpreter runs Python")
        except Exception as exc:  # noqa: BLE001 - E2B's error shape
            return e2b_error_response(exc)
        return JSONResponse(context_json())

    @router.get("/contexts")
    async def list_contexts(request: Request) -> Response:
        try:
            await sandbox_of(request)
        except Exception as exc:  # noqa: BLE001 - E2B's error shape
            return e2b_error_response(exc)
        return JSONResponse([context_json()])

    return router


#: Cells that set and restore the environment around an execution (they leave no globals).
_SET_ENVS = (
    "(lambda os, sys, types, json: (setattr(sys.modules.setdefault('_sandloop_envs', types.ModuleType('e')), "
    "'saved', dict(os.environ)), os.environ.update(json.loads(%s))) and None)"
    "(__import__('os'), __import__('sys'), __import__('types'), __import__('json'))"
)
_RESTORE_ENVS = (
    "(lambda os, sys: (os.environ.clear(), os.environ.update(sys.modules['_sandloop_envs'].saved)) and None)"
    "(__import__('os'), __import__('sys'))"
)


def _plain(text: str) -> str:
    """``text/plain`` as E2B's code-interpreter server sends it: a string's repr without its
    quotes (``'bar'`` is ``bar``), as its ``Result`` does (template/server/api/models/result.py)."""
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    return text
