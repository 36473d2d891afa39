"""What ``sandloop doctor`` checks, as data: the backend, its runtimes, workspace quotas, the
runtime image, and (optionally) a real run on each runtime. Front ends only render the list."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from sandloop.contract import SandboxError, SandboxLimits
from sandloop.runtime.base import NO_DOCKER

if TYPE_CHECKING:
    from sandloop.root import Sandloop

Status = Literal["ok", "missing", "off", "failed"]


@dataclass(frozen=True)
class Check:
    name: str
    status: Status
    detail: str
    #: sandloop cannot run code while this one fails.
    essential: bool = True


def run_checks(root: Sandloop, *, smoke: bool = True) -> list[Check]:
    try:
        info = root.info()
    except SandboxError as exc:
        return [Check(f"{root.backend.name} engine", "missing", str(exc))]
    # their own checks below
    own_line = ("direct runs", "through Docker", "runc-class started by", "needs Docker", "engine", NO_DOCKER)
    no_engine = NO_DOCKER in info.details
    extra = ", ".join(f"{k} {v}" for k, v in info.details.items() if k not in own_line)
    checks = [Check(f"{info.name} engine", "ok", f"{info.version} ({extra})" if extra else info.version)]
    direct = info.details.get("direct runs")
    if direct is not None:  # the OCI backend: which runs skip dockerd, which go through it
        off = direct.startswith("off")
        detail = f"{direct}; through Docker: {info.details.get('through Docker', '?')} (docs/runtimes.md)"
        if no_engine:
            detail = f"{direct}; every run (no engine: {info.details.get('engine', '')})"
        checks.append(Check("direct runs", "off" if off else "ok", detail, essential=no_engine))
        if no_engine:
            checks.append(Check("without Docker", "off", info.details[NO_DOCKER], essential=False))
        if info.details.get("needs Docker"):
            checks.append(Check("needs Docker", "ok", info.details["needs Docker"], essential=False))
        starter = info.details.get("runc-class started by", "runc")
        if not off:
            missing = "not installed" in starter
            checks.append(Check("runc-class starter", "off" if missing else "ok", starter, essential=False))
    if not info.isolated:
        checks.append(Check("isolation", "off", "the test double runs code as local processes: tests only", False))
    for rt in ("runc", "runsc"):
        if rt in info.runtimes:
            detail = "registered" if info.isolated else "accepted and ignored (no isolation)"
            checks.append(Check(f"runtime {rt}", "ok", detail))
        else:
            fix = "run scripts/engine-up.sh as root to register gVisor (runsc)"
            checks.append(Check(f"runtime {rt}", "missing", fix, essential=rt == "runc"))
    if no_engine:
        checks.append(Check("egress allowlists", "off", "need Docker (engine=false)", essential=False))
    elif info.name in ("docker", "oci"):
        if "runsc" not in info.runtimes:
            egress = Check("egress allowlists", "ok", "runc: the proxy listens inside each sandbox", essential=False)
        elif "runsc-egress" in info.runtimes:
            egress = Check("egress allowlists", "ok", "runc and runsc (runsc-egress registered)", essential=False)
        else:
            fix = "runc only: run scripts/engine-up.sh as root to register runsc-egress for gVisor"
            egress = Check("egress allowlists", "off", fix, essential=False)
        checks.append(egress)
    if no_engine:
        checks.append(Check("sessions", "off", "need Docker (engine=false)", essential=False))
    elif info.quotas_enforced:
        checks.append(Check("session quotas", "ok", "workspaces have a real size cap"))
    else:
        detail = (
            "needs root and mkfs.ext4 (e2fsprogs): workspaces get no quota"
            if info.name in ("docker", "oci")
            else f"the {info.name} backend's workspaces have no size cap"
        )
        checks.append(Check("session quotas", "off", detail, essential=False))
    checks.append(_leftovers(root))
    image = root.image
    have_image = root.backend.has_image(image)
    if have_image:
        checks.append(Check("runtime image", "ok", image))
    else:
        how = "sandloop images build --no-docker" if no_engine else "sandloop images build"
        checks.append(Check("runtime image", "missing", f"{image}: build it with `{how}`"))
    if smoke and have_image:
        for rt in ("runc", "runsc"):
            if rt not in info.runtimes:
                continue
            try:
                r = root.run_code("print(1)", limits=SandboxLimits(runtime=rt), timeout_seconds=60)
                good = r.ok and r.stdout == "1\n"
                detail = f"{r.duration_seconds * 1000:.0f} ms; exit {r.exit_code} {r.stderr[-200:]}"
                checks.append(Check(f"run on {rt}", "ok" if good else "failed", detail))
            except SandboxError as exc:
                checks.append(Check(f"run on {rt}", "failed", str(exc)))
    return checks


def _leftovers(root: Sandloop) -> Check:
    """Sandboxes the engine already failed to remove (any process's): found here, fixed by hand."""
    from sandloop.pool.reaper import STUCK_ADVICE

    try:
        stuck = [item for item in root.backend.owned() if item.stuck]
    except SandboxError as exc:
        return Check("leftovers", "failed", f"could not list sandloop's sandboxes: {exc}", essential=False)
    if not stuck:
        return Check("leftovers", "ok", "no sandbox the engine failed to remove", essential=False)
    ids = ", ".join(f"{item.id[:12]} ({item.stuck})" for item in stuck[:5])
    more = f" and {len(stuck) - 5} more" if len(stuck) > 5 else ""
    detail = f"{len(stuck)} sandbox(es) the engine failed to remove: {ids}{more}; {STUCK_ADVICE}"
    return Check("leftovers", "failed", detail, essential=False)


def healthy(checks: list[Check]) -> bool:
    return all(c.status == "ok" for c in checks if c.essential)
