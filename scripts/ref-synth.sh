#!/usr/bin/env bash
# Writes tests/data/synth/<arch>-<type>.json: for every architecture (on q8_0) and for llama on
# every tensor type, a synthetic model from `dgr synth`, llama.cpp's greedy run on it and the exact
# float64 computation of the same file (scripts/ref/synth_ref.py). crates/dgr/tests/synth_archs.rs
# holds dgr against them; CI never runs llama.cpp, so rerun this after changing `dgr synth`.
# Needs llama.cpp's tools (../shared/tools/build-llama-ref.sh; DGR_REF_BIN overrides where) and
# numpy and gguf, installed into target/ref-venv on first use.
# usage: scripts/ref-synth.sh [ARCH-TYPE ...]   (default: all of them)
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${DGR_REF_BIN:-$HOME/.cache/dgr-ref/bin}
[ -x "$bin/llama-server" ] || { echo "no llama-server in $bin: run ../shared/tools/build-llama-ref.sh" >&2; exit 1; }
venv=target/ref-venv
if ! "$venv/bin/python" -c 'import numpy, gguf' 2>/dev/null; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q numpy gguf
fi
cargo build --release --locked -p dgr
dgr=target/release/dgr

# Small shapes, whole K-quant blocks everywhere. qwen3 and gemma3 get heads wider than hidden /
# heads (as Qwen3-0.6B's and Gemma 3's are); gemma3 six layers, so one of them is global.
shape=(--hidden 256 --ffn 512 --heads 4 --kv-heads 2 --vocab 512 --context 256 --seed 7)
models=(llama-q8_0 mistral-q8_0 qwen2-q8_0 qwen3-q8_0 gemma3-q8_0)
for ty in f32 f16 bf16 q4_0 q4_1 q5_0 q5_1 q2_k q3_k q4_k q5_k q6_k; do models+=("llama-$ty"); done
# llama.cpp's Q4_K_M mixture (Q4_K, and Q6_K for the head and layer 2's attn_v and ffn_down at this shape).
models+=(llama-q4_k_m qwen2-q4_k_m)
[ $# -gt 0 ] && models=("$@")

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir -p tests/data/synth
for m in "${models[@]}"; do
  arch=${m%-*} ty=${m##*-}
  case $arch in
    qwen3) extra=(--layers 3 --head-dim 128) ;;
    gemma3) extra=(--layers 6 --head-dim 128) ;;
    *) extra=(--layers 3) ;;
  esac
  args=(synth --arch "$arch" --type "$ty" "${extra[@]}" "${shape[@]}")
  "$dgr" "${args[@]}" --out "$tmp/$m.gguf"
  "$venv/bin/python" scripts/ref/synth_ref.py "$tmp/$m.gguf" "$bin/llama-server" "tests/data/synth/$m.json" "${args[@]}"
done
