# llama.cpp's convert_hf_to_gguf.py, run unchanged but for one thing: the name of the BPE
# pre-tokenizer. The converter tells pre-tokenizers apart by a hash of the ids a tokenizer gives a
# fixed text, and knows only the hashes of published tokenizers; ours are trained by
# hf_checkpoints.py, so their hashes are unknown. They use a published pre-tokenizer's regex (Llama
# 3's or Qwen2's) though, so where the converter gives up this names that one ("-": never).
# usage: hf_convert.py PRE CONVERTER_ARG...   (DGR_LLAMA_CPP_SRC: the llama.cpp source tree)
import os, runpy, sys
from pathlib import Path

src = Path(os.environ.get("DGR_LLAMA_CPP_SRC", Path.home() / ".cache/dgr-ref/src/llama.cpp"))
pre = sys.argv[1]
sys.path[:0] = [str(src), str(src / "gguf-py")]  # the converter's package and its own gguf
from conversion.base import TextModel  # noqa: E402

known = TextModel.get_vocab_base_pre


def get_vocab_base_pre(self, tokenizer):
    try:
        return known(self, tokenizer)
    except NotImplementedError:
        if pre == "-":
            raise
        print(f"hf_convert.py: unknown pre-tokenizer hash, using {pre!r}", file=sys.stderr)
        return pre


TextModel.get_vocab_base_pre = get_vocab_base_pre
sys.argv = [str(src / "convert_hf_to_gguf.py"), *sys.argv[2:]]
runpy.run_path(sys.argv[0], run_name="__main__")
