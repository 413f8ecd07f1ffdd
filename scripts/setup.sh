#!/usr/bin/env bash
# Installs the Debian 12 packages lorastep builds and tests with. Idempotent; needs root
# (or sudo). Everything comes from Debian's archive: the build is fully offline after this.
set -euo pipefail
SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO=sudo; fi
PACKAGES=(
  build-essential cmake ninja-build pkg-config git
  bazel-bootstrap
  libtorch-dev libgloo-dev
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev libgoogle-glog-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  nlohmann-json3-dev libssl-dev openssl
  libmicrohttpd-dev libzstd-dev
  python3-grpcio python3-protobuf python3-numpy python3-prometheus-client python3-zstandard
  gnuplot-nox
)
missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
echo "setup: all ${#PACKAGES[@]} packages present"
