"""Inside a sandbox with an egress allowlist: relay 127.0.0.1:3128 to sandloop's egress proxy.

The sandbox has no network but loopback; the proxy's Unix socket is bind-mounted at
$SANDLOOP_EGRESS_SOCKET. The launcher binds the port (so it is ready before any code runs), then
this serves it in a detached process (a grandchild of the launcher, adopted by tini). Every byte
goes to the proxy, which decides; this relay decides nothing.
"""

import asyncio
import os


async def _pipe(reader, writer):
    try:
        while True:
            data = await reader.read(65536)
            if not data:
                break
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        try:
            if writer.can_write_eof():
                writer.write_eof()
            else:
                writer.close()
        except (ConnectionError, OSError, RuntimeError):
            pass


async def _handle(path, client_reader, client_writer):
    try:
        up_reader, up_writer = await asyncio.open_unix_connection(path)
    except OSError as exc:
        body = ("sandloop egress: the proxy is not reachable (%s)\n" % exc.strerror).encode()
        client_writer.write(
            b"HTTP/1.1 502 Bad Gateway\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body
        )
        client_writer.close()
        return
    await asyncio.gather(_pipe(client_reader, up_writer), _pipe(up_reader, client_writer))
    for w in (up_writer, client_writer):
        w.close()


def serve(listener, path):
    async def main():
        server = await asyncio.start_server(lambda r, w: _handle(path, r, w), sock=listener)
        await server.serve_forever()

    asyncio.run(main())


def start():
    """Bind the relay's port and serve it from a detached grandchild; return at once."""
    path = os.environ.get("SANDLOOP_EGRESS_SOCKET")
    if not path:
        return
    import socket

    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 3128))
    listener.listen(128)
    pid = os.fork()
    if pid == 0:
        try:
            if os.fork() == 0:
                devnull = os.open(os.devnull, os.O_RDWR)
                for fd in (0, 1, 2):
                    os.dup2(devnull, fd)
                serve(listener, path)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    listener.close()
