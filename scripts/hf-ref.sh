#!/usr/bin/env bash
# Writes tests/data/hf/: tiny random Transformers checkpoints (llama, mistral, qwen2, qwen3, gemma3
# in F32 and BF16, llama also in F16; llama-f32 sharded), what transformers computes on them
# (NAME.ref.json) and llama.cpp's conversion of the F32 and BF16 ones (NAME.gguf), all from
# scripts/ref/hf_checkpoints.py with fixed seeds. The Rust tests read them; CI never installs torch,
# so rerun this after changing the script. Needs llama.cpp's source tree for its converter
# ($HOME/.cache/dgr-ref/src/llama.cpp, from ../shared/tools/build-llama-ref.sh; DGR_LLAMA_CPP_SRC
# overrides where) and PyPI, for the pinned packages below, installed into target/hf-venv on first
# use. If llama.cpp's llama-server is there too (DGR_REF_BIN), each GGUF is sanity-checked with it.
# usage: scripts/hf-ref.sh [NAME ...]   (e.g. llama-f32 qwen3-bf16; default: all of them)
set -euo pipefail
cd "$(dirname "$0")/.."
src=${DGR_LLAMA_CPP_SRC:-$HOME/.cache/dgr-ref/src/llama.cpp}
bin=${DGR_REF_BIN:-$HOME/.cache/dgr-ref/bin}
[ -f "$src/convert_hf_to_gguf.py" ] || { echo "no llama.cpp source in $src: run ../shared/tools/build-llama-ref.sh" >&2; exit 1; }
export DGR_LLAMA_CPP_SRC=$src

# torch from PyPI is the CUDA build (PyPI has no CPU-only wheel); it runs on the CPU all the same.
# protobuf: transformers reads tokenizer.model through it; pyyaml, tqdm, requests: the converter's
# gguf-py (used from the llama.cpp tree itself, so that converter and gguf match).
pins=(torch==2.15.0 transformers==5.23.0 safetensors==0.8.0 tokenizers==0.23.3 sentencepiece==0.2.3
      numpy==2.4.6 protobuf==7.36.2 pyyaml==6.0.4 tqdm==4.70.1 requests==2.34.2)
venv=target/hf-venv
if ! "$venv/bin/python" - "${pins[@]}" 2>/dev/null <<'PY'
import sys
from importlib.metadata import version
sys.exit(any(version(p.split("==")[0]) != p.split("==")[1] for p in sys.argv[1:]))
PY
then
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q "${pins[@]}"
fi

mkdir -p tests/data/hf
"$venv/bin/python" scripts/ref/hf_checkpoints.py tests/data/hf "$@"
if [ -x "$bin/llama-server" ]; then
  "$venv/bin/python" scripts/ref/hf_gguf_check.py "$bin/llama-server" tests/data/hf
else
  echo "no llama-server in $bin: GGUFs not sanity-checked" >&2
fi
