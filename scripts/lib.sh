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
