#!/usr/bin/env bash
# Build a slim Debian base image from Debian's own packages, for machines that cannot pull one:
#
#     docker/base.sh                      # -> image gpt-base:bookworm (skipped when it exists)
#     docker build --build-arg BASE=gpt-base:bookworm ...
#
# debootstrap's minbase variant plus python3, python3-venv and ca-certificates, with apt's lists and
# downloaded packages removed, imported as an image with `docker import`. Where a registry can be
# reached, the Dockerfile's default base (python:3.11-slim-bookworm) is the simpler choice.
#
# Footguns: needs root (debootstrap chroots) and debootstrap itself (apt-get install debootstrap);
# the image tag is the cache, so after changing this script remove the image (docker rmi gpt-base:bookworm).
set -euo pipefail

image=${GPT_BASE_IMAGE:-gpt-base:bookworm}
suite=${GPT_BASE_SUITE:-bookworm}
mirror=${GPT_BASE_MIRROR:-http://deb.debian.org/debian}

if docker image inspect "$image" >/dev/null 2>&1; then
    echo "base image $image exists"
    exit 0
fi
command -v debootstrap >/dev/null || { echo "error: debootstrap is missing: apt-get install debootstrap" >&2; exit 1; }

root=$(mktemp -d)
trap 'rm -rf "$root"' EXIT
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates "$suite" "$root" "$mirror" >/dev/null
rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin "$root"/var/cache/apt/archives/*.deb
tar -C "$root" --numeric-owner -c . | docker import --change 'CMD ["/bin/bash"]' - "$image" >/dev/null
echo "built base image $image"
