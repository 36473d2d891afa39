#!/usr/bin/env bash
# Everything a fresh machine needs: a Docker engine (with gVisor), the virtualenv, the runtime image.
# Idempotent: re-running it only redoes what is missing or out of date.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3}"
VENV="${SANDLOOP_VENV:-.venv}"

bash scripts/engine-up.sh

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

"$VENV/bin/sandloop" images build
