# A sanity check of the converted GGUFs, not a reference: llama.cpp's llama-server loads each
# NAME.gguf beside NAME.ref.json, tokenizes the prompts and continues them greedily (temperature 0,
# EOS ignored, prompt given as transformers' ids, F32 KV cache, no flash attention: both would round
# to F16); prints how that compares with transformers' f64 run. Differences to expect from llama.cpp
# itself: BF16 weights make it round the activations to BF16 too (|dlogprob| ~ 1e-2, so greedy may
# part at low margins), its GELU (gemma3) is an F16 table (~ 1e-3), and its SentencePiece tokenizer
# puts a space after a special token such as mistral's [INST] (transformers' legacy=False does not).
# usage: hf_gguf_check.py LLAMA_SERVER DIR
import json, socket, subprocess, sys, time, urllib.request
from pathlib import Path

server, root = sys.argv[1], Path(sys.argv[2])
for ref_file in sorted(root.glob("*.ref.json")):
    ref = json.loads(ref_file.read_text())
    if not ref["gguf"]:
        continue
    model = root / ref["gguf"]["file"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([server, "-m", model, "--host", "127.0.0.1", "--port", str(port), "-t", "2", "-c", "256",
                             "-np", "1", "-ctk", "f32", "-ctv", "f32", "-fa", "off"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"

    def post(path, body):
        req = urllib.request.Request(url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
        return json.load(urllib.request.urlopen(req, timeout=60))
    try:
        for _ in range(300):
            try:
                if json.load(urllib.request.urlopen(url + "/health", timeout=5)).get("status") == "ok":
                    break
            except OSError:
                pass
            if proc.poll() is not None:
                sys.exit(f"llama-server exited on {model}:\n{proc.stderr.read()[-3000:]}")
            time.sleep(0.1)
        tok_ok, tokens_ok, worst, parted = 0, 0, 0.0, []
        for p in ref["prompts"]:
            ids = post("/tokenize", {"content": p["text"], "add_special": p["add_special_tokens"],
                                     "parse_special": True})["tokens"]
            tok_ok += ids == p["ids"]
            if ids != p["ids"]:
                print(f"  {model.name} tokenizes {p['text']!r} as {ids}, transformers as {p['ids']}")
            out = post("/completion", {"prompt": p["ids"], "n_predict": ref["steps"], "temperature": 0,
                                       "ignore_eos": True, "n_probs": 5, "cache_prompt": False, "return_tokens": True})
            tokens_ok += out["tokens"] == p["reference"]
            forced = p["runs"]["f64"]["forced"]
            parted += [f"step {i} (f64 margin {forced[i]['margin']:.2g})" for i, (a, b) in
                       enumerate(zip(out["tokens"], p["reference"])) if a != b][:1]
            # log-probabilities along the reference while llama.cpp follows it; llama-server drops
            # the entry of a token that ends inside a UTF-8 character, so entries are matched by id
            probs = iter(out.get("completion_probabilities", []))
            e = next(probs, None)
            for got, f in zip(out["tokens"], forced):
                if got != f["token"] or e is None:
                    break
                if e["id"] == got:
                    worst = max(worst, abs(e["logprob"] - f["logprob"]))
                    e = next(probs, None)
        n = len(ref["prompts"])
        print(f"{model.name}: tokenization {tok_ok}/{n}, greedy == f64 reference {tokens_ok}/{n}"
              + (f" (parts at {', '.join(parted)})" if parted else "") + f", max |logprob - f64| {worst:.2g}")
    finally:
        proc.terminate()
        proc.wait()
