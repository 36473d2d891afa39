"""A program started in a running container (``docker exec``) as an ``ExecStream``: the
container's own user, namespaces, cgroup, capabilities and seccomp filter, as Docker gives every
exec (``Reachable``, runtime/base.py). Its stdout comes in Docker's 8-byte frames; stderr is not
attached (the program says nothing there that the host reads)."""

from __future__ import annotations

import contextlib
import socket
from typing import Any

import docker
from sandloop.contract import SandboxError
from sandloop.runtime.docker.stream import FrameDemux, close_quietly, raw_socket


class DockerExecStream:
    def __init__(self, api: docker.APIClient, container_id: str, argv: list[str]) -> None:
        try:
            made = api.exec_create(container_id, argv, stdin=True, stdout=True, stderr=False, workdir="/workspace")
            self._attached: Any = api.exec_start(made["Id"], socket=True)
        except docker.errors.APIError as exc:
            raise SandboxError(f"cannot start a program in sandbox {container_id[:12]}: {exc.explanation}") from exc
        self._sock: socket.socket = raw_socket(self._attached)
        self._sock.settimeout(None)
        self._demux = FrameDemux()
        self._pending: list[bytes] = []

    def read(self, n: int) -> bytes:
        while not self._pending:
            data = self._sock.recv(max(n, 8192))
            if not data:
                return b""
            self._pending = [chunk for stream, chunk in self._demux.feed(data) if stream == 1 and chunk]
        return self._pending.pop(0)

    def write(self, data: bytes) -> None:
        self._sock.sendall(data)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        close_quietly(self._attached)
