#!/usr/bin/env bash
# Refresh the playground's editor (CodeMirror 5, MIT) from npm into the package's static files.
# The files are committed so that the server needs no CDN and no npm at run time.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION="${1:-5.65.21}"
DEST="src/sandloop/server/static/vendor/codemirror"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
(cd "$work" && npm pack --silent "codemirror@$VERSION" >/dev/null && tar xzf "codemirror-$VERSION.tgz")
rm -rf "$DEST"
mkdir -p "$DEST/mode" "$DEST/addon" "$DEST/theme"
p="$work/package"
cp "$p/LICENSE" "$p/lib/codemirror.js" "$p/lib/codemirror.css" "$DEST/"
for mode in python javascript shell; do cp "$p/mode/$mode/$mode.js" "$DEST/mode/"; done
cp "$p/addon/edit/matchbrackets.js" "$p/addon/edit/closebrackets.js" "$DEST/addon/"
cp "$p/theme/material-darker.css" "$DEST/theme/"
echo "$VERSION" > "$DEST/VERSION"
echo "vendored CodeMirror $VERSION into $DEST"
