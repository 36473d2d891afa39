"""What every command shares: the typer apps, the consoles, exit codes, and how a program and a
result cross the command line (one rule for FILE / stdin / ``-c CODE``)."""

from __future__ import annotations

import json
import os
import shlex
import stat
import sys
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape

from sandloop.contract import (
    ExecutionResult,
    InvalidArgument,
    SandboxError,
    SessionNotFound,
    TemplateNotFound,
    UnknownLanguage,
    WorkspaceFileNotFound,
)
from sandloop.contract.limits import parse_size
from sandloop.notes import sandbox_notes

EXIT_NOT_FOUND = 1
#: The program succeeded but the sandbox cut its output at --output-limit: the data is not whole.
EXIT_TRUNCATED = 123
EXIT_TIMEOUT = 124
EXIT_SANDBOX = 125

app = typer.Typer(
    name="sandloop",
    help="Run LLM-written code in throwaway, hardened containers.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    # Click's plain help: Rich's boxed panels cut option names at 80 columns ("--official-provide…")
    # and when piped; plain help wraps the descriptions and never cuts a name.
    rich_markup_mode=None,
)
images_app = typer.Typer(
    help="Build and inspect the runtime images (offline: no registry needed).", no_args_is_help=True
)
app.add_typer(images_app, name="images")
session_app = typer.Typer(
    help="Sessions: a persistent /workspace and a stateful Python interpreter.", no_args_is_help=True
)
app.add_typer(session_app, name="session")
tokens_app = typer.Typer(help="Bearer tokens for `sandloop serve` (stored hashed).", no_args_is_help=True)
app.add_typer(tokens_app, name="tokens")
templates_app = typer.Typer(
    help="Templates: your own images built on the runtime image (offline, sandboxed, cached per step).",
    no_args_is_help=True,
)
app.add_typer(templates_app, name="templates")
cluster_app = typer.Typer(help="A Ray cluster of sandbox nodes (SANDLOOP_BACKEND=ray).", no_args_is_help=True)
app.add_typer(cluster_app, name="cluster")

err = Console(stderr=True, highlight=False)
out = Console(highlight=False)


def _fail(message: str, code: int = EXIT_SANDBOX) -> typer.Exit:
    err.print(f"[bold red]sandloop:[/] {escape(message)}", markup=True, soft_wrap=True)
    return typer.Exit(code)


#: The option that sets each parameter and limit, so that an error names what the user typed.
FLAGS = {
    "timeout_seconds": "--timeout",
    "memory": "--memory",
    "cpus": "--cpus",
    "runtime": "--runtime",
    "network": "--network",
    "egress": "--allow",
    "output_limit": "--output-limit",
}


def error_text(exc: SandboxError, flags: dict[str, str] = FLAGS) -> str:
    """The error in the command line's words: each bad value by the option that set it."""
    problems = getattr(exc, "problems", ())
    if problems:
        return "; ".join(f"{flags.get(field, field)}: {why}" for field, why in problems)
    return str(exc)


def exit_code_for(exc: SandboxError) -> int:
    """2 for what the caller must fix (like a bad option), 1 for something that is not there
    (a session, a file), 125 for the sandbox itself failing."""
    if isinstance(exc, InvalidArgument | UnknownLanguage):
        return 2
    if isinstance(exc, SessionNotFound | WorkspaceFileNotFound | TemplateNotFound):
        return EXIT_NOT_FOUND
    return EXIT_SANDBOX


def _fail_for(exc: SandboxError) -> typer.Exit:
    return _fail(error_text(exc), exit_code_for(exc))


_EXTENSIONS = {".py": "python", ".js": "node", ".mjs": "node", ".cjs": "node", ".sh": "bash", ".bash": "bash"}


def _program(file: Path | None, code: str | None, language: str | None) -> tuple[str, str, bool]:
    """One rule for every command that takes a program (`run`, `session run`, `session cell`):
    `-c CODE` is inline code; otherwise FILE is read, and '-' or no FILE reads the program from
    stdin. Returns (code, language, whether stdin was used for the program)."""
    if code is not None:
        if file is not None:
            raise _fail("give a FILE or -c CODE, not both", 2)
        return code, language or "python", False
    if file is None or str(file) == "-":
        if sys.stdin.isatty():  # otherwise it would look like a hang
            err.print(
                "[dim]sandloop: reading the program from stdin; end it with Ctrl-D (or give a FILE, or -c CODE)[/]",
                soft_wrap=True,
            )
        return sys.stdin.read(), language or "python", True
    if not file.exists():
        name = str(file)
        looks_like_code = not file.suffix and any(c in name for c in " ()=;'\"")
        hint = f"; to run inline code, use -c {shlex.quote(name)}" if looks_like_code else ""
        raise _fail(f"no such file: {name}{hint}", 2)
    if not file.is_file():
        raise _fail(f"cannot run {file}: not a file (give a program file, '-' for stdin, or -c CODE)", 2)
    try:
        text = file.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise _fail(f"cannot read program {file}: {getattr(exc, 'strerror', None) or exc}", 2) from None
    return text, language or _EXTENSIONS.get(file.suffix.lower()) or "python", False


def _program_stdin(input_file: Path | None, stdin_taken: bool) -> bytes | None:
    """The program's stdin: --stdin FILE, else what is piped or redirected into us (never a
    terminal), unless the program itself came from stdin."""
    if input_file is not None:
        try:
            return input_file.read_bytes()
        except OSError as exc:
            raise _fail(f"cannot read {input_file}: {exc.strerror}", 2) from None
    if stdin_taken:
        return None
    try:
        mode = os.fstat(sys.stdin.fileno()).st_mode
    except (OSError, ValueError, AttributeError):
        return None
    if stat.S_ISFIFO(mode) or stat.S_ISREG(mode):
        return sys.stdin.buffer.read()
    return None


_CODE_OPTION = typer.Option("-c", "--code", help="Inline code instead of a FILE (as python -c).")
_OUTPUT_LIMIT_OPTION = typer.Option(
    "--output-limit",
    help="Bytes of stdout and of stderr kept (default 64k, at most 64m); past it the rest is dropped, "
    "sandloop says so and exits 123 if the program succeeded.",
)


def _exit_for(result: ExecutionResult) -> typer.Exit:
    """The program's exit code; 124 when the sandbox killed it for time; 123 when it succeeded but
    its output was cut (a pipeline must not take part of the output for all of it)."""
    if result.timed_out:
        return typer.Exit(EXIT_TIMEOUT)
    if result.exit_code == 0 and (result.stdout_truncated or result.stderr_truncated):
        return typer.Exit(EXIT_TRUNCATED)
    return typer.Exit(result.exit_code if 0 <= result.exit_code <= 255 else 1)


def output_limit_bytes(value: str | None) -> int | None:
    """``--output-limit 1m`` as bytes (None: the default)."""
    if value is None:
        return None
    try:
        return parse_size(value)
    except ValueError as exc:
        raise _fail(f"--output-limit: {exc}", 2) from None


class Streamer:
    """Writes a program's output to our stdout and stderr as it arrives (``on_output``), and
    remembers whether the terminal's last line was left open (so a note starts on a line of its own)."""

    def __init__(self) -> None:
        self.wrote = False
        self._open_line = {"stdout": False, "stderr": False}

    def __call__(self, stream: str, data: bytes) -> None:
        target = sys.stdout if stream == "stdout" else sys.stderr
        target.buffer.write(data)
        target.flush()
        self.wrote = True
        if data:
            self._open_line[stream] = not data.endswith(b"\n")

    def end_line(self) -> None:
        """Close an unfinished line before sandloop's own notes (on a terminal they share a screen)."""
        if self._open_line["stderr"] or (self._open_line["stdout"] and sys.stdout.isatty() and sys.stderr.isatty()):
            sys.stderr.write("\n")
            sys.stderr.flush()


def _print_result(result: ExecutionResult, as_json: bool, streamed: Streamer | None = None) -> None:
    """The program's streams to ours (unless ``streamed`` already wrote them as they came), or the
    whole result as JSON; the sandbox's notes on stderr."""
    from sandloop.present import result_json, stream_bytes

    if as_json:
        body = result_json(result)
        body.pop("artifacts", None)  # saved as files by `session cell`, not printed
        print(json.dumps(body, indent=2))
        return
    if streamed is None:
        streamed = Streamer()
        streamed("stdout", stream_bytes(result, "stdout"))
        streamed("stderr", stream_bytes(result, "stderr"))
    notes = [n for n in sandbox_notes(result) if not n.startswith("the program ran and printed nothing")]
    if notes or result.egress:
        streamed.end_line()
    for note in notes:
        if "truncated" in note:
            note += " Raise the cap with --output-limit (up to 64m), or write the output to a file."
        err.print(f"[yellow]sandloop:[/] {escape(note)}", soft_wrap=True)
    for attempt in result.egress[:20]:  # what the program reached, or tried to
        verdict = "[green]allowed[/]" if attempt.allowed else "[red]refused[/]"
        note = f" - {escape(attempt.note)}" if attempt.note else ""
        err.print(
            f"[dim]sandloop egress:[/] {verdict} {attempt.method} {escape(attempt.host)}:{attempt.port} "
            f"({attempt.bytes_out} B out, {attempt.bytes_in} B in){note}",
            soft_wrap=True,
            markup=True,
            highlight=False,
        )
    if len(result.egress) > 20:
        err.print(f"[dim]sandloop egress:[/] {len(result.egress) - 20} more (--json lists them all)")


SECRET_HELP = (
    "NAME=ENVVAR@host[,host][;header=NAME][;plain-http]: the program sees a placeholder in $NAME; the "
    "egress proxy sends the value of your $ENVVAR in its place only in the Authorization header (or the "
    "one named) of HTTPS requests to those hosts (which --allow must list). Repeatable."
)


def parse_secrets(specs: list[str] | None) -> dict[str, Any]:
    """``--secret NAME=ENVVAR@host[,host]`` options as ``Secret``s, the values read from this
    process's environment (never from the command line, where ps would show them)."""
    from sandloop.contract.egress import Secret

    out: dict[str, Any] = {}
    for spec in specs or []:
        name, eq, rest = spec.partition("=")
        envvar, at, rest = rest.partition("@")
        hosts, *options = rest.split(";")
        if not (name and eq and envvar and at and hosts):
            raise _fail(
                f"--secret {spec!r}: write NAME=ENVVAR@host[,host], e.g. GITHUB_TOKEN=GH_TOKEN@api.github.com", 2
            )
        headers = [o.removeprefix("header=") for o in options if o.startswith("header=")]
        plain_http = "plain-http" in options
        unknown = [o for o in options if not o.startswith("header=") and o != "plain-http"]
        if unknown:
            raise _fail(f"--secret {name}: unknown option {unknown[0]!r} (header=NAME or plain-http)", 2)
        value = os.environ.get(envvar)
        if not value:
            raise _fail(f"--secret {name}: the environment variable {envvar} is not set (export it first)", 2)
        try:
            out[name] = Secret(
                value,
                hosts=[h for h in hosts.split(",") if h],
                **({"headers": headers} if headers else {}),
                plain_http=plain_http,
            )
        except SandboxError as exc:
            raise _fail(f"--secret {name}: {exc}", 2) from None
    return out
