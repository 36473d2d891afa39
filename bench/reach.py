"""Reaching into a sandbox (issue 38), side by side in one run on one machine:

1. first byte of an HTTP answer: the same server (python's http.server, one small file) on the
   host's loopback, asked directly, beside one in a session's sandbox asked through the
   server's preview URL (``<port>-<id>.localhost``, a fresh connection each time, as a browser's
   first request) and through ``Session.expose``; per runtime;
2. a terminal's keystroke echo: one byte sent to ``cat`` on a session terminal, until it comes
   back (``Session.terminal``, the path E2B's ``sandbox.pty`` takes).

    python bench/reach.py --runs 200 --out docs/benchmarks.md

Measures are interleaved round-robin, so the machine's noise falls on all alike.
"""

from __future__ import annotations

import argparse
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median as p50

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.servers: a real uvicorn

from _report import emit  # noqa: E402 - bench/ is the script's directory

SERVE = (
    "import subprocess; open('/workspace/f.txt', 'w').write('x' * 100); "
    "subprocess.Popen(['python3', '-m', 'http.server', '8000'], cwd='/workspace', "
    "stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)"
)


INSIDE = """
import socket, time, statistics
def fb():
    t = time.perf_counter()
    with socket.create_connection(("127.0.0.1", 8000)) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.sendall(b"GET /f.txt HTTP/1.1\\r\\nHost: x\\r\\nConnection: close\\r\\n\\r\\n")
        s.recv(1)
        took = time.perf_counter() - t
        while s.recv(65536):
            pass
    return took
xs = [fb() for _ in range(%d)]
print(statistics.median(xs), sorted(xs)[int(0.95 * len(xs))])
"""


def first_byte(port: int, host: str, extra: str = "") -> float:
    started = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.sendall(f"GET /f.txt HTTP/1.1\r\nHost: {host}\r\n{extra}Connection: close\r\n\r\n".encode())
        if not s.recv(1).startswith(b"H"):
            raise RuntimeError("no HTTP answer")
        took = time.perf_counter() - started
        while s.recv(65536):
            pass
    return took


def wait_served(port: int, host: str, extra: str = "", seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while True:
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(f"GET /f.txt HTTP/1.1\r\nHost: {host}\r\n{extra}Connection: close\r\n\r\n".encode())
            head = s.recv(64)
        if head.startswith(b"HTTP/1.0 200") or head.startswith(b"HTTP/1.1 200"):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"not served: {head!r}")
        time.sleep(0.2)


def pct(xs: list[float], q: float) -> float:
    return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--runtimes", default="runc,runsc")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    from sandloop import SandboxLimits, Sandloop, Settings, __version__
    from sandloop.server.app import create_app
    from sandloop.server.tokens import TokenStore
    from tests.servers import serve_in_thread

    runtimes = [r for r in args.runtimes.split(",") if r]
    home = Path(tempfile.mkdtemp(prefix="sandloop-bench-reach-"))
    tokens = TokenStore(home / "tokens.sqlite")
    secret, _ = tokens.create("bench", runs_per_minute=100_000, max_concurrent=64)
    auth = f"Authorization: Bearer {secret}\r\n"
    site = home / "site"
    site.mkdir()
    (site / "f.txt").write_text("x" * 100)
    local = socket.socket()
    local.bind(("127.0.0.1", 0))
    direct_port = local.getsockname()[1]
    local.close()
    direct = subprocess.Popen(
        [sys.executable, "-m", "http.server", str(direct_port), "--bind", "127.0.0.1"],
        cwd=site,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    results: dict[str, list[float]] = {"direct (host loopback)": []}
    echo: dict[str, list[float]] = {}
    try:
        with Sandloop(Settings(pool_size=0, session_pool_size=0)) as root:
            app = create_app(tokens, sandloop=root)
            with serve_in_thread(app) as url:
                api_port = int(url.rsplit(":", 1)[1])
                sessions, exposed, terms, hosts = {}, {}, {}, {}
                try:
                    for rt in runtimes:
                        s = sessions[rt] = root.create_session(SandboxLimits(runtime=rt), ttl=3600)
                        tokens.own(s.id, tokens.verify(secret).id)  # type: ignore[union-attr]
                        s.run_cell(SERVE)
                        hosts[rt] = f"8000-{s.id}.localhost:{api_port}"
                        wait_served(api_port, hosts[rt], auth)
                        exposed[rt] = s.expose(8000)
                        terms[rt] = s.terminal(cmd=["/bin/cat"])
                        results[f"preview URL ({rt})"] = []
                        results[f"Session.expose ({rt})"] = []
                        echo[rt] = []
                    wait_served(direct_port, "localhost")
                    for _ in range(args.runs):
                        results["direct (host loopback)"].append(first_byte(direct_port, "localhost"))
                        for rt in runtimes:
                            results[f"preview URL ({rt})"].append(first_byte(api_port, hosts[rt], auth))
                            results[f"Session.expose ({rt})"].append(first_byte(exposed[rt].address[1], "localhost"))
                            started = time.perf_counter()
                            terms[rt].send(b"k")
                            got = b""
                            while b"k" not in got:
                                got += terms[rt].recv(10)
                            echo[rt].append(time.perf_counter() - started)  # the terminal's echo of the key
                            time.sleep(0.002)
                            terms[rt].take()
                    inside = {}
                    for rt in runtimes:  # the same request made inside the sandbox, to its own loopback
                        cell = sessions[rt].run_cell(INSIDE % args.runs, timeout_seconds=300)
                        numbers = re.findall(r"\d+\.\d+(?:e-?\d+)?", cell.stdout)
                        if len(numbers) != 2:
                            raise RuntimeError(f"the measure inside {rt} failed: {cell.stdout!r} {cell.error}")
                        inside[rt] = (float(numbers[0]), float(numbers[1]))
                finally:  # whatever failed: nothing of the bench is left
                    for rt in sessions:
                        if rt in exposed:
                            exposed[rt].close()
                        if rt in terms:
                            terms[rt].close()
                        sessions[rt].delete()
    finally:
        direct.terminate()
        direct.wait(10)
        shutil.rmtree(home, ignore_errors=True)
    base = p50(results["direct (host loopback)"])
    lines = [
        f"### Reaching into a sandbox ({args.runs} interleaved rounds, sandloop {__version__}, "
        f"{time.strftime('%Y-%m-%d')})",
        "",
        "| path | first byte p50 | p95 | over direct (p50) |",
        "|---|---|---|---|",
    ]
    for name, xs in results.items():
        lines.append(
            f"| {name} | {p50(xs) * 1000:.2f} ms | {pct(xs, 0.95) * 1000:.2f} ms | +{(p50(xs) - base) * 1000:.2f} ms |"
        )
    for rt, (mid, high) in inside.items():
        lines.append(
            f"| inside the {rt} sandbox, to its own loopback | {mid * 1000:.2f} ms | {high * 1000:.2f} ms "
            f"| +{(mid - base) * 1000:.2f} ms |"
        )
    lines += ["", "| terminal keystroke echo | p50 | p95 |", "|---|---|---|"]
    for rt, xs in echo.items():
        lines.append(f"| {rt} | {p50(xs) * 1000:.2f} ms | {pct(xs, 0.95) * 1000:.2f} ms |")
    emit("\n".join(lines), args.out)


if __name__ == "__main__":
    main()
