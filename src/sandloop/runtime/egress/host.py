"""Where the egress proxy meets a sandbox on this host: the state folder its sockets live in, the
folder and the environment a sandbox sees (``SANDBOX_DIR``, ``RELAY``), a listener made inside a
sandbox's network namespace, and the descriptor limit a server lifts for the relays.
"""

from __future__ import annotations

import ctypes
import os
import socket
import tempfile
import threading
from pathlib import Path

#: Where the socket appears inside the sandbox (the launcher and the image know it).
SANDBOX_DIR = "/run/sandloop-egress"
SOCKET_NAME = "proxy.sock"
#: The relay's address inside the sandbox.
RELAY = "127.0.0.1:3128"


def egress_state() -> Path:
    """Where sandboxes' proxy sockets live: a short path (a socket's is limited to 107 bytes)."""
    if os.geteuid() == 0:
        return Path("/run/sandloop/egress")
    return Path(tempfile.gettempdir()) / f"sandloop-egress-{os.getuid()}"


def kernel_egress_key(session_id: str) -> str:
    """A session's interpreter's egress directory name: found again from any process."""
    return f"kernel-{session_id}"


def sandbox_env(relay: bool) -> dict[str, str]:
    """The environment that points a sandbox's tools at ``RELAY``: served by the launcher's relay
    to the socket (``relay``), or by the proxy itself inside the sandbox's network namespace."""
    url = f"http://{RELAY}"
    return {
        **({"SANDLOOP_EGRESS_SOCKET": f"{SANDBOX_DIR}/{SOCKET_NAME}"} if relay else {}),
        "HTTP_PROXY": url,
        "HTTPS_PROXY": url,
        "http_proxy": url,
        "https_proxy": url,
        "NO_PROXY": "",
        "no_proxy": "",
        "PIP_PROXY": url,
        "npm_config_proxy": url,
        "npm_config_https_proxy": url,
        # (the image's own NODE_OPTIONS, sandloop_stdio.js, kept: this replaces it)
        "NODE_OPTIONS": "--require /opt/sandloop/sandloop_stdio.js --require /opt/sandloop/egress-fetch.js",
    }


_CLONE_NEWNET = 0x40000000


def listener_in_netns(pid: int) -> socket.socket:
    """A TCP socket listening on ``RELAY`` in the network namespace of ``pid``. Made on a thread of
    its own that enters the namespace and then ends (a socket keeps the namespace it was made in;
    no other thread of this process ever changes namespace)."""
    made: dict[str, object] = {}

    def make() -> None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            fd = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY)
            try:
                if libc.setns(fd, _CLONE_NEWNET) != 0:
                    err = ctypes.get_errno()
                    raise OSError(err, f"setns into the sandbox's network namespace: {os.strerror(err)}")
            finally:
                os.close(fd)
            host, port = RELAY.split(":")
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            # A session's interpreter may be served by two processes at once (each attached).
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.bind((host, int(port)))
            sock.listen(128)
            sock.setblocking(False)
            made["socket"] = sock
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            made["error"] = exc

    thread = threading.Thread(target=make, name="sandloop-egress-netns")
    thread.start()
    thread.join()
    if "error" in made:
        raise made["error"]  # type: ignore[misc]
    return made["socket"]  # type: ignore[return-value]


def raise_open_files() -> int:
    """Lift this process's soft descriptor limit to its hard one (a server holds a relay's two
    descriptors per proxied connection); returns the limit now in force. Never raises."""
    import resource

    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard == resource.RLIM_INFINITY:
            hard = max(soft, 1 << 20)
        if soft < hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        return resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ValueError, OSError):
        return -1


def sandbox_mount(directory: Path) -> tuple[str, str]:
    """(host directory, where it goes in the sandbox)."""
    return str(directory), SANDBOX_DIR
