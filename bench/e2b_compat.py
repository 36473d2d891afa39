"""What the E2B-compatible layer costs, side by side in one run against one server:

1. a whole sandbox through E2B's SDK (``Sandbox.create()`` + ``run_code("1")`` + ``kill()``) next to
   the same through sandloop's native HTTP API (create a session, run the cell ``1``, delete it);
2. a warm ``run_code("1")`` on a live sandbox through the SDK next to a native session cell
   (``POST /v1/sessions/{id}/cells``) over a kept-alive HTTP connection.

    make bench             # runs this after bench.py
    python bench/e2b_compat.py --runs 30 --out docs/benchmarks.md   # appends its table

Modes are interleaved (which goes first alternates). The server is a real uvicorn on loopback.
"""

from __future__ import annotations

import argparse
import os
import socket
import tempfile
import threading
import time
from pathlib import Path
from statistics import median as p50

import httpx
import uvicorn
from _report import emit  # bench/ is the script's directory


def _serve(app: object) -> tuple[str, uvicorn.Server, threading.Thread]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))  # type: ignore[arg-type]
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    while not srv.started:
        time.sleep(0.05)
    return f"http://127.0.0.1:{port}", srv, thread


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    from sandloop import Sandloop, Settings
    from sandloop.server.app import create_app
    from sandloop.server.tokens import TokenStore

    home = Path(tempfile.mkdtemp(prefix="sandloop-bench-e2b-"))
    # No warm sessions: both sides create cold ones, so the difference is the E2B layer's alone
    # (bench/notebook.py measures warm sessions).
    root = Sandloop(Settings(home=home, session_pool_size=0))
    tokens = TokenStore(home / "tokens.sqlite")
    key, _ = tokens.create("bench", max_concurrent=8, runs_per_minute=100000, max_sessions=20)
    url, srv, thread = _serve(create_app(tokens, sandloop=root))
    os.environ.update(E2B_API_URL=url, E2B_SANDBOX_URL=url, E2B_API_KEY=key)
    from e2b_code_interpreter import Sandbox  # reads the environment above

    native = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=120)

    def sdk_cycle() -> None:
        s = Sandbox.create()
        assert s.run_code("1").text == "1"
        s.kill()

    def native_cycle() -> None:
        sid = native.post("/v1/sessions", json={}).json()["id"]
        assert native.post(f"/v1/sessions/{sid}/cells", json={"code": "1"}).json()["value"] == "1"
        assert native.delete(f"/v1/sessions/{sid}").status_code == 204

    seconds: dict[str, list[float]] = {"sdk cycle": [], "native cycle": [], "sdk warm": [], "native warm": []}
    try:
        sdk_cycle()  # the first of each warms imports, pools and connections
        native_cycle()
        live = Sandbox.create(timeout=3600)
        sid = native.post("/v1/sessions", json={}).json()["id"]
        live.run_code("1")
        native.post(f"/v1/sessions/{sid}/cells", json={"code": "1"})

        def sdk_warm() -> None:
            assert live.run_code("1").text == "1"

        def native_warm() -> None:
            assert native.post(f"/v1/sessions/{sid}/cells", json={"code": "1"}).json()["value"] == "1"

        for i in range(args.runs):
            for pair in (
                [("sdk cycle", sdk_cycle), ("native cycle", native_cycle)],
                [("sdk warm", sdk_warm), ("native warm", native_warm)],
            ):
                for name, call in pair if i % 2 else pair[::-1]:
                    time.sleep(0.2)  # pools refilled: each call alone on the machine
                    started = time.perf_counter()
                    call()
                    seconds[name].append(time.perf_counter() - started)
        live.kill()
        native.delete(f"/v1/sessions/{sid}")
    finally:
        native.close()
        srv.should_exit = True
        thread.join(10)
        root.close()

    warm_ratio = p50(seconds["sdk warm"]) / p50(seconds["native warm"])
    cycle_ratio = p50(seconds["sdk cycle"]) / p50(seconds["native cycle"])
    ms = {k: p50(v) * 1000 for k, v in seconds.items()}
    table = "\n".join(
        [
            f"### E2B-compatible API ({args.runs} runs each, interleaved; runc; {time.strftime('%Y-%m-%d')})",
            "",
            "| measure, p50 | through E2B's SDK | sandloop's native HTTP API | ratio | target |",
            "|---|---:|---:|---:|---:|",
            f'| create + `run_code("1")` + kill | {ms["sdk cycle"]:.1f} ms | {ms["native cycle"]:.1f} ms '
            f"(session + cell + delete) | {cycle_ratio:.2f}x | |",
            f'| warm `run_code("1")` | {ms["sdk warm"]:.1f} ms | {ms["native warm"]:.1f} ms (session cell) '
            f"| {warm_ratio:.2f}x | <= 2x |",
            "",
        ]
    )
    emit(table, args.out)


if __name__ == "__main__":
    main()
