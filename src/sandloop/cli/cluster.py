"""``sandloop cluster status``: the sandbox nodes of a Ray cluster, their capacity, pool and runs."""

from __future__ import annotations

import json
from typing import Annotated, get_args

import typer
from rich.table import Table

from sandloop.cli.common import _fail, cluster_app, out


@cluster_app.command("status")
def cluster_status(
    as_json: Annotated[bool, typer.Option("--json", help="Print the nodes' states as JSON.")] = False,
) -> None:
    """List the nodes that offer sandboxes: capacity, warm pool, runs in flight, image. Needs
    SANDLOOP_BACKEND=ray (and RAY_ADDRESS, or a local cluster)."""
    from sandloop.contract import SandboxError, SandboxLimits
    from sandloop.root import default_root

    try:
        root = default_root()
    except SandboxError as exc:
        raise _fail(str(exc)) from None
    status = getattr(root.backend, "status", None)
    if status is None:
        raise _fail(
            f"the backend is {root.backend.name}, not a cluster: set SANDLOOP_BACKEND=ray and RAY_ADDRESS=HEAD:6379",
            2,
        )
    try:
        nodes = status()
    except SandboxError as exc:
        raise _fail(str(exc)) from None
    if as_json:
        out.print_json(json.dumps(nodes, default=str))
        return
    # The runtimes a run can ask for (the engine also lists its internal ones).
    offered = get_args(SandboxLimits.model_fields["runtime"].annotation)
    table = Table("node", "host", "backend", "runtimes", "running / max", "warm", "runs", "image")
    for n in nodes:
        pools = (n.get("pool") or {}).get("pools") or {}
        warm = sum(int(p.get("ready", 0)) for p in pools.values())
        image = "ok" if n.get("has_image") else f"[red]{n.get('problem') or 'missing'}[/]"
        table.add_row(
            str(n.get("node_id", ""))[:12],
            str(n.get("host", "-")),
            str(n.get("backend", "-")),
            ", ".join(r for r in n.get("runtimes") or [] if r in offered) or "-",
            f"{n.get('running', '-')} / {n.get('max_running', '-')}",
            str(warm),
            str(n.get("runs", "-")),
            image,
        )
    out.print(table)
    usable = sum(1 for n in nodes if n.get("has_image"))
    out.print(f"{len(nodes)} sandbox node(s), {usable} taking runs")
    if not usable:
        raise typer.Exit(1)
