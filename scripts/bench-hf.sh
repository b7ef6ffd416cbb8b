#!/usr/bin/env bash
# The Transformers-layout engine's speed benchmark (issue 11): a random BF16 llama of 16 layers ×
# 2048 hidden, written by transformers (scripts/ref/hf_bench_model.py), run by dgr from the
# checkpoint directory, by llama-bench on llama.cpp's own BF16 conversion of it, and by
# transformers' own CPU inference — all in one `dgr bench engine` run, 2 threads, with a record.
# Needs the venv of scripts/hf-ref.sh (torch, transformers, llama.cpp's converter) and llama.cpp's
# tools (../shared/tools/build-llama-ref.sh).
# usage: scripts/bench-hf.sh [REPS]   (DGR_BENCH_DIR: where the ~2.2 GB model and its GGUF go)
set -euo pipefail
cd "$(dirname "$0")/.."
py=target/hf-venv/bin/python
"$py" -c 'import torch, transformers' 2>/dev/null || { echo "no torch/transformers in $py: run scripts/hf-ref.sh first" >&2; exit 1; }
dir=${DGR_BENCH_DIR:-target/bench-hf}
model=$dir/llama-16x2048-bf16
if [ ! -f "$model/config.json" ]; then
  mkdir -p "$dir"
  "$py" scripts/ref/hf_bench_model.py "$model"
fi
if [ ! -f "$model.gguf" ]; then
  "$py" scripts/ref/hf_convert.py llama-bpe --outtype bf16 --outfile "$model.gguf" "$model"
fi
cargo build --release --locked -p dgr
target/release/dgr bench engine -m "$model" --peer-model "$model.gguf" --transformers "$py" -r "${1:-3}" \
  --prompt-tokens 128 --gen-tokens 64 --out benchmarks/records
