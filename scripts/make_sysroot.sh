#!/usr/bin/env bash
# Builds .sysroot/ (git-ignored): Debian 12's absl, nlohmann-json, gtest/gmock and OpenSSL
# extracted from their .debs, for the GPU machine, which has none of them. ~24 MB.
set -euo pipefail
cd "$(dirname "$0")/.."
tmp=$(mktemp -d)
(cd "$tmp" && apt-get download libabsl-dev libabsl20220623 nlohmann-json3-dev libgtest-dev \
   libgmock-dev libssl-dev libssl3 >/dev/null)
rm -rf .sysroot && mkdir -p .sysroot
for f in "$tmp"/*.deb; do dpkg-deb -x "$f" .sysroot; done
# Shared absl/OpenSSL libraries are enough; gtest/gmock ship only static archives.
find .sysroot -name '*.a' ! -name 'libgtest*' ! -name 'libgmock*' -delete
rm -rf "$tmp"
du -sh .sysroot
