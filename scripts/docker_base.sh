#!/usr/bin/env bash
# Makes a Debian bookworm base image from Debian's packages alone, for Docker daemons that can
# reach no container registry (CI here): debootstrap's minimal system, with the same apt sources
# as debian:bookworm-slim (bookworm, -updates, -security: the Dockerfile's Rust is in -security),
# plus the host's own certificate authorities, imported with `docker import`. The Dockerfile takes
# it as --build-arg BASE_IMAGE=IMAGE.
#
#   scripts/docker_base.sh [IMAGE]      default IMAGE: mla-serve-base:bookworm
#
# Does nothing if IMAGE exists. The root file system is kept as a tarball in
# MLA_DOCKER_CACHE (default ~/.cache/mla-serve-docker) for a week, so a daemon that lost its
# images (CI removes them at the end) gets it back in seconds instead of ~40 s of debootstrap.
# Needs root, debootstrap and a running daemon. MLA_DEBIAN_MIRROR overrides deb.debian.org.
set -euo pipefail

image="${1:-mla-serve-base:bookworm}"
docker="${DOCKER:-docker}"
cache="${MLA_DOCKER_CACHE:-$HOME/.cache/mla-serve-docker}"
mirror="${MLA_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
tarball="$cache/debian-bookworm-minbase.tar"

if "$docker" image inspect "$image" > /dev/null 2>&1; then
  echo "base image $image already present" >&2
  exit 0
fi

mkdir -p "$cache"
if [[ -z "$(find "$tarball" -mtime -7 2> /dev/null)" ]]; then
  command -v debootstrap > /dev/null || { echo "error: debootstrap is missing (apt-get install debootstrap)" >&2; exit 1; }
  root="$(mktemp -d)"
  trap 'rm -rf "$root"' EXIT
  echo "debootstrap bookworm (minbase) from $mirror" >&2
  debootstrap --variant=minbase bookworm "$root" "$mirror" > "$cache/debootstrap.log" 2>&1 \
    || { tail -n 20 "$cache/debootstrap.log" >&2; exit 1; }

  # debian:bookworm-slim's sources, in the deb822 form it uses.
  rm -f "$root/etc/apt/sources.list"
  cat > "$root/etc/apt/sources.list.d/debian.sources" << EOF
Types: deb
URIs: $mirror
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: ${mirror%/debian}/debian-security
Suites: bookworm-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
  # As in the slim images: no manuals or translations in later installs, no .deb left behind.
  cat > "$root/etc/dpkg/dpkg.cfg.d/excludes" << 'EOF'
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/info/*
path-exclude /usr/share/locale/*
EOF
  echo 'DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/*.bin || true"; };' \
    > "$root/etc/apt/apt.conf.d/docker-clean"
  # Certificate authorities this host added (/usr/local/share/ca-certificates): where the network
  # passes through a TLS-inspecting proxy, as it does here, pip and cargo in the image build must
  # trust its CA as the host does. Installing ca-certificates in the build puts them in the bundle.
  if compgen -G '/usr/local/share/ca-certificates/*.crt' > /dev/null; then
    mkdir -p "$root/usr/local/share/ca-certificates"
    cp /usr/local/share/ca-certificates/*.crt "$root/usr/local/share/ca-certificates/"
  fi
  rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin "$root"/var/cache/apt/archives/*.deb \
    "$root"/usr/share/man/* "$root"/usr/share/locale/* "$root"/usr/share/info/*
  find "$root/usr/share/doc" -mindepth 1 -not -name copyright -not -type d -delete

  tar --numeric-owner -C "$root" -cf "$tarball.tmp" .
  mv "$tarball.tmp" "$tarball"
fi

"$docker" import --change 'CMD ["bash"]' --message "debootstrap --variant=minbase bookworm" \
  "$tarball" "$image" > /dev/null
echo "base image $image imported ($(du -h "$tarball" | cut -f1))" >&2
