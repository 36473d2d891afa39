"""Plain-language notes for outcomes the sandbox, not the code, decided.

A kill by the kernel leaves no traceback: without a note, a model (or a person) sees a bare 137
and retries the same thing. Each note says what happened and what to do differently, using the
limits that were actually applied to the run.
"""

from __future__ import annotations

import re

from sandloop.contract import CellResult, ExecutionResult

_FORK_FAILURE = re.compile(
    r"(BlockingIOError: \[Errno 11\]|Resource temporarily unavailable|fork: retry|can't start new thread|"
    r"RuntimeError: can't start new thread|EAGAIN|Cannot fork|pthread_create)",
    re.IGNORECASE,
)
_NETWORK_FAILURE = re.compile(
    r"(Temporary failure in name resolution|Name or service not known|getaddrinfo (ENOTFOUND|EAI_AGAIN)|"
    r"Network is unreachable|ENETUNREACH|Could not resolve host|nodename nor servname)",
    re.IGNORECASE,
)
_READ_ONLY = re.compile(r"(Read-only file system|EROFS)", re.IGNORECASE)
_NO_SPACE = re.compile(r"(No space left on device|ENOSPC)", re.IGNORECASE)
#: coreutils' ls/stat under this gVisor: its statx refuses AT_NO_AUTOMOUNT with EINVAL.
_GVISOR_STATX = re.compile(r"(cannot access '.*': Invalid argument|cannot statx '.*': Invalid argument)")


def _kib(n: int) -> str:
    return f"{n / 1024:.0f} KB" if n < 1024 * 1024 else f"{n / 1024 / 1024:.1f} MB"


def sandbox_notes(result: ExecutionResult) -> list[str]:
    """Notes explaining every way the sandbox shaped this result; empty when it did not."""
    limits = result.limits
    notes: list[str] = []
    restarted = getattr(result, "interpreter_restarted", None)
    if result.timed_out and restarted is False:
        notes.append(
            f"timed out: the cell was interrupted (KeyboardInterrupt) after {result.timeout_seconds:g} s; "
            "the interpreter and its variables are kept. Make the cell faster, split the work over "
            "several cells, or ask for a longer timeout."
        )
    elif result.timed_out and restarted:
        notes.append(
            f"timed out: the cell ran past {result.timeout_seconds:g} s and did not stop when interrupted, "
            "so the interpreter was restarted and its variables are gone. Make the cell faster or "
            "ask for a longer timeout."
        )
    elif result.timed_out:
        notes.append(
            f"timed out: the sandbox killed the program after {result.timeout_seconds:g} s of wall "
            "clock time. Make it faster (less work, smaller inputs, no waiting on input), print "
            "progress as you go, or ask for a longer timeout."
        )
    elif result.oom_killed or result.exit_code == 137:
        cause = (
            f"it exceeded the {limits.memory} memory limit"
            if result.oom_killed
            else f"most likely the {limits.memory} memory limit"
        )
        notes.append(
            f"exit_code: 137 — killed by the sandbox (SIGKILL): {cause}. Process less data at a "
            "time, or stream instead of building the whole result in memory."
        )
    omitted = getattr(result, "value_omitted_chars", 0)
    if omitted:
        notes.append(
            f"value cut: its repr is {omitted:,} characters longer than what is shown. Show a "
            "summary (len(), .head(), .describe()) or slice it."
        )
    for name, truncated, dropped in (
        ("stdout", result.stdout_truncated, result.stdout_dropped_bytes),
        ("stderr", result.stderr_truncated, result.stderr_dropped_bytes),
    ):
        if truncated:
            notes.append(
                f"{name} truncated: kept the first {_kib(limits.output_limit)} and dropped "
                f"{_kib(dropped)}. Print a summary (counts, head/tail, aggregates) instead of everything."
            )
    if _FORK_FAILURE.search(result.stderr):
        notes.append(
            f"could not start a process or thread: the sandbox allows at most {limits.pids} at "
            "once. Use fewer workers or threads, and wait for children to finish."
        )
    refused: dict[str, str] = {}
    for attempt in result.egress:
        if not attempt.allowed:
            refused.setdefault(f"{attempt.host}:{attempt.port}", attempt.note)
    for target, why in list(refused.items())[:5]:
        notes.append(
            f"refused: {why or target}. Only the hosts on this sandbox's allowlist "
            f"({', '.join(limits.egress)}) can be reached, over HTTP(S) through its proxy; use one of "
            "them, or ask for the host to be added."
        )
    if len(refused) > 5:
        notes.append(f"refused: {len(refused) - 5} more destinations (see the result's egress list).")
    if limits.egress and not refused and _NETWORK_FAILURE.search(result.stderr):
        notes.append(
            "network failure: this sandbox reaches only its allowlist "
            f"({', '.join(limits.egress)}), and only over HTTP(S) through the proxy in HTTP_PROXY / "
            "HTTPS_PROXY (no DNS, no direct connections). Use an HTTP client that honours those."
        )
    elif not limits.network and not limits.egress and _NETWORK_FAILURE.search(result.stderr):
        notes.append(
            "network failure: this sandbox has no network (no DNS, no outside connections). "
            "Work with data that is already in the sandbox or passed in the code."
        )
    if _READ_ONLY.search(result.stderr):
        notes.append(
            f"read-only file system: only /tmp (a {limits.tmpfs_size} scratch tmpfs) is writable "
            "here. Write files under /tmp."
        )
    if limits.runtime == "runsc" and _GVISOR_STATX.search(result.stderr):
        notes.append(
            "'Invalid argument' from ls or stat is this gVisor's, not the file's: its statx refuses a "
            'flag coreutils passes. List and inspect files another way (python3 -c "import os; '
            "print(os.listdir('.'))\", find, or Node's fs), or use runtime runc."
        )
    if _NO_SPACE.search(result.stderr):
        notes.append(
            f"no space left: /tmp holds at most {limits.tmpfs_size}. Write less, or delete temporary files as you go."
        )
    # In a session the last expression is shown, so a silent cell is an assignment, an import or
    # a definition: nothing to explain (before, `x = 41` got this note everywhere).
    if result.ok and not result.stdout and not result.stderr and not isinstance(result, CellResult):
        notes.append(
            "the program ran and printed nothing. If you expected a value, print it (print() in "
            "Python, console.log() in Node, echo in bash): a last expression is not shown."
        )
    return notes
