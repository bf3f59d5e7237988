#!/usr/bin/env bash
# Builds baton's CPU image (deploy/Dockerfile) with Debian's podman on a machine that reaches only Debian's archive
# and PyPI: the Debian 12 base images are made here with debootstrap and imported as localhost/debian:12 and
# localhost/debian:12-slim (the same layout as the official images: deb822 sources, no docs in -slim), then the
# Dockerfile builds on them with --isolation chroot (no OCI runtime needed to build). Prints the image's size.
# Usage: deploy/image/build-local.sh [--cuda] [TAG]     (default tag: localhost/baton:0.1.0, -cuda with --cuda)
# Needs root, podman and debootstrap (apt-get install podman debootstrap).
set -euo pipefail
top=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
file=deploy/Dockerfile suffix=""
if [ "${1:-}" = "--cuda" ]; then file=deploy/Dockerfile.cuda suffix=-cuda; shift; fi
tag=${1:-localhost/baton:0.1.0$suffix}
for t in podman debootstrap; do command -v "$t" >/dev/null || { echo "build-local.sh: $t is missing" >&2; exit 1; }; done

base_image() { # NAME SLIM: debootstrap bookworm (minbase) and import it unless podman has it
  local name=$1 slim=$2 root
  podman image exists "$name" && return 0
  root=$(mktemp -d /tmp/baton-rootfs.XXXXXX)
  trap 'rm -rf "$root"' RETURN
  echo "build-local.sh: debootstrap bookworm for $name" >&2
  debootstrap --variant=minbase bookworm "$root" http://deb.debian.org/debian >/dev/null
  rm -f "$root"/var/cache/apt/archives/*.deb "$root"/etc/apt/sources.list
  rm -rf "$root"/var/lib/apt/lists/*
  cat > "$root/etc/apt/sources.list.d/debian.sources" <<SRC
Types: deb
URIs: http://deb.debian.org/debian
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: http://deb.debian.org/debian-security
Suites: bookworm-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SRC
  if [ "$slim" = 1 ]; then
    printf '%s\n' 'path-exclude /usr/share/doc/*' 'path-include /usr/share/doc/*/copyright' \
      'path-exclude /usr/share/man/*' 'path-exclude /usr/share/info/*' 'path-exclude /usr/share/locale/*' \
      'path-include /usr/share/locale/locale.alias' > "$root/etc/dpkg/dpkg.cfg.d/docker"
    find "$root/usr/share/doc" -mindepth 1 -not -name copyright -not -type d -delete
    rm -rf "$root"/usr/share/man/* "$root"/usr/share/info/*
    find "$root/usr/share/locale" -mindepth 1 -maxdepth 1 -not -name locale.alias -exec rm -rf {} +
  fi
  tar -C "$root" -c . | podman import --change 'CMD ["bash"]' - "$name" >/dev/null
}
base_image localhost/debian:12 0
base_image localhost/debian:12-slim 1
cd "$top"
podman build --isolation chroot --network host --build-arg BUILD_IMAGE=localhost/debian:12 \
  --build-arg RUNTIME_IMAGE=localhost/debian:12-slim -f "$file" -t "$tag" .
podman image inspect "$tag" --format "build-local.sh: $tag {{.Size}} bytes, user {{.Config.User}}"
