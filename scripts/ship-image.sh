#!/usr/bin/env bash
# Copy this host's runtime image to a sandbox node of a Ray cluster (which has Docker, no registry):
#   scripts/ship-image.sh HOST [SSH-OPTIONS...]
# The alternative, on the node itself: `sandloop images build` (offline, from Debian's mirror).
set -euo pipefail
HOST="${1:?usage: scripts/ship-image.sh HOST [ssh options]}"; shift
cd "$(dirname "$0")/.."
VENV="${SANDLOOP_VENV:-.venv}"
IMAGE="$("$VENV/bin/sandloop" images name)"
docker image inspect "$IMAGE" >/dev/null 2>&1 || "$VENV/bin/sandloop" images build
echo "shipping $IMAGE to $HOST" >&2
docker save "$IMAGE" | gzip -1 | ssh "$@" "$HOST" 'gunzip | docker load'
echo "done: $HOST has $IMAGE (check with: SANDLOOP_BACKEND=ray sandloop cluster status)" >&2
