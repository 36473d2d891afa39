"""The pipe between a session's supervisor (``kernel.py``) and each of its contexts: one cell per
message, a JSON line (``{"code": N, "env", "ca", "nonce"}``) then N bytes of code; one JSON
line back per cell on the reply pipe."""

import json
import os


def read_message(fd, buffered):
    """``((header, code), rest)`` of the next message on ``fd`` after ``buffered`` bytes, or
    ``(None, b"")`` at the pipe's end."""
    while b"\n" not in buffered:
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            return None, b""
        buffered += chunk
    line, _, rest = buffered.partition(b"\n")
    header = json.loads(line)
    size = int(header.get("code") or 0)
    while len(rest) < size:
        chunk = os.read(fd, max(1 << 16, size - len(rest)))
        if not chunk:
            return None, b""
        rest += chunk
    return (header, rest[:size].decode("utf-8", "replace")), rest[size:]


def write_all(fd, data):
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
