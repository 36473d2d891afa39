"""The code interpreter's endpoint (E2B's port 49999): ``POST /execute`` runs a cell in one of
the session's contexts and streams newline-delimited JSON as it runs: ``stdout``/``stderr``
(each with a timestamp), ``result`` (each output the cell displayed, as E2B's ``Result``: text,
html, png, ..., a DataFrame's ``data``, a figure's ``chart``), ``number_of_executions``,
``error`` (name, value, traceback), ``end_of_execution``. ``/contexts`` creates, lists,
restarts and removes the session's contexts (python, javascript, typescript, bash).
"""

from __future__ import annotations

import asyncio
import datetime
import json
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from sandloop.contract import CodeContext, Output
from sandloop.server.e2b.control import e2b_error_response
from sandloop.server.e2b.service import CODE_OUTPUT, E2B, HOME, E2BError
from sandloop.sessions import Session
from sandloop.sessions.session import CONTEXT_LANGUAGES
from sandloop.sessions.store import WORKSPACE


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat().replace("+00:00", "Z")


def jupyter_routes(e2b: E2B, sandbox_of: Callable[[Request], Awaitable[Any]]) -> APIRouter:
    router = APIRouter(include_in_schema=False)

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
            language, context_id = body.get("language"), body.get("context_id")
            if language and context_id:
                raise E2BError(400, "Only one of context_id or language can be provided")
            if language is not None and (not isinstance(language, str) or _language(language) is None):
                raise E2BError(400, f"language {language!r} is not supported: {LANGUAGES_SAID}")
            if context_id is not None and not isinstance(context_id, str):
                raise E2BError(400, "context_id must be a string")
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

        def put(item: dict[str, Any] | None) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, item)

        def emit(kind: str, data: bytes) -> None:
            """Whole lines, as Jupyter's stream messages usually are (print writes a line in two)."""
            data = partial[kind] + data
            cut = data.rfind(b"\n") + 1
            partial[kind] = data[cut:]
            if cut:
                put({"type": kind, "text": data[:cut].decode("utf-8", "replace"), "timestamp": _now()})

        def flush() -> None:
            for kind, rest in partial.items():
                if rest:
                    partial[kind] = b""
                    put({"type": kind, "text": rest.decode("utf-8", "replace"), "timestamp": _now()})

        streamed: list[Output] = []

        def on_display(output: Output) -> None:
            flush()  # what the cell printed before the display comes before it
            streamed.append(output)
            put(e2b_result(output.data, output.is_main_result))

        def work() -> None:
            try:
                with e2b.api.rates.use(token):
                    session = e2b.session(box.sandbox_id)
                    try:
                        result = session.run_cell(
                            code,
                            timeout,
                            on_output=emit,
                            cancel=cancel,
                            output_limit=CODE_OUTPUT,
                            detach=True,
                            context=context_id or None,
                            language=_language(language) if language else None,
                            env=envs or None,
                            on_display=on_display,
                        )
                    finally:
                        flush()
                if result.sandbox_replaced and e2b.gone(box.sandbox_id):
                    put(_KILLED)  # as E2B's: the connection breaks, and the SDK finds the sandbox gone
                    return
                outcome = "timeout" if result.timed_out else "ok" if result.ok else "error"
                e2b.api.metrics.run(outcome, result.duration_seconds)
                if result.execution_count is not None:
                    put({"type": "number_of_executions", "execution_count": result.execution_count})
                for output in result.outputs[len(streamed) :]:  # those that came with the end (not Python's)
                    put(e2b_result(output.data, output.is_main_result))
                if result.error is not None:
                    err = result.error
                    put({"type": "error", "name": err.name, "value": err.value, "traceback": err.traceback})
                elif result.interpreter_restarted:
                    why = (
                        f"the interpreter reached the {result.limits.memory} memory limit"
                        if result.oom_killed
                        else "the interpreter was killed (or ignored its interrupt)"
                    )
                    put(
                        {
                            "type": "error",
                            "name": "InterpreterRestarted",
                            "value": why + " and was restarted; its state is gone",
                            "traceback": "",
                        }
                    )
                put({"type": "end_of_execution"})
            except Exception as exc:  # noqa: BLE001 - reported in the stream
                if e2b.gone(box.sandbox_id):
                    put(_KILLED)
                    return
                put({"type": "error", "name": type(exc).__name__, "value": str(exc), "traceback": ""})
            finally:
                put(None)

        async def lines() -> AsyncIterator[bytes]:
            worker = asyncio.ensure_future(run_in_threadpool(work))
            try:
                while (item := await queue.get()) is not None:
                    if item is _KILLED:  # break the connection mid-stream, as E2B's proxy does
                        raise SandboxKilled(f"sandbox {box.sandbox_id} was killed during the execution")
                    yield json.dumps(item).encode() + b"\n"
            finally:
                cancel.set()  # the client went away (its timeout): interrupt the cell, keep the state
                await worker

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    def context_json(context: CodeContext) -> dict[str, Any]:
        cwd = HOME + context.cwd[len(WORKSPACE) :] if context.cwd.startswith(WORKSPACE) else context.cwd
        return {"id": context.id, "language": context.language, "cwd": cwd}

    async def in_session(request: Request, call: Callable[[Session], Any]) -> Any:
        box, token = await sandbox_of(request)

        def work() -> Any:
            with e2b.api.rates.use(token):
                return call(e2b.session(box.sandbox_id))

        return await run_in_threadpool(work)

    @router.post("/contexts")
    async def create_context(request: Request) -> Response:
        try:
            try:
                body = await request.json() if await request.body() else {}
            except (ValueError, RecursionError):
                raise E2BError(400, 'the body must be JSON: {"language": ..., "cwd": ...}') from None
            body = body if isinstance(body, dict) else {}
            language, cwd = body.get("language") or "python", body.get("cwd") or HOME
            if not isinstance(language, str) or _language(language) is None:
                raise E2BError(400, f"language {language!r} is not supported: {LANGUAGES_SAID}")
            if not isinstance(cwd, str) or not cwd.startswith("/"):
                raise E2BError(400, f"cwd must be an absolute path, got {cwd!r}")
            context = await in_session(request, lambda s: s.create_context(_language(language) or "python", cwd))
        except Exception as exc:  # noqa: BLE001 - E2B's error shape
            return e2b_error_response(exc)
        return JSONResponse(context_json(context))

    @router.get("/contexts")
    async def list_contexts(request: Request) -> Response:
        try:
            contexts = await in_session(request, lambda s: s.list_contexts())
        except Exception as exc:  # noqa: BLE001 - E2B's error shape
            return e2b_error_response(exc)
        return JSONResponse([context_json(c) for c in contexts])

    @router.post("/contexts/{context_id}/restart")
    async def restart_context(context_id: str, request: Request) -> Response:
        try:
            await in_session(request, lambda s: s.restart_context(context_id))
        except Exception as exc:  # noqa: BLE001 - E2B's error shape
            return e2b_error_response(exc)
        return Response(status_code=204)

    @router.delete("/contexts/{context_id}")
    async def remove_context(context_id: str, request: Request) -> Response:
        try:
            await in_session(request, lambda s: s.remove_context(context_id))
        except Exception as exc:  # noqa: BLE001 - E2B's error shape
            return e2b_error_response(exc)
        return Response(status_code=204)

    return router


LANGUAGES_SAID = "the code interpreter runs python, javascript, typescript and bash (not r or java)"

#: Put in an execution's stream when its sandbox was killed under it.
_KILLED: dict[str, Any] = {"type": "killed"}


class SandboxKilled(Exception):
    """Ends an execution's response without its last chunk: the client sees the connection break."""


#: E2B's ``Result`` fields for each MIME type (template/server/api/models/result.py).
_FIELDS = {
    "text/plain": "text",
    "text/html": "html",
    "text/markdown": "markdown",
    "image/svg+xml": "svg",
    "image/png": "png",
    "image/jpeg": "jpeg",
    "application/pdf": "pdf",
    "text/latex": "latex",
    "application/json": "json",
    "application/javascript": "javascript",
    "e2b/data": "data",
    "e2b/chart": "chart",
}


def _language(name: str) -> str | None:
    """The interpreter a name E2B's SDKs send (python, js, ts, bash, ...) means, if any."""
    return CONTEXT_LANGUAGES.get(name.strip().lower())


def e2b_result(data: dict[str, Any], is_main_result: bool) -> dict[str, Any]:
    """One output as E2B's ``result`` message: each known format under its field (text/plain
    without a string's quotes, as E2B's server sends it), the others under ``extra``."""
    result: dict[str, Any] = {"type": "result", "is_main_result": is_main_result}
    extra = {}
    for mime, value in data.items():
        field = _FIELDS.get(mime)
        if field is None:
            extra[mime] = value
        else:
            result[field] = _plain(value) if field == "text" and isinstance(value, str) else value
    if extra:
        result["extra"] = extra
    return result


def _plain(text: str) -> str:
    """``text/plain`` as E2B's code-interpreter server sends it: a string's repr without its
    quotes (``'bar'`` is ``bar``), as its ``Result`` does (template/server/api/models/result.py)."""
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    return text
