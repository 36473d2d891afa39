#!/usr/bin/env bash
# Refresh the playground's terminal (xterm.js, MIT) from npm into the package's static files.
# The files are committed so that the server needs no CDN and no npm at run time.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION="${1:-6.0.0}"
DEST="src/sandloop/server/static/vendor/xterm"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
(cd "$work" && npm pack --silent "@xterm/xterm@$VERSION" >/dev/null && tar xzf "xterm-xterm-$VERSION.tgz")
rm -rf "$DEST"
mkdir -p "$DEST"
cp "$work/package/LICENSE" "$work/package/lib/xterm.js" "$work/package/css/xterm.css" "$DEST/"
sed -i "/sourceMappingURL=xterm.js.map/d" "$DEST/xterm.js"  # no map shipped: no 404 for it
echo "$VERSION" > "$DEST/VERSION"
echo "vendored xterm.js $VERSION into $DEST"
