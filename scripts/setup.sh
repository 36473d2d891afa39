#!/usr/bin/env bash
# What a fresh machine needs. Idempotent: re-running it only redoes what is missing or out of date.
#
#   scripts/setup.sh          running (make run): the engine (with gVisor), the venv, the image
#   scripts/setup.sh --dev    the tests too (make test): the above, then the dev extras, Debian's
#                             chromium for the browser tests, the oldest E2B SDKs in their own venv
#
# One progress line per step, with how long it took.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3}"
VENV="${SANDLOOP_VENV:-.venv}"
DEV=0
[ "${1:-}" = "--dev" ] && DEV=1
STEPS=3
[ "$DEV" = 1 ] && STEPS=5

step=0
began=$SECONDS
started=$SECONDS
next() {  # next "what this step does"
    [ "$step" -gt 0 ] && printf 'setup: ... done in %ss\n' "$((SECONDS - started))" >&2
    step=$((step + 1))
    started=$SECONDS
    printf 'setup [%s/%s] %s\n' "$step" "$STEPS" "$*" >&2
}
pip_quiet() { "$@" 2>&1 | grep -v '^WARNING: Location' || true; }
# have COMMAND PACKAGE "what goes without it": Debian's package when the command is missing.
have() {
    command -v "$1" >/dev/null 2>&1 && return 0
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        apt-get update -q >/dev/null
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "$2" >/dev/null
    else
        echo "setup: $1 not found; $3 (apt-get install $2)" >&2
    fi
}

next "Docker engine and gVisor (scripts/engine-up.sh), bubblewrap"
bash scripts/engine-up.sh
# bubblewrap starts runc-class sandboxes at a fraction of runc's cost (runtime/oci/bwrap.py).
have bwrap bubblewrap "runc-class sandboxes start with runc"
# The C starter (runtime/oci/starter.c) is compiled on first use: the whole start in one program.
have cc gcc "bubblewrap starts runc-class sandboxes instead of the C starter"

# The oldest E2B SDKs sandloop's E2B-compatible API supports, in a venv of their own (the tests
# drive them from there; the newest are in the dev extras): made beside the main install, waited
# for in its own step.
OLD_E2B="${SANDLOOP_OLD_E2B_VENV:-.venv-e2b-old}"
OLD_E2B_STAMP="$OLD_E2B/.installed-2.26.0-2.9.0"
old_e2b_pid=""
if [ "$DEV" = 1 ] && [ ! -f "$OLD_E2B_STAMP" ]; then
    old_e2b_log=$(mktemp /tmp/sandloop-setup-e2b-old.XXXXXX)
    trap '[ -z "$old_e2b_pid" ] || kill "$old_e2b_pid" 2>/dev/null || true; rm -f "$old_e2b_log"' EXIT
    (
        "$PYTHON" -m venv "$OLD_E2B" &&
            "$OLD_E2B/bin/pip" install --quiet --disable-pip-version-check "e2b==2.26.0" "e2b-code-interpreter==2.9.0" &&
            "$OLD_E2B/bin/python" -c "import e2b_code_interpreter" &&
            touch "$OLD_E2B_STAMP"
    ) >"$old_e2b_log" 2>&1 &
    old_e2b_pid=$!
fi

next "virtualenv $VENV with sandloop$([ "$DEV" = 1 ] && echo ' and the dev extras (pytest, the SDKs the tests drive, ruff, mypy)')"
if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
stamp="$VENV/.sandloop-installed"
dev_stamp="$VENV/.sandloop-installed-dev"
stale() { [ ! -f "$1" ] || [ pyproject.toml -nt "$1" ]; }
if stale "$stamp" || { [ "$DEV" = 1 ] && stale "$dev_stamp"; }; then
    # What running needs: the CLI, the HTTP server (sandloop serve) and MCP; with --dev the test
    # tools too, in the same install (one resolution, not two).
    extras="server,mcp"
    [ "$DEV" = 1 ] && extras="server,mcp,dev"
    pip_quiet "$VENV/bin/pip" install --quiet --disable-pip-version-check -e ".[$extras]"
    "$VENV/bin/python" -c "import sandloop, docker" # fail here, not later, if the install broke
    touch "$stamp"
    if [ "$DEV" = 1 ]; then
        "$VENV/bin/python" -c "import pytest"
        touch "$dev_stamp"
    fi
fi

next "runtime image (sandloop images build; offline, about a minute the first time)"
"$VENV/bin/sandloop" images build

if [ "$DEV" = 1 ]; then
    # Debian's Chromium for the playground's browser tests (Playwright drives it; nothing is downloaded).
    next "Debian's chromium for the browser tests, E2B's JavaScript SDK (npm ci in tests/js)"
    have chromium chromium "the playground's browser tests will fail"
    # E2B's JavaScript SDK for tests/integration/test_e2b_reach.py, pinned by tests/js/package-lock.json.
    have npm npm "the JavaScript SDK's test will fail"
    if [ ! -f tests/js/node_modules/.installed ] || [ tests/js/package-lock.json -nt tests/js/node_modules/.installed ]; then
        npm ci --prefix tests/js --no-audit --no-fund --loglevel=error >/dev/null
        touch tests/js/node_modules/.installed
    fi

    next "$OLD_E2B: the oldest E2B SDKs (e2b 2.26.0, e2b-code-interpreter 2.9.0)"
    if [ -n "$old_e2b_pid" ] && ! wait "$old_e2b_pid"; then
        grep -v '^WARNING: Location' "$old_e2b_log" >&2 || true
        echo "setup: the oldest E2B SDKs could not be installed into $OLD_E2B (above)" >&2
        exit 1
    fi
    old_e2b_pid=""
fi
printf 'setup: ... done in %ss; all set up in %ss\n' "$((SECONDS - started))" "$((SECONDS - began))" >&2
