"""Times Transformers' own CPU inference on a checkpoint, as `dgr bench engine --transformers`
runs it: a prompt of P tokens into an empty cache (prefill), then N single-token greedy steps
with the KV cache (decode), in the checkpoint's dtype, T threads. Prints one JSON object.

usage: python hf_speed.py CHECKPOINT_DIR THREADS P N
"""
import json
import sys
import time

import torch
import transformers

path, threads, p, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
torch.set_num_threads(threads)
model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype="auto")
model.eval()
vocab = model.config.vocab_size
# The same prompt dgr's bench feeds: (i * 7919 + 13) mod vocab.
prompt = torch.tensor([[(i * 7919 + 13) % vocab for i in range(p)]])
with torch.inference_mode():
    model(prompt[:, :8])  # warm-up
    t = time.perf_counter()
    model(prompt, use_cache=True)
    prefill = p / (time.perf_counter() - t)
    token, past = torch.tensor([[1]]), None
    t = time.perf_counter()
    for _ in range(n):
        out = model(token, past_key_values=past, use_cache=True)
        past = out.past_key_values
        token = out.logits[:, -1:].argmax(-1)
    decode = n / (time.perf_counter() - t)
print(json.dumps({"prefill_tok_s": prefill, "decode_tok_s": decode,
                  "transformers": transformers.__version__, "torch": torch.__version__}))
