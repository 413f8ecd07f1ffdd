#!/usr/bin/env bash
# Builds .sysroot/ (git-ignored): Debian 12's gRPC, protobuf (+ protoc, grpc_cpp_plugin),
# absl, nlohmann-json, gtest/gmock, OpenSSL, glog, gflags, libmicrohttpd and zstd extracted from their .debs, for the GPU
# machine, which has none of them for C++.
set -euo pipefail
cd "$(dirname "$0")/.."
tmp=$(mktemp -d)
(cd "$tmp" && apt-get download libabsl-dev libabsl20220623 nlohmann-json3-dev libgtest-dev \
   libgmock-dev libssl-dev libssl3 \
   libgrpc++-dev libgrpc++1.51 libgrpc-dev libgrpc29 protobuf-compiler-grpc \
   libprotobuf-dev libprotobuf32 libprotobuf-lite32 libprotoc32 protobuf-compiler \
   libc-ares-dev libc-ares2 libre2-dev libre2-9 zlib1g-dev zlib1g \
   libgoogle-glog-dev libgoogle-glog0v6 libgflags-dev libgflags2.2 libunwind8 \
   libmicrohttpd-dev libmicrohttpd12 libzstd-dev >/dev/null 2>&1)
rm -rf .sysroot && mkdir -p .sysroot
for f in "$tmp"/*.deb; do dpkg-deb -x "$f" .sysroot; done
# Shared absl/OpenSSL libraries are enough; gtest/gmock ship only static archives.
find .sysroot -name '*.a' ! -name 'libgtest*' ! -name 'libgmock*' -delete
rm -rf "$tmp" .sysroot/usr/share/doc .sysroot/usr/share/man
# Absolute links point into this machine's / (zlib): make them relative to the sysroot.
for l in $(find .sysroot -type l -lname "/*"); do
  ln -sf "$(realpath --relative-to="$(dirname "$l")" ".sysroot$(readlink "$l")")" "$l"
done
du -sh .sysroot
