#!/usr/bin/env bash
# Everything a fresh machine needs: a Docker engine (with gVisor), the virtualenv, the runtime image.
# Idempotent: re-running it only redoes what is missing or out of date.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3}"
VENV="${SANDLOOP_VENV:-.venv}"

bash scripts/engine-up.sh

# Debian's Chromium for the playground's browser tests (Playwright drives it; nothing is downloaded).
if ! command -v chromium >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "setup: installing Debian's chromium for the browser tests" >&2
        apt-get update -q >/dev/null
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium >/dev/null
    else
        echo "setup: chromium not found; the playground's browser tests will fail (apt-get install chromium)" >&2
    fi
fi

if [ ! -x "$VENV/bin/python" ]; then
    echo "setup: creating $VENV" >&2
    "$PYTHON" -m venv "$VENV"
fi
stamp="$VENV/.sandloop-installed"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    echo "setup: installing sandloop and its dev dependencies into $VENV" >&2
    "$VENV/bin/pip" install --quiet --disable-pip-version-check -e ".[dev]" 2>&1 | grep -v '^WARNING: Location' || true
    "$VENV/bin/python" -c "import sandloop, docker, pytest" # fail here, not later, if the install broke
    touch "$stamp"
fi

# The oldest E2B SDKs sandloop's E2B-compatible API supports, in a venv of their own (the tests
# drive them from there; the newest are in the dev extras).
OLD_E2B="${SANDLOOP_OLD_E2B_VENV:-.venv-e2b-old}"
if [ ! -f "$OLD_E2B/.installed-2.26.0-2.9.0" ]; then
    echo "setup: creating $OLD_E2B (e2b 2.26.0, e2b-code-interpreter 2.9.0)" >&2
    "$PYTHON" -m venv "$OLD_E2B"
    "$OLD_E2B/bin/pip" install --quiet --disable-pip-version-check "e2b==2.26.0" "e2b-code-interpreter==2.9.0" 2>&1 \
        | grep -v '^WARNING: Location' || true
    "$OLD_E2B/bin/python" -c "import e2b_code_interpreter"
    touch "$OLD_E2B/.installed-2.26.0-2.9.0"
fi

"$VENV/bin/sandloop" images build
