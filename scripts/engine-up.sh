#!/usr/bin/env bash
# Bring up a Docker engine for sandloop. Idempotent: safe to run any number of times.
#
# - If `docker info` already answers, nothing is touched (a user who has Docker keeps theirs).
# - Otherwise, as root on Debian: install the engine and gVisor from Debian's packages, register
#   runsc as a runtime, and start dockerd in the background, logging to $SANDLOOP_DOCKERD_LOG.
# - Where that is impossible (not root, no apt), print what the user must do and exit 1.
set -euo pipefail

LOG="${SANDLOOP_DOCKERD_LOG:-/var/log/sandloop-dockerd.log}"
DAEMON_JSON=/etc/docker/daemon.json
PIDFILE=/var/run/docker.pid

say() { printf 'engine-up: %s\n' "$*" >&2; }

engine_answers() { timeout 10 docker info >/dev/null 2>&1; }

runsc_registered() { timeout 10 docker info --format '{{json .Runtimes}}' 2>/dev/null | grep -q '"runsc"'; }

# Register gVisor. --network=none is required: this runsc refuses `--network none` containers
# ("cannot run with network enabled in root network namespace") without it. Not --oci-seccomp:
# with it this runsc applies Docker's profile inside the sandbox, where clone3's ENOSYS turns
# into EPERM and every new thread fails (Node aborts, Python cannot start threads); gVisor's own
# syscall implementation is the boundary there. A daemon.json this script wrote (marked by the
# platform flag) is brought up to date; anyone else's is left alone.
# runsc-egress is the same plus --host-uds=open, for sandboxes with an egress allowlist: still no
# network, but the sandbox may connect to host Unix sockets mounted into it (only its egress
# proxy's is: see src/sandloop/runtime/egress/proxy.py).
RUNSC_ARGS='["--platform=ptrace", "--network=none"]'
RUNSC_EGRESS_ARGS='["--platform=ptrace", "--network=none", "--host-uds=open"]'
configure_runsc() {  # $1 = "upgrade-only": never create a config for an engine we did not start
    command -v runsc >/dev/null 2>&1 || return 0
    [ -w /etc ] || return 0
    mkdir -p /etc/docker
    local desired
    desired="$(printf '{\n  "runtimes": {\n    "runsc": {"path": "%s", "runtimeArgs": %s},\n    "runsc-egress": {"path": "%s", "runtimeArgs": %s}\n  }\n}' \
        "$(command -v runsc)" "$RUNSC_ARGS" "$(command -v runsc)" "$RUNSC_EGRESS_ARGS")"
    if { [ ! -s "$DAEMON_JSON" ] && [ "${1:-}" != upgrade-only ]; } \
        || { [ -s "$DAEMON_JSON" ] && grep -q '"--platform=ptrace"' "$DAEMON_JSON" && [ "$(cat "$DAEMON_JSON")" != "$desired" ]; }; then
        printf '%s\n' "$desired" > "$DAEMON_JSON"
        say "registered runsc in $DAEMON_JSON"
        # a running daemon reloads its runtimes on SIGHUP
        if pgrep -x dockerd >/dev/null 2>&1; then pkill -HUP -x dockerd || true; sleep 1; fi
    elif ! grep -q runsc "$DAEMON_JSON"; then
        say "$DAEMON_JSON exists and has no runsc runtime; leaving it alone (runsc tests will skip)"
    fi
}

if engine_answers; then
    configure_runsc upgrade-only
    if runsc_registered; then
        say "Docker engine already running (runsc registered); nothing to do."
    else
        say "Docker engine already running; gVisor (runsc) is not registered, runsc tests will skip."
        say "To add it: install runsc and add a \"runsc\" runtime with runtimeArgs [\"--network=none\"] to $DAEMON_JSON."
    fi
    exit 0
fi

if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    cat >&2 <<MSG
engine-up: no Docker engine answers and this script can only install one as root on Debian.
Do one of:
  - install Docker (https://docs.docker.com/engine/install/) and start it, then add your user to
    the 'docker' group (or export DOCKER_HOST to a reachable engine);
  - or re-run this script as root on Debian/Ubuntu: sudo $0
Then check with: docker info
MSG
    exit 1
fi

need=()
command -v dockerd >/dev/null 2>&1 || need+=(docker.io)
command -v runsc >/dev/null 2>&1 || need+=(runsc)
command -v debootstrap >/dev/null 2>&1 || need+=(debootstrap)
if [ ${#need[@]} -gt 0 ]; then
    say "installing ${need[*]} from Debian's packages"
    apt-get update -q >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${need[@]}" >/dev/null
fi

configure_runsc

start_dockerd() {
    # A pid file left by a daemon that died blocks the next start.
    if [ -f "$PIDFILE" ] && ! kill -0 "$(cat "$PIDFILE" 2>/dev/null)" 2>/dev/null; then
        say "removing stale $PIDFILE"
        rm -f "$PIDFILE"
    fi
    say "starting dockerd (log: $LOG)"
    # setsid + nohup: the daemon must outlive this script and the shell that ran it.
    setsid nohup dockerd >>"$LOG" 2>&1 </dev/null &
}

# A dockerd that is still shutting down (stopping its containers) answers nothing: wait for it
# to finish, then start a fresh one.
for _ in $(seq 1 120); do
    if engine_answers; then
        say "Docker engine ready"
        exit 0
    fi
    if ! pgrep -x dockerd >/dev/null 2>&1; then
        start_dockerd
    fi
    sleep 0.5
done
say "dockerd did not answer within 60 s; see $LOG"
tail -n 20 "$LOG" >&2 || true
exit 1
