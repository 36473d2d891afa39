"""``sandloop tokens``: bearer tokens and their ceilings."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from sandloop.cli.common import _fail, err, out, tokens_app
from sandloop.server.tokens import Token


@tokens_app.command("create")
def tokens_create(
    name: Annotated[str, typer.Argument(help="A name to recognise the token by (unique among active tokens).")],
    max_concurrent: Annotated[int, typer.Option(help="Sandbox operations at once.")] = Token.max_concurrent,
    runs_per_minute: Annotated[
        int, typer.Option(help="Sandbox operations (runs, cells, file calls) per minute.")
    ] = Token.runs_per_minute,
    max_memory: Annotated[str, typer.Option(help="Most memory a run may ask for.")] = "1g",
    max_timeout: Annotated[float, typer.Option(help="Longest timeout a run may ask for, in seconds.")] = 300,
    max_sessions: Annotated[int, typer.Option(help="Live sessions at once.")] = 10,
    max_workspace: Annotated[str, typer.Option(help="Total workspace quota of its live sessions.")] = "10g",
    agent_runs_per_day: Annotated[int, typer.Option(help="Agent runs per UTC day.")] = 100,
    agent_tokens_per_day: Annotated[int, typer.Option(help="Model tokens (in + out) per UTC day.")] = 1_000_000,
    agent_max_iterations: Annotated[int, typer.Option(help="Most model turns in one agent run.")] = 20,
    provider_url: Annotated[
        list[str] | None,
        typer.Option("--provider-url", help="Restrict agent runs to these of the server's endpoint URLs (repeatable)."),
    ] = None,
    egress: Annotated[
        list[str] | None,
        typer.Option(
            "--egress",
            help="Hosts this token's runs may put on their egress allowlist (repeatable: pypi.org, *.example.com, "
            "'any'). Without it, the token's runs get no network at all.",
        ),
    ] = None,
) -> None:
    """Create a token; the secret is printed once."""
    from sandloop.server.providers import normalize_url
    from sandloop.server.tokens import TokenError, TokenStore

    try:
        urls = tuple(normalize_url(u) for u in provider_url or [])
        secret, token = TokenStore().create(
            name,
            max_concurrent=max_concurrent,
            runs_per_minute=runs_per_minute,
            max_memory=max_memory,
            max_timeout=max_timeout,
            max_sessions=max_sessions,
            max_workspace=max_workspace,
            agent_runs_per_day=agent_runs_per_day,
            agent_tokens_per_day=agent_tokens_per_day,
            agent_max_iterations=agent_max_iterations,
            provider_urls=urls,
            egress=tuple(egress or ()),
        )
    except (TokenError, ValueError) as exc:
        raise _fail(str(exc), 2) from None
    err.print(f"created {token.id} ({name}); the secret is shown only now:")
    print(secret)


@tokens_app.command("ls")
def tokens_ls(
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object per token.")] = False,
) -> None:
    """List tokens with their ceilings and today's agent usage (never their secrets)."""
    import dataclasses
    import json

    from sandloop.server.tokens import TokenStore

    store = TokenStore()
    rows = [(t, store.usage(t.id)) for t in store.list()]
    if as_json:
        for t, used in rows:
            print(json.dumps({**dataclasses.asdict(t), "usage_today": dataclasses.asdict(used)}))
        return
    header = ("id", "name", "state", "ops/min", "at once", "memory", "timeout", "sessions", "workspace", "agent today")
    lines = [
        (
            t.id,
            t.name,
            "revoked" if t.revoked else "active",
            str(t.runs_per_minute),
            str(t.max_concurrent),
            t.max_memory,
            f"{t.max_timeout:g}s",
            str(t.max_sessions),
            t.max_workspace,
            f"{used.agent_runs}/{t.agent_runs_per_day} runs, {used.model_tokens}/{t.agent_tokens_per_day} tokens",
        )
        for t, used in rows
    ]
    if not out.is_terminal:  # piped: one tab-separated line per token, nothing cut (grep, cut, awk)
        for line in (header, *lines):
            print("\t".join(line))
        return
    # At a terminal of any width: the ceilings in one column that wraps between them, every value
    # whole (a long name folds onto a second line rather than being cut to "new…"); ids are what
    # `revoke` takes, so they never wrap.
    table = Table("id", "name", "state", "limits", "agent today", box=None, pad_edge=False, header_style="bold")
    for column in table.columns:
        column.overflow = "fold"
    table.columns[0].no_wrap = True
    table.columns[2].no_wrap = True
    for t_id, name, state, ops, at_once, memory, timeout, sessions, workspace, agent in lines:
        limits = (
            f"{ops} ops/min, {at_once} at once, memory {memory}, timeout {timeout}, "
            f"{sessions} sessions, workspace {workspace}"
        )
        table.add_row(t_id, name, state, limits, agent)
    out.print(table)


@tokens_app.command("revoke")
def tokens_revoke(token: Annotated[str, typer.Argument(help="The token's id (tok_...) or name.")]) -> None:
    """Revoke a token at once."""
    from sandloop.server.tokens import TokenStore

    revoked = TokenStore().revoke(token)
    if revoked is None:
        raise _fail(f"no active token with id or name {token!r} (see `sandloop tokens ls`)", 1)
    out.print(f"revoked {revoked.id} ({revoked.name})")
