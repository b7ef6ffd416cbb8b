"""Writes the Transformers-layout speed benchmark's model: a random llama of 16 layers, hidden
2048, FFN 5632, 32 heads, 4 KV heads, in BF16 (seeded), with the tokenizer of the llama-f32
reference checkpoint in tests/data/hf.

usage: python hf_bench_model.py OUTDIR
"""
import shutil
import sys
from pathlib import Path

import torch
import transformers

out = Path(sys.argv[1])
tok_src = Path(__file__).resolve().parents[2] / "tests/data/hf/llama-f32"
tokenizer = transformers.AutoTokenizer.from_pretrained(tok_src)
torch.manual_seed(2048)
config = transformers.LlamaConfig(
    hidden_size=2048, intermediate_size=5632, num_hidden_layers=16, num_attention_heads=32,
    num_key_value_heads=4, vocab_size=len(tokenizer), max_position_embeddings=2048,
    rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
    bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
model.save_pretrained(out, safe_serialization=True)
for f in ("tokenizer.json", "tokenizer_config.json"):
    shutil.copy(tok_src / f, out / f)
