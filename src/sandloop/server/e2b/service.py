"""E2B sandboxes on sandloop sessions: what the control plane, envd and Jupyter routes share.

An E2B sandbox is a session: ``/home/user`` is its workspace (mounted there and at /workspace),
``run_code`` runs in its interpreter, commands run as processes of that interpreter's sandbox
(procs_helper.py), files go through the session's file API (inside a sandbox, confined to the
workspace). Its timeout is absolute, as E2B's is: each call checks it, the control plane's calls
remove every sandbox past it, and the session's own idle TTL (the timeout plus a minute) removes
one nobody calls any more.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import hmac
import json
import logging
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from importlib import resources
from typing import TYPE_CHECKING, Any

from sandloop.contract import SandboxError, SessionDamaged, SessionNotFound, SessionNotPaused
from sandloop.server.e2b.registry import E2BSandbox, Registry
from sandloop.server.tokens import Token

if TYPE_CHECKING:
    from sandloop.server.context import Api
    from sandloop.sessions import Session
    from sandloop.sessions.watch import Watcher

HOME = "/home/user"
WORKSPACE = "/workspace"
#: What envd version the sandboxes report: it switches the SDKs' features (default user, stdin,
#: octet-stream uploads, 0.6.2's file metadata, 0.6.3's entries in watch events, 0.6.4's
#: allow_network_mounts on a watch).
ENVD_VERSION = "0.6.4"
#: Template names that mean "the runtime image": sandloop serves one image.
TEMPLATES = ("base", "code-interpreter-v1", "code-interpreter", "sandloop")
MAX_TIMEOUT = 24 * 3600
#: The session outlives its E2B timeout by this much, so the E2B layer (not the idle reaper)
#: decides when it ends; the idle reaper still removes one that nobody calls.
TTL_MARGIN = 60.0
#: Seconds between two sweeps for sandboxes past their timeout (started with the first sandbox).
REAP_EVERY = 5.0
#: Longest a request for a sandbox being killed waits for the kill before its 404.
KILL_WAIT_SECONDS = 30.0
#: Process streams (Start/Connect) open at once on one sandbox; each polls its interpreter.
MAX_STREAMS = 16
#: Output kept per stream of a cell: the process table's answers (a poll returns up to 512 KiB,
#: in base64) and run_code's output.
PROCS_OUTPUT = 4 * 1024 * 1024
CODE_OUTPUT = 1024 * 1024
_PROCS = resources.files("sandloop.server.e2b").joinpath("procs_helper.py").read_text()
_MARK = "\x1esandloop-procs:"
log = logging.getLogger(__name__)


class E2BError(Exception):
    """An error of E2B's control plane and envd HTTP API: ``{"code": status, "message"}``."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


def workspace_path(path: str) -> str:
    """A path as E2B's SDK sends it (absolute under /home/user, or relative to it) as a path
    relative to the workspace; anything else is refused (sandloop's files are the workspace)."""
    if not isinstance(path, str) or not path:
        raise E2BError(400, "a path is required")
    p = path.strip()
    for base in (HOME, WORKSPACE):
        if p == base or p.startswith(base + "/"):
            return p[len(base) :].lstrip("/") or "."
    if p.startswith("~/") or p == "~":
        return p[1:].lstrip("/") or "."
    if p.startswith("/"):
        raise E2BError(
            400,
            f"path {path!r} is outside {HOME}: a sandloop sandbox's files are its workspace, {HOME} "
            "(commands can still use /tmp)",
        )
    return p


def sandbox_path(rel: str) -> str:
    return HOME if rel in ("", ".") else f"{HOME}/{rel.lstrip('/')}"


def command_cwd(cwd: str | None) -> str:
    """A command's working directory: /home/user (the workspace is mounted there too) unless
    the caller names another; ``~`` and relative paths are under /home/user."""
    if not cwd:
        return HOME
    if cwd == "~" or cwd.startswith("~/"):
        return HOME + cwd[1:]
    return cwd if cwd.startswith("/") else f"{HOME}/{cwd}"


#: How long one poll of a sandbox's processes waits inside for output before answering, and the
#: pause between two polls (so run_code and other calls get the interpreter in between).
POLL_WAIT, POLL_GAP = 0.25, 0.02


class Follower:
    """Follows a sandbox's processes for their streams: one thread polls all the followed
    processes in one cell, however many streams are open, and hands each reply to the streams of
    its process. It ends when nobody follows anything."""

    def __init__(self, e2b: E2B, sandbox_id: str) -> None:
        self.e2b, self.sandbox_id = e2b, sandbox_id
        self._subs: dict[int, list[Callable[[dict[str, Any]], None]]] = {}
        self._lock = threading.Lock()
        self._running = False

    def follow(self, pid: int, deliver: Callable[[dict[str, Any]], None]) -> Callable[[], None]:
        """``deliver(reply)`` gets each poll's reply for ``pid`` until one ends it (``exit_code``
        or ``error``); returns the function that stops following."""
        with self._lock:
            self._subs.setdefault(pid, []).append(deliver)
            start = not self._running
            self._running = True
        if start:
            threading.Thread(target=self._loop, name=f"sandloop-e2b-follow-{self.sandbox_id}", daemon=True).start()

        def unfollow() -> None:
            with self._lock:
                subs = self._subs.get(pid, [])
                if deliver in subs:
                    subs.remove(deliver)
                if not subs:
                    self._subs.pop(pid, None)

        return unfollow

    def _loop(self) -> None:
        while True:
            with self._lock:
                pids = list(self._subs)
                if not pids:
                    self._running = False
                    return
            try:
                reply = self.e2b.procs(self.sandbox_id, {"op": "poll", "pids": pids, "wait": POLL_WAIT})
                replies = reply.get("replies") or {}
                if "error" in reply:
                    replies = {str(pid): reply for pid in pids}
            except Exception as exc:  # noqa: BLE001 - every stream ends with it
                replies = {str(pid): {"error": str(exc), "kind": "internal"} for pid in pids}
            for key, r in replies.items():
                with self._lock:
                    subs = list(self._subs.get(int(key), []))
                    if "exit_code" in r or "error" in r:
                        self._subs.pop(int(key), None)
                for deliver in subs:
                    deliver(r)
            time.sleep(POLL_GAP)


#: Seconds a sandbox resumed by its traffic (``autoResume``) has before it times out again.
DEFAULT_RESUME_TIMEOUT = 300


class E2B:
    def __init__(self, api: Api, registry: Registry, preview_domain: str = "localhost") -> None:
        self.api, self.registry = api, registry
        #: Preview URLs' domain (server/preview.py): ``<port>-<sandbox id>.<domain>``.
        self.preview_domain = preview_domain
        #: Its sandboxes' terminals (``sandbox.pty``: envd_pty.Ptys), set when envd's routes are
        #: mounted (envd_pty.py is above this module: it speaks envd's shapes).
        self.ptys: Any = None
        #: The template build API's state (templates.py), set when the routes are mounted.
        self.templates: Any = None
        self._sessions: dict[str, Session] = {}
        self._killing: set[str] = set()  # sandboxes being removed: gone to every caller
        self._streams: dict[str, int] = {}
        self._followers: dict[str, Follower] = {}
        self._watchers: dict[str, tuple[str, Watcher]] = {}  # watcher id -> (sandbox, watcher)
        self._lock = threading.Lock()
        self._killed = threading.Condition(self._lock)  # a kill finished
        self._stop = threading.Event()
        self._reaper: threading.Thread | None = None
        # Per sandbox: its timeout's decision (pause or kill) and what moves its timeout (resume,
        # set_timeout) one at a time, so the reaper cannot pause a sandbox a connect resumed and
        # extended while the reaper looked at its old timeout.
        self._lifecycles: dict[str, threading.RLock] = {}

    def _lifecycle(self, sandbox_id: str) -> threading.RLock:
        with self._lock:
            return self._lifecycles.setdefault(sandbox_id, threading.RLock())

    def domain_for(self, host: str) -> str:
        """The ``domain`` a sandbox's JSON carries for a request that came to ``host``: the preview
        domain with that host's port, so the SDK's ``get_host(port)`` names this server."""
        _, sep, port = host.rpartition(":")
        return f"{self.preview_domain}:{port}" if sep and port.isdigit() else self.preview_domain

    # -- lifetime --------------------------------------------------------------------------------
    def session(self, sandbox_id: str) -> Session:
        """This process's handle on the sandbox's session (attached once, kept)."""
        with self._lock:
            s = self._sessions.get(sandbox_id)
        if s is None:
            try:
                s = self.api.root.attach_session(sandbox_id, resume=False)  # paused: see ``live``
            except SessionNotFound:
                self.forget(sandbox_id)
                raise E2BError(404, f"sandbox {sandbox_id} not found (it was killed or timed out)") from None
            s.default_cwd = HOME  # E2B's code contexts start in /home/user
            with self._lock:
                s = self._sessions.setdefault(sandbox_id, s)
        return s

    def forget(self, sandbox_id: str) -> None:
        if self.ptys is not None:
            self.ptys.forget(sandbox_id)
        with self._lock:
            s = self._sessions.pop(sandbox_id, None)
            self._followers.pop(sandbox_id, None)
            self._lifecycles.pop(sandbox_id, None)
            for wid in [w for w, (sid, _) in self._watchers.items() if sid == sandbox_id]:
                self._watchers.pop(wid)[1].close()
        if s is not None:
            s.close()
        self.registry.remove(sandbox_id)
        self.api.tokens.disown(sandbox_id)

    def kill(self, sandbox_id: str) -> None:
        """Remove everything: interpreter, processes, workspace, records. From the first step the
        sandbox counts as gone (``live``), so a stream it breaks says so rather than reporting an
        interpreter that "was restarted"."""
        try:
            s = self.session(sandbox_id)
        except E2BError:
            return  # the session is gone already; forget() removed the rest
        except SessionDamaged:  # its record cannot be read: removed all the same
            self.api.root.sessions.delete(sandbox_id)
            self.forget(sandbox_id)
            return
        with self._lock:
            self._killing.add(sandbox_id)
        try:
            s.delete()
        finally:
            self.forget(sandbox_id)
            with self._lock:
                self._killing.discard(sandbox_id)
                self._killed.notify_all()

    def reap(self) -> None:
        for sandbox_id in self.registry.expired():
            self.timed_out(sandbox_id)

    def paused(self, sandbox_id: str) -> str | None:
        try:
            return self.api.root.sessions.paused(sandbox_id)
        except SessionNotFound:  # not a session's id, or its node is gone (SessionLost): not paused
            return None

    def timed_out(self, sandbox_id: str) -> bool:
        """At its timeout a sandbox is killed, or paused when it asked to be (E2B's
        ``lifecycle.on_timeout="pause"``); a paused one waits, as E2B's do. True: it is gone.
        Its timeout is read again under its lifecycle lock: a connect or ``set_timeout`` since the
        caller looked has moved it, and the sandbox goes on."""
        with self._lifecycle(sandbox_id):
            box = self.registry.get(sandbox_id)
            if box is not None and box.end_at >= time.time():
                return False
            if self.paused(sandbox_id):
                return False
            on_timeout = self.registry.lifecycle(sandbox_id)[0]
            if on_timeout in ("pause", "pause-files"):
                try:
                    kind = self.pause(sandbox_id, keep_memory=on_timeout == "pause")
                    if on_timeout == "pause" and kind == "files":  # its interpreter was not running
                        log.warning("timed-out sandbox %s paused with its files only: no interpreter ran", sandbox_id)
                    return False
                except SessionNotPaused:  # another thread (the reaper, a request) paused it first
                    return False
                except Exception:  # noqa: BLE001 - a sandbox that cannot pause ends as any other
                    log.warning("could not pause timed-out sandbox %s: killing it", sandbox_id, exc_info=True)
            self.kill(sandbox_id)
            return True

    def pause(self, sandbox_id: str, *, keep_memory: bool = True) -> str:
        with self._lifecycle(sandbox_id):
            s = self.session(sandbox_id)
            kind = s.pause(keep_memory=keep_memory)
            # Paused, it waits for its connect (or its traffic, with auto-resume), as E2B's do, up
            # to the server's paused_retention_seconds: not its session's TTL (its timeout plus a
            # minute), which would remove it a minute after its timeout. A resume sets the TTL
            # again (set_timeout); its key's revocation removes it (server/reaper.py).
            s.record.ttl_seconds = self.api.root.sessions.paused_retention
            self.api.root.sessions.save(s.record)
        if self.ptys is not None:
            self.ptys.forget(sandbox_id)  # its terminals went with its interpreter
        with self._lock:
            self._followers.pop(sandbox_id, None)  # its processes' output ends here
        return kind

    def resume(self, sandbox_id: str, timeout: float) -> str:
        """Resume a paused sandbox with a new timeout (E2B's connect and resume)."""
        with self._lifecycle(sandbox_id):
            kind = self.session(sandbox_id).resume()
            box = self.registry.get(sandbox_id)
            if box is not None:
                self.set_timeout(box, timeout)
            return kind

    def start_reaper(self) -> None:
        """Sweep for timed-out sandboxes every few seconds until ``stop()`` (server shutdown)."""
        with self._lock:
            if self._reaper is not None or self._stop.is_set():
                return
            self._reaper = threading.Thread(target=self._reap_loop, name="sandloop-e2b-reaper", daemon=True)
        self._reaper.start()

    def _reap_loop(self) -> None:
        while not self._stop.wait(REAP_EVERY):
            try:
                self.reap()
            except Exception:  # noqa: BLE001 - an engine hiccup must not end the sweeps
                log.warning("sweeping timed-out E2B sandboxes failed", exc_info=True)

    def stop(self) -> None:
        self._stop.set()
        if self._reaper is not None:
            self._reaper.join(30)

    def follow(self, sandbox_id: str, pid: int, deliver: Callable[[dict[str, Any]], None]) -> Callable[[], None]:
        with self._lock:
            follower = self._followers.setdefault(sandbox_id, Follower(self, sandbox_id))
        return follower.follow(pid, deliver)

    def check_stream_room(self, sandbox_id: str) -> None:
        with self._lock:
            if self._streams.get(sandbox_id, 0) >= MAX_STREAMS:
                raise E2BError(
                    429, f"{MAX_STREAMS} process streams are open on sandbox {sandbox_id}; wait for one to end"
                )

    @contextlib.contextmanager
    def stream_slot(self, sandbox_id: str) -> Iterator[None]:
        """One of the sandbox's ``MAX_STREAMS`` process streams, for as long as the block runs."""
        self.check_stream_room(sandbox_id)
        with self._lock:
            self._streams[sandbox_id] = self._streams.get(sandbox_id, 0) + 1
        try:
            yield
        finally:
            with self._lock:
                self._streams[sandbox_id] -= 1
                if not self._streams[sandbox_id]:
                    del self._streams[sandbox_id]

    def gone(self, sandbox_id: str) -> bool:
        """Killed, or being killed (a stream it broke must say so, not report an error)."""
        with self._lock:
            if sandbox_id in self._killing:
                return True
        return self.registry.get(sandbox_id) is None

    def live(self, box: E2BSandbox | None, sandbox_id: str, *, wait: bool = False) -> E2BSandbox:
        """The sandbox, or 404 when it is gone. ``wait`` (control-plane calls, on a worker thread,
        never the event loop): a sandbox being killed answers 404 once its kill is done."""
        with self._lock:
            killing = sandbox_id in self._killing
            if killing and wait:  # a 404 means its resources are gone: wait for the kill under way
                self._killed.wait_for(lambda: sandbox_id not in self._killing, KILL_WAIT_SECONDS)
        if box is None or killing:
            raise E2BError(404, f"sandbox {sandbox_id} not found")
        if box.end_at < time.time() and self.timed_out(sandbox_id):
            raise E2BError(404, f"sandbox {sandbox_id} not found: it timed out and was removed")
        try:
            self.api.root.sessions.load(sandbox_id)  # deleted through the native API, or idle-reaped?
        except SessionNotFound:
            self.forget(sandbox_id)
            raise E2BError(404, f"sandbox {sandbox_id} not found (its session was deleted)") from None
        except SessionDamaged:  # there, unreadable: each call that needs the record says so; kill works
            pass
        return box

    def mine(self, token: Token, sandbox_id: str) -> E2BSandbox:
        """One of the key's sandboxes; someone else's and a missing one look the same (404)."""
        box = self.registry.get(sandbox_id)
        if box is not None and box.token_id != token.id:
            box = None
        return self.live(box, sandbox_id, wait=True)

    def for_traffic(self, sandbox_id: str) -> tuple[E2BSandbox, Token]:
        """The sandbox an envd or Jupyter call names (``RequestGuard`` checked its access token
        from the headers), and the key it counts against."""
        box = self.live(self.registry.get(sandbox_id), sandbox_id)
        token = self.api.tokens.get(box.token_id)
        if token is None:
            raise E2BError(401, "the key that made this sandbox was revoked")
        if self.paused(sandbox_id):
            if not self.registry.lifecycle(sandbox_id)[1]:  # as E2B's proxy answers a paused sandbox
                raise E2BError(502, f"The sandbox {sandbox_id} was not found: it is paused; connect to resume it")
            self.resume(sandbox_id, max(box.end_at - time.time(), DEFAULT_RESUME_TIMEOUT))
            box = self.live(self.registry.get(sandbox_id), sandbox_id)
        return box, token

    def set_timeout(self, box: E2BSandbox, seconds: float) -> None:
        with self._lifecycle(box.sandbox_id):
            s = self.session(box.sandbox_id)
            record = s.record
            record.ttl_seconds = float(seconds) + TTL_MARGIN
            record.last_used = time.time()
            self.api.root.sessions.save(record)
            self.registry.set_end(box.sandbox_id, time.time() + seconds)

    # -- signed file URLs (the SDK's download_url / upload_url, envd's validateSigning) ----------
    def signed(self, sandbox_id: str | None, operation: str, query: dict[str, str]) -> str:
        """The sandbox whose access token signed this ``/files`` URL; ``E2BError(401)`` says why
        not. The URL names no sandbox (the SDK's sandbox URL is one for all): the signature does, checked
        against each live sandbox's token in constant time. As envd: ``v1_`` + base64 of
        sha256("path:operation:user:token[:expiration]"); past its expiration it is refused."""
        path, user, signature = query.get("path", ""), query.get("username", ""), query.get("signature", "")
        raw_exp = query.get("signature_expiration")
        if raw_exp is not None and not raw_exp.lstrip("-").isdigit():
            raise E2BError(401, "signature_expiration must be a Unix time in seconds")
        if user not in ("", "user"):
            raise E2BError(401, f"no user {user!r} here: the only user is 'user'")
        candidates = [sandbox_id] if sandbox_id else self.registry.ids()
        match = None
        for sid in candidates:
            token = self.registry.access_token(sid, "envd")
            raw = ":".join([path, operation, user, token] + ([raw_exp] if raw_exp is not None else []))
            digest = base64.b64encode(hashlib.sha256(raw.encode()).digest()).rstrip(b"=").decode()
            if hmac.compare_digest(f"v1_{digest}", signature):
                match = sid
        if match is None:
            raise E2BError(401, "invalid signature")
        if raw_exp is not None and int(raw_exp) < time.time():
            raise E2BError(401, "signature is already expired")
        return match

    # -- file watchers (envd's CreateWatcher / GetWatcherEvents / RemoveWatcher) ------------------
    def add_watcher(self, sandbox_id: str, watcher: Watcher) -> str:
        watcher_id = "w" + secrets.token_hex(8)
        with self._lock:
            self._watchers[watcher_id] = (sandbox_id, watcher)
        return watcher_id

    def watcher(self, sandbox_id: str, watcher_id: str, *, remove: bool = False) -> Watcher:
        """The sandbox's watcher of that id (another sandbox's is not found, as a missing one)."""
        with self._lock:
            found = self._watchers.get(watcher_id)
            if found is None or found[0] != sandbox_id:
                raise E2BError(404, f"watcher with id {watcher_id} not found")
            if remove:
                del self._watchers[watcher_id]
        return found[1]

    # -- processes -------------------------------------------------------------------------------
    def procs(self, sandbox_id: str, args: dict[str, Any], timeout: float = 15.0) -> dict[str, Any]:
        """One operation on the sandbox's process table, run as a cell in its interpreter (in a
        namespace of its own: the user's globals never see it)."""
        encoded = json.dumps(args)
        namespace = f"{{'__name__': '_sandloop_procs_cell', 'ARGS': __import__('json').loads({encoded!r})}}"
        cell = f"exec({_PROCS!r}, {namespace})"
        result = self.session(sandbox_id).run_cell(cell, timeout, output_limit=PROCS_OUTPUT, detach=True)
        at = result.stdout.rfind(_MARK)
        if at < 0:
            detail = (result.stderr or result.stdout)[-300:]
            if result.interpreter_restarted:
                why = (
                    f"it reached the sandbox's {result.limits.memory} memory limit"
                    if result.oom_killed
                    else "it was killed or ended"
                )
                raise SandboxError(f"the sandbox's interpreter was restarted ({why}); its processes ended")
            raise SandboxError(f"the sandbox's process table did not answer: {detail}")
        reply: dict[str, Any] = json.loads(result.stdout[at + len(_MARK) :].splitlines()[0])
        return reply
