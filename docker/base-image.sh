#!/usr/bin/env bash
# Make a minimal Debian bookworm base image locally (no image registry needed):
# debootstrap into a temporary folder, then `docker import`. Skipped if the image exists.
# Usage: docker/base-image.sh [IMAGE_NAME]   (default: fsdp-trainer-base:bookworm)
set -euo pipefail

NAME=${1:-fsdp-trainer-base:bookworm}
# EDIT: a Debian mirror you can reach; default: the first one this machine's apt uses.
MIRROR=${DEBIAN_MIRROR:-$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)}
MIRROR=${MIRROR:-http://deb.debian.org/debian}

if docker image inspect "$NAME" >/dev/null 2>&1; then
    exit 0
fi
if ! command -v debootstrap >/dev/null 2>&1; then
    echo "base-image: debootstrap is missing (apt-get install debootstrap, or run docker/engine-up.sh)" >&2
    exit 1
fi

DIR=$(mktemp -d "${TMPDIR:-/tmp}/debootstrap.XXXXXX")
chmod 755 "$DIR"  # it becomes the image's /: mktemp made it 700, which locks out non-root users
cleanup() {
    # A debootstrap that failed or was stopped half-way leaves the host's /proc, /sys (and on some
    # hosts /dev) mounted inside DIR: unmount them, deepest first, before removing anything, and
    # never let rm cross into another filesystem (it would delete the host's /dev through a bind).
    awk -v dir="$DIR/" 'index($2, dir) == 1 {print $2}' /proc/mounts | sort -r | while read -r mount; do
        umount "$mount" 2>/dev/null || umount -l "$mount"
    done
    rm -rf --one-file-system "$DIR"
}
trap cleanup EXIT
debootstrap --variant=minbase bookworm "$DIR" "$MIRROR" >"$DIR.log" 2>&1 \
    || { echo "base-image: debootstrap failed; see $DIR.log" >&2; exit 1; }
rm -f "$DIR.log"
# Smaller image: no apt lists or caches from the bootstrap.
rm -rf "$DIR"/var/lib/apt/lists/* "$DIR"/var/cache/apt/archives/*.deb
tar -C "$DIR" -c . | docker import \
    --change 'ENV LANG=C.UTF-8 PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'CMD ["/bin/bash"]' \
    - "$NAME" >/dev/null
echo "base-image: made $NAME"
