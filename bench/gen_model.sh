# Sourced by the GPU bench scripts: gen_model GENMODEL PRESET DTYPE FOLDER writes a random model
# of a lorastep_genmodel preset (seed 1) into FOLDER, or keeps the one there when its stamp
# (written last: preset, dtype, seed and the generator binary's checksum) matches.
# Its callers run with set -euo pipefail; sourcing sets it again for a caller that does not.
set -euo pipefail
gen_model() {
  local gen=$1 preset=$2 dtype=$3 folder=$4 stamp
  stamp="$preset $dtype seed=1 $(md5sum < "$gen" | cut -d' ' -f1)"
  [ "$(cat "$folder/.gen_model" 2>/dev/null || true)" = "$stamp" ] && return 0
  rm -rf "$folder"
  "$gen" --preset "$preset" --dtype "$dtype" --seed 1 --out "$folder" > /dev/null
  echo "$stamp" > "$folder/.gen_model"
}
