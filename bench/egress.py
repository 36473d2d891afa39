"""What an egress allowlist costs, side by side in one run (runc, through Docker for both):

1. an HTTPS GET of a 1 MB file, timed inside the sandbox: through the egress proxy (an allowlist)
   against a direct connection (``network=True``), from the same server (on the docker0 address,
   which a bridged sandbox can reach; the proxy's name map sends ``bench.test`` there);
2. a warm run (pool of 2) of ``pass`` with an allowlist against one without.

    make bench             # runs this after bench.py
    python bench/egress.py --runs 20 --out docs/benchmarks.md   # appends its table

Modes are interleaved round-robin so the machine's noise hits them alike. No traffic leaves the host.
"""

from __future__ import annotations

import argparse
import http.server
import os
import ssl
import threading
import time
from pathlib import Path
from statistics import median as p50

import docker
import trustme
from _report import emit  # bench/ is the script's directory

from sandloop import SandboxLimits, Sandloop, Settings

BIG = os.urandom(1 << 20)


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:  # noqa: N802
        self.send_response(200)
        self.send_header("Content-Length", str(len(BIG)))
        self.end_headers()
        self.wfile.write(BIG)

    def log_message(self, *args: object) -> None:
        pass


def _gateway() -> str:
    client = docker.from_env()
    try:
        return str(client.networks.get("bridge").attrs["IPAM"]["Config"][0]["Gateway"])
    finally:
        client.close()


def _fetch_program(ca: str, url: str) -> str:
    return (
        "import ssl, time, urllib.request\n"
        f"ctx = ssl.create_default_context(cadata={ca!r})\n"
        "t = time.perf_counter()\n"
        f"data = urllib.request.urlopen({url!r}, context=ctx, timeout=60).read()\n"
        "print(len(data), time.perf_counter() - t)\n"
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--cpus", type=float, default=0.5, help="The sandboxes' CPU share (the default limit: 0.5).")
    args = ap.parse_args()

    gateway = _gateway()
    ca = trustme.CA()
    server = http.server.ThreadingHTTPServer((gateway, 0), _Handler)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ca.issue_cert("bench.test", gateway).configure_cert(context)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    ca_pem = ca.cert_pem.bytes().decode()

    settings = Settings(backend="docker", pool_size=2, egress_hosts={"bench.test:443": f"{gateway}:{port}"})
    proxied = SandboxLimits(egress=("bench.test",), cpus=args.cpus)
    direct = SandboxLimits(network=True, cpus=args.cpus)
    get_proxied = _fetch_program(ca_pem, "https://bench.test/big")
    get_direct = _fetch_program(ca_pem, f"https://{gateway}:{port}/big")
    seconds: dict[str, list[float]] = {"proxy": [], "direct": [], "warm plain": [], "warm allowlist": []}
    with Sandloop(settings) as root:
        for limits, code in ((proxied, get_proxied), (direct, get_direct)):  # warm both pools, check both
            r = root.run_code(code, limits=limits, timeout_seconds=120)
            assert r.ok and r.stdout.startswith(str(len(BIG))), r.stderr
        for i in range(args.runs):
            gets = [("proxy", proxied, get_proxied), ("direct", direct, get_direct)]
            for name, limits, code in gets if i % 2 else gets[::-1]:
                time.sleep(1.0)  # the pools' refills done: the transfer alone on the machine
                r = root.run_code(code, limits=limits, timeout_seconds=120)
                assert r.ok, r.stderr
                seconds[name].append(float(r.stdout.split()[1]))
            warm = [("warm plain", SandboxLimits()), ("warm allowlist", proxied)]
            for name, limits in warm if i % 2 else warm[::-1]:  # alternate which goes first
                time.sleep(1.0)  # let every pool refill: a warm hit on a quiet machine each time
                started = time.perf_counter()
                r = root.run_code("pass", limits=limits)
                seconds[name].append(time.perf_counter() - started)
                assert r.ok, r.stderr
    server.shutdown()

    get_ratio = p50(seconds["proxy"]) / p50(seconds["direct"])
    extra_ms = (p50(seconds["warm allowlist"]) - p50(seconds["warm plain"])) * 1000
    table = "\n".join(
        [
            f"### Egress proxy ({args.runs} runs each, interleaved; runc through Docker; {time.strftime('%Y-%m-%d')})",
            "",
            "| measure | with an allowlist (proxy) | without | ratio / difference | target |",
            "|---|---:|---:|---:|---:|",
            f"| HTTPS GET of 1 MB, timed inside, p50 | {p50(seconds['proxy']) * 1000:.1f} ms | "
            f"{p50(seconds['direct']) * 1000:.1f} ms (network=True) | {get_ratio:.2f}x | <= 1.5x |",
            f"| warm run of `pass`, p50 | {p50(seconds['warm allowlist']) * 1000:.1f} ms | "
            f"{p50(seconds['warm plain']) * 1000:.1f} ms (no network) | {extra_ms:+.1f} ms | <= 20 ms |",
            "",
        ]
    )
    emit(table, args.out)


if __name__ == "__main__":
    main()
