"""Work a server must do when it stops, whatever ASGI app it serves.

uvicorn answers SIGTERM by running the app's lifespan shutdown and then re-raising the signal,
so code after ``uvicorn.run`` never runs: cleanup belongs in the lifespan (measured: a ``finally``
after ``uvicorn.run`` left the warm pool's containers behind).
"""

from __future__ import annotations

from collections.abc import Callable

from starlette.concurrency import run_in_threadpool
from starlette.types import ASGIApp, Message, Receive, Scope, Send


def at_shutdown(app: ASGIApp, cleanup: Callable[[], None]) -> ASGIApp:
    """``app``, with ``cleanup`` run (in a thread) when the server's lifespan shutdown begins."""

    async def wrapped(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "lifespan":
            await app(scope, receive, send)
            return

        async def receive_and_clean() -> Message:
            message = await receive()
            if message["type"] == "lifespan.shutdown":
                await run_in_threadpool(cleanup)
            return message

        await app(scope, receive_and_clean, send)

    return wrapped
