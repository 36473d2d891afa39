"""``sandloop serve`` (HTTP API, playground) and ``sandloop mcp`` (stdio or streamable HTTP)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Literal

import typer

from sandloop.cli.common import SECRET_HELP, _fail, app, err, parse_secrets
from sandloop.contract import SandboxError, SandboxLimits

_HEAD_TIMEOUT = typer.Option(
    "--head-timeout",
    help="Seconds a connection may take to send a whole request head; past it, it is closed "
    "(a client that never finishes one holds nothing).",
)


def _warn_if_exposed(host: str, what: str) -> None:
    import ipaddress

    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if not loopback:
        err.print(
            f"[yellow]warning:[/] {what} listens on {host} without TLS: bearer tokens and code cross the network "
            "in clear text. Put it behind a TLS-terminating proxy, or listen on 127.0.0.1."
        )


@app.command()
def serve(
    host: Annotated[str, typer.Option("--host", help="Interface to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", help="TCP port.")] = 8080,
    provider_url: Annotated[
        list[str] | None,
        typer.Option(
            "--provider-url",
            help="A model endpoint agent runs may use: PROVIDER=URL (no key sent) or PROVIDER=URL;key=ENV_VAR "
            "(the value of $ENV_VAR is sent). Repeatable; the first per provider is its default.",
        ),
    ] = None,
    official_providers: Annotated[
        bool,
        typer.Option(
            "--official-providers/--no-official-providers",
            help="Also list api.anthropic.com and api.openai.com (with ANTHROPIC_API_KEY / OPENAI_API_KEY).",
        ),
    ] = True,
    metrics: Annotated[
        str, typer.Option("--metrics", help="Who may read /metrics: token (a valid token), open, or off.")
    ] = "token",
    head_timeout: Annotated[float, _HEAD_TIMEOUT] = 30.0,
    preview_domain: Annotated[
        str,
        typer.Option(
            "--preview-domain",
            help="Preview URLs of sandbox ports are <port>-<session id>.DOMAIN on this server's port "
            "(browsers resolve every *.localhost to this machine; another domain needs a wildcard DNS record).",
        ),
    ] = "localhost",
    tls_cert: Annotated[
        str | None, typer.Option("--tls-cert", help="Serve HTTPS with this certificate (PEM; with --tls-key).")
    ] = None,
    tls_key: Annotated[str | None, typer.Option("--tls-key", help="The private key of --tls-cert (PEM).")] = None,
) -> None:
    """Serve the HTTP API (OpenAPI at /docs). Create a token first: `sandloop tokens create NAME`."""
    try:
        import uvicorn  # noqa: F401 - here to say which extra is missing, used by serve_forever

        from sandloop.server.app import create_app
        from sandloop.server.providers import EndpointConfigError, ProviderEndpoints
    except ImportError:
        raise _fail("the HTTP API needs its extra: pip install 'sandloop[server]'", 2) from None
    if metrics not in ("token", "open", "off"):
        raise _fail("--metrics must be token, open or off", 2)
    try:
        endpoints = ProviderEndpoints(provider_url or [], official=official_providers)
    except EndpointConfigError as exc:
        raise _fail(f"--provider-url {exc}", 2) from None
    from sandloop.root import shutdown
    from sandloop.server.lifecycle import at_shutdown, serve_forever

    if (tls_cert is None) != (tls_key is None):
        raise _fail("--tls-cert and --tls-key go together: give both, or neither", 2)
    for flag, path in (("--tls-cert", tls_cert), ("--tls-key", tls_key)):
        if path is not None and not Path(path).is_file():
            raise _fail(f"{flag}: no such file: {path}", 2)
    if tls_cert is None:
        _warn_if_exposed(host, "the HTTP API")
    # The warm pool's sandboxes go when the server stops, not at the next reap.
    access: Literal["token", "open", "off"] = metrics  # type: ignore[assignment]  # checked above
    domain = preview_domain.strip().strip(".").lower()
    if not re.fullmatch(r"[a-z0-9-]+(\.[a-z0-9-]+)*", domain):
        raise _fail(
            f"--preview-domain must be a DNS name such as localhost or preview.example.com, got {preview_domain!r}", 2
        )
    fastapi_app = create_app(providers=endpoints, metrics_access=access, preview_domain=domain)
    app_ = at_shutdown(fastapi_app, shutdown)
    tls = (tls_cert, tls_key) if tls_cert and tls_key else None
    serve_forever(app_, host, port, head_timeout, preview=fastapi_app.state.preview, tls=tls)


@app.command()
def mcp(
    transport: Annotated[str, typer.Option("--transport", help="stdio, or http (streamable HTTP at /mcp).")] = "stdio",
    host: Annotated[str, typer.Option("--host")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port")] = 8765,
    runtime: Annotated[str, typer.Option("--runtime", help="runc, or runsc (gVisor).")] = "runc",
    memory: Annotated[str, typer.Option("--memory")] = "256m",
    allow: Annotated[
        list[str] | None,
        typer.Option(
            "--allow",
            help="A host every run may reach over HTTP(S) through the egress proxy (repeatable). The operator "
            "chooses, not the model; over http a token must also permit it (tokens create --egress).",
        ),
    ] = None,
    secret: Annotated[list[str] | None, typer.Option("--secret", help=SECRET_HELP)] = None,
    head_timeout: Annotated[float, _HEAD_TIMEOUT] = 30.0,
) -> None:
    """Serve sandloop as MCP tools (run code, sessions, files) for MCP clients.

    Over http every request needs a token (`sandloop tokens create NAME`, sent as
    `Authorization: Bearer ...`); a token sees only its own sessions. stdio trusts the local user.
    """
    try:
        from sandloop.server.mcp_server import create_mcp_server, http_app
    except ImportError:
        raise _fail("the MCP server needs its extra: pip install 'sandloop[mcp]'", 2) from None
    if transport not in ("stdio", "http"):
        raise _fail("--transport must be stdio or http", 2)
    try:
        limits = SandboxLimits(runtime=runtime, memory=memory, egress=tuple(allow or ()))
    except SandboxError as exc:
        raise _fail(str(exc), 2) from None
    from sandloop.root import shutdown

    try:
        secrets = parse_secrets(secret)
        if transport == "stdio":
            create_mcp_server(limits, secrets=secrets).run("stdio")
            return

        from sandloop.server.lifecycle import at_shutdown, serve_forever
        from sandloop.server.tokens import TokenStore

        tokens = TokenStore()
        _warn_if_exposed(host, "the MCP server")
        app_ = at_shutdown(http_app(create_mcp_server(limits, tokens, secrets=secrets), tokens, host=host), shutdown)
        serve_forever(app_, host, port, head_timeout)
    finally:
        shutdown()  # stdio ends by returning; over HTTP the lifespan above already did this
