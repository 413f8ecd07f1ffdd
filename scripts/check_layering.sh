#!/usr/bin/env bash
# The top-level folders depend one way: lib <- rpc <- worker <- server (clients and tools
# stand beside them). Fails, naming the file, when an include or a Bazel dependency points
# the other way; that also rules out cycles between them.
set -uo pipefail
cd "$(dirname "$0")/.."
bad=0
check() {  # folder, the folders it must not reach
  local from=$1 forbidden=$2
  while IFS= read -r hit; do
    echo "layering: $hit (${from}/ must not depend on ${forbidden//|/, })"
    bad=1
  done < <(grep -rnE "#include \"(${forbidden})/" "$from" --include=*.h --include=*.cc --include=*.cu 2>/dev/null;
           grep -rnE "\"//(${forbidden})[:/]" "$from" --include=BUILD 2>/dev/null)
}
check lib "rpc|worker|server|clients|tools"
check rpc "worker|server|clients|tools"
check worker "server|clients|tools"
exit $bad
