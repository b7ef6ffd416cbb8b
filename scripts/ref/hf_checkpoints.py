# Tiny random Hugging Face Transformers checkpoints with fixed seeds, and what transformers computes
# on them: the reference of the Transformers-layout engine. Written by scripts/hf-ref.sh (which
# pins the versions); read by the Rust tests. Everything is seeded: a rerun rewrites the same bytes.
#
# usage: hf_checkpoints.py OUTDIR [NAME ...]   (NAME as in CHECKPOINTS; default: all of them)
#
# Per NAME (e.g. llama-f32, qwen3-bf16) it writes, under OUTDIR:
#   NAME/          the checkpoint as save_pretrained writes it: config.json, generation_config.json,
#                  model.safetensors (llama-f32: model-0000{1,2}-of-00002.safetensors and
#                  model.safetensors.index.json), tokenizer.json, tokenizer_config.json, and for the
#                  SentencePiece families (mistral, gemma3) the tokenizer.model it was made from
#   NAME.gguf      (f32 and bf16 only) llama.cpp's convert_hf_to_gguf.py of NAME/, --outtype f32|bf16
#   NAME.ref.json  the reference, schema below
#
# NAME.ref.json; floats are repr(float64), ids plain ints:
#   schema (1), name, checkpoint (directory name beside this file), architecture, model_type, seed
#   dtype             storage dtype of the safetensors: "float32" | "bfloat16" | "float16"
#   sharded           whether the weights are split over two files with an index
#   versions          {python, torch, transformers, tokenizers, safetensors, sentencepiece}
#   attn_implementation  "eager" (no fused kernel); torch_threads  1 (CPU)
#   config            summary: layers, hidden, intermediate, heads, kv_heads, head_dim, vocab,
#                     tied_embeddings, rope_theta (gemma3: {"sliding_attention", "full_attention"}),
#                     rms_norm_eps, sliding_window, layer_types (null where every layer is global)
#   tokenizer         how it was made (a sentence)
#   logprobs          how a log-probability is computed: log_softmax of the logits upcast to float64
#   runs              {run: what it is}: "f64" (transformers in float64, which still computes RoPE,
#                     RMSNorm and the attention softmax in float32), "f64_strict" (the same, float64
#                     throughout), "f32", and for bf16/f16 checkpoints "native" (weights and compute
#                     in the storage dtype, as transformers runs them by default); f32 of a bf16/f16
#                     checkpoint upcasts the weights exactly, so it is the "stored weights, float32
#                     compute" form
#   reference_run     "f64": its greedy continuation is the sequence every run is teacher-forced on
#   steps             16, the length of every continuation
#   gguf              null, or {file, outtype, command} (command relative to the repository root)
#   prompts           list of
#     text            the prompt (for a chat prompt: the rendered chat template)
#     chat            null, or the messages rendered with apply_chat_template(add_generation_prompt)
#     add_special_tokens  as passed to the tokenizer (false for chat prompts: the template has BOS)
#     ids             transformers' tokenizer output for text
#     reference       the f64 run's greedy continuation (steps ids; EOS ignored)
#     runs            {run: {greedy, forced}}
#       greedy        the run's own free greedy continuation (steps ids)
#       forced        steps entries, teacher-forced along ids + reference: entry i is the next-token
#                     distribution after ids + reference[:i]: {token: reference[i], logprob: its
#                     log-probability, top: [[id, logprob] x 5] best first, margin: top-1 minus top-2
#                     log-probability}
#   summary           {margin_ok: f64 forced steps with margin >= 1e-3, total_steps, runs: {run:
#                     {greedy_equal: prompts whose greedy equals reference, vs_f64: {mean_abs_dlogprob,
#                     max_abs_dlogprob}, vs_f64_strict: {...}}}}: forced logprobs against those runs'
#                     over all steps
import contextlib, io, json, os, random, shutil, subprocess, sys, tempfile
from pathlib import Path

import safetensors, sentencepiece as spm, tokenizers, torch, transformers
from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

STEPS = 16
HIDDEN, INTERMEDIATE, HEADS, KV_HEADS = 64, 128, 4, 2
LLAMA_CPP = Path(os.environ.get("DGR_LLAMA_CPP_SRC", Path.home() / ".cache/dgr-ref/src/llama.cpp"))

# family: transformers config (the family's defaults for what the tests exercise), tokenizer kind
# and seed. Norm weights: llama-style RMSNorm multiplies by w, gemma's by (1 + w).
FAMILIES = {
    "llama": dict(seed=11, tok="llama3", arch="LlamaForCausalLM", cfg=dict(
        model_type="llama", num_hidden_layers=3, rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)),
    "mistral": dict(seed=12, tok="mistral", arch="MistralForCausalLM", cfg=dict(
        model_type="mistral", num_hidden_layers=3, rope_theta=1000000.0, rms_norm_eps=1e-5, sliding_window=None,
        tie_word_embeddings=False)),
    "qwen2": dict(seed=13, tok="qwen2", arch="Qwen2ForCausalLM", cfg=dict(
        model_type="qwen2", num_hidden_layers=3, rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
        use_sliding_window=False)),
    "qwen3": dict(seed=14, tok="qwen2", arch="Qwen3ForCausalLM", cfg=dict(
        model_type="qwen3", num_hidden_layers=3, head_dim=32, rope_theta=1000000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=True, use_sliding_window=False)),
    # Gemma 3 text: five sliding-window layers then a global one (as the family's pattern of 6),
    # window 8 so that every prompt runs past it; query_pre_attn_scalar = head_dim as in the real
    # 270m/1b/4b configs (llama.cpp assumes it).
    "gemma3": dict(seed=15, tok="gemma", arch="Gemma3ForCausalLM", cfg=dict(
        model_type="gemma3_text", num_hidden_layers=6, head_dim=32, query_pre_attn_scalar=32, sliding_window=8,
        layer_types=["sliding_attention"] * 5 + ["full_attention"], rms_norm_eps=1e-6, tie_word_embeddings=True,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}},
        hidden_activation="gelu_pytorch_tanh")),
}
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}
# name -> (family, storage dtype); llama-f32 is written sharded
CHECKPOINTS = {f"{f}-{d}": (f, d) for d in ("f32", "bf16") for f in FAMILIES} | {"llama-f16": ("llama", "f16")}
SHARDED = {"llama-f32"}


# ---------------------------------------------------------------------------------- tokenizers

def corpus():
    """The training text of every tokenizer: templated English sentences from a seeded RNG, plus a
    few fixed lines with digits, punctuation and non-ASCII text."""
    r = random.Random(1234)
    subj = ("the cat|a dog|my friend|the old man|our teacher|the small robot|a bird|the river|the king|she|he|they|"
            "we|the model|a student|the baker|the quick brown fox|the lazy dog").split("|")
    verb = "sees|likes|reads|writes|finds|counts|builds|paints|carries|follows|remembers|opens|jumps over|eats".split("|")
    obj = ("a book|the stars|three apples|the red door|an old map|the blue sky|some bread|the letters|a song|the capital"
           "|the numbers|the green hills|a warm cup of tea|the quiet room|the market|the lazy dog|a time").split("|")
    tail = ("today|every morning|in the garden|near the sea|after dinner|before the rain|at night|in Paris|in France|"
            "with great care|again and again|on Monday|in 2024|once upon a time|there was").split("|")
    lines = []
    for _ in range(3000):
        s = f"{r.choice(subj)} {r.choice(verb)} {r.choice(obj)} {r.choice(tail)}{r.choice('.!?,;')}"
        if r.random() < 0.5:
            s = s[0].upper() + s[1:]
        if r.random() < 0.2:
            s += f" It cost ${r.randint(0, 99)}.{r.randint(10, 99)} for {r.randint(0, 9999)} {r.choice(['items', 'pears', 'euros', 'robots'])}."
        if r.random() < 0.1:
            s = f'"{s}" she said.'
        if r.random() < 0.05:
            s = f"Q: {s}\nA: What is the capital of France? Paris."
        lines.append(s)
    lines += ["Naïve café owners in Zürich serve crème brûlée and déjà vu — to tourists from São Paulo.",
              "Привет, мир! Ελληνικά γράμματα. 日本語のテキスト。", "def add(a, b):\n    return a + b  # 4 spaces",
              "Once upon a time, there was a quick brown fox that jumps over the lazy dog.",
              "user\nWhat is the capital of France?\nassistant\nThe capital of France is Paris.\nmodel\nParis."] * 3
    return lines


CHAT_TEMPLATES = {
    "llama3": "{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}",
    "qwen2": "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}",
    "mistral": "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}{% else %}{{ message['content'] + eos_token }}{% endif %}{% endfor %}",
    "gemma": "{{ bos_token }}{% for message in messages %}{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}",
}
# The pre-tokenizer regexes of Llama 3 and Qwen2 (as in their tokenizer.json files); llama.cpp
# knows them as the pre-tokenizers "llama-bpe" and "qwen2".
LLAMA3_REGEX = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
QWEN2_REGEX = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
LLAMA_CPP_PRE = {"llama3": "llama-bpe", "qwen2": "qwen2"}


def byte_bpe(kind):
    """Byte-level BPE as Llama 3 / Qwen2 have it, trained on corpus() with the family's regex; the
    special tokens come after the learned vocabulary, as in the real files."""
    regex = LLAMA3_REGEX if kind == "llama3" else QWEN2_REGEX
    tok = tokenizers.Tokenizer(models.BPE(ignore_merges=kind == "llama3"))
    if kind == "qwen2":
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(regex), "isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus(), trainers.BpeTrainer(vocab_size=768, min_frequency=2, show_progress=False,
                                                          initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    if kind == "llama3":
        specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
        tok.add_special_tokens(specials)
        tok.post_processor = processors.Sequence([
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B:1",
                                          special_tokens=[("<|begin_of_text|>", tok.token_to_id("<|begin_of_text|>"))])])
        # Llama 3 ships a plain PreTrainedTokenizerFast: transformers uses tokenizer.json as it is
        return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>",
                                       chat_template=CHAT_TEMPLATES["llama3"], clean_up_tokenization_spaces=True)
    # Qwen2Tokenizer rebuilds its pipeline from vocab and merges (the same one as above)
    j = json.loads(tok.to_str())
    vocab = j["model"]["vocab"]
    for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
        vocab[t] = len(vocab)
    return transformers.Qwen2Tokenizer(vocab=vocab, merges=[tuple(m) for m in j["model"]["merges"]],
                                       eos_token="<|im_end|>", pad_token="<|endoftext|>", unk_token=None,
                                       extra_special_tokens=["<|im_start|>"], chat_template=CHAT_TEMPLATES["qwen2"])


def sentencepiece_bpe(kind, tmp):
    """A SentencePiece BPE model with byte fallback, trained on corpus() with the family's special
    ids (mistral: Llama 2's <unk> <s> </s>, dummy prefix; gemma: <pad> <eos> <bos> <unk> <mask>, no
    dummy prefix), converted to tokenizer.json by transformers' own class for the family. Returns
    (tokenizer, tokenizer.model bytes)."""
    buf = io.BytesIO()
    common = dict(sentence_iterator=iter(corpus()), model_writer=buf, model_type="bpe", vocab_size=640,
                  byte_fallback=True, split_digits=True, character_coverage=0.9995, num_threads=1,
                  normalization_rule_name="identity", remove_extra_whitespaces=False, hard_vocab_limit=False,
                  allow_whitespace_only_pieces=True, minloglevel=2)
    if kind == "gemma":
        spm.SentencePieceTrainer.train(**common, add_dummy_prefix=False, pad_id=0, eos_id=1, bos_id=2, unk_id=3,
                                       pad_piece="<pad>", eos_piece="<eos>", bos_piece="<bos>", unk_piece="<unk>",
                                       user_defined_symbols=["<mask>", "<start_of_turn>", "<end_of_turn>"])
        specials = dict(bos_token="<bos>", eos_token="<eos>", unk_token="<unk>", pad_token="<pad>", mask_token="<mask>",
                        extra_special_tokens=["<start_of_turn>", "<end_of_turn>"])
        cls = "GemmaTokenizer"
    else:
        spm.SentencePieceTrainer.train(**common, add_dummy_prefix=True, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
                                       user_defined_symbols=["[INST]", "[/INST]"])
        # legacy=False: transformers 5's default (no extra "▁" after a special token)
        specials = dict(bos_token="<s>", eos_token="</s>", unk_token="<unk>", legacy=False,
                        extra_special_tokens=["[INST]", "[/INST]"])
        cls = "LlamaTokenizer"
    d = Path(tmp) / kind
    d.mkdir()
    (d / "tokenizer.model").write_bytes(buf.getvalue())
    (d / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": cls}))
    tok = AutoTokenizer.from_pretrained(d, add_bos_token=True, add_eos_token=False,
                                        chat_template=CHAT_TEMPLATES[kind], **specials)
    sp = spm.SentencePieceProcessor(model_proto=buf.getvalue())
    assert len(tok) == sp.get_piece_size(), (len(tok), sp.get_piece_size())  # llama.cpp reads tokenizer.model
    return tok, buf.getvalue()


# ---------------------------------------------------------------------------------- models

def make_model(family, dtype):
    f = FAMILIES[family]
    cfg = dict(f["cfg"])
    model_type = cfg.pop("model_type")
    config = transformers.AutoConfig.for_model(
        model_type, vocab_size=f["vocab"], hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=512,
        bos_token_id=f["bos"], eos_token_id=f["eos"], pad_token_id=f["pad"], architectures=[f["arch"]], **cfg)
    torch.manual_seed(f["seed"])
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    # Larger weights than the default init (std 0.02) so that next-token distributions are peaked.
    # Drawn in float32 from one seeded generator in parameter order, then rounded to the storage
    # dtype: llama-f32, llama-bf16 and llama-f16 are the same model at three precisions.
    # Gemma scales the embeddings by sqrt(hidden) and ties them to the output: with the same std
    # the residual stream stays mostly the input token's embedding and a greedy run repeats the
    # input token, so gemma3 gets smaller embeddings, post-norms of about 3 and a final norm of
    # about 4 instead (gemma's norms multiply by 1 + w).
    g = torch.Generator().manual_seed(f["seed"])
    gemma = model_type.startswith("gemma")
    with torch.no_grad():
        for name, p in model.named_parameters():  # a tied lm_head is not listed twice
            if name.endswith("norm.weight"):
                mean = (3.0 if name == "model.norm.weight" else 2.0 if ".post_" in name else 0.0) if gemma else 1.0
                p.copy_(mean + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith(".bias"):
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
            else:
                std = (0.1 if gemma else 0.3) if "embed_tokens" in name or "lm_head" in name else 0.15
                p.copy_(std * torch.randn(p.shape, generator=g))
    return model.to(DTYPES[dtype])


def save_checkpoint(name, out):
    family, dtype = CHECKPOINTS[name]
    f = FAMILIES[family]
    d = out / name
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    tok, spm_model = f["tokenizer"]
    tok.save_pretrained(d, save_jinja_files=False)  # chat_template in tokenizer_config.json
    # drop what only describes where this run loaded it from; say BOS explicitly as the real
    # SentencePiece families' files do
    tc = json.loads((d / "tokenizer_config.json").read_text())
    for k in ("is_local", "local_files_only", "vocab_file"):
        tc.pop(k, None)
    if spm_model:
        tc |= {"add_bos_token": True, "add_eos_token": False}
    # transformers 4 wrote the added tokens here too, and llama.cpp's converter reads them from here
    # (without them it takes SentencePiece's user-defined pieces for normal text)
    keys = ("content", "lstrip", "normalized", "rstrip", "single_word", "special")
    tc["added_tokens_decoder"] = {str(t["id"]): {k: t[k] for k in keys}
                                  for t in json.loads((d / "tokenizer.json").read_text())["added_tokens"]}
    (d / "tokenizer_config.json").write_text(json.dumps(dict(sorted(tc.items())), indent=2, ensure_ascii=False) + "\n")
    if spm_model:
        (d / "tokenizer.model").write_bytes(spm_model)
    model = make_model(family, dtype)
    if name in SHARDED:
        # just over half of the bytes per shard: two shards
        total = sum(t.numel() * t.element_size() for t in model.state_dict().values() if t is not None)
        model.save_pretrained(d, max_shard_size=int(total * 0.6))
        assert sorted(p.name for p in d.glob("*.safetensors")) == [
            "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"], list(d.iterdir())
    else:
        model.save_pretrained(d)
        assert (d / "model.safetensors").is_file()
    return d


# ---------------------------------------------------------------------------------- reference

@contextlib.contextmanager
def float32_is_float64():
    """While active, a request for float32 (Tensor.to, Tensor.float, softmax's dtype) gets float64."""
    to, softmax = torch.Tensor.to, torch.nn.functional.softmax
    own = {n: torch.Tensor.__dict__.get(n) for n in ("to", "float")}  # None: inherited from C
    f64 = lambda t: torch.float64 if t is torch.float32 else t

    def to64(self, *a, **k):
        return to(self, *map(f64, a), **{n: f64(v) for n, v in k.items()})
    torch.Tensor.to, torch.Tensor.float = to64, lambda self, *a, **k: to(self, torch.float64)
    torch.nn.functional.softmax = lambda x, *a, dtype=None, **k: softmax(x, *a, dtype=f64(dtype), **k)
    try:
        yield
    finally:
        torch.nn.functional.softmax = softmax
        for n, v in own.items():
            if v is None:
                delattr(torch.Tensor, n)
            else:
                setattr(torch.Tensor, n, v)


def strict_float64(model):
    """transformers' float64 model without its float32 islands: RoPE's inverse frequencies (computed
    in float32 at init) recomputed in float64, every other floating buffer cast to float64, and the
    forward run under float32_is_float64() (transformers computes RoPE's cos/sin, RMSNorm and the
    eager attention softmax in float32 whatever the model's dtype). Returns the model's callable."""
    c = model.config
    dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    for mod in model.modules():
        for name, b in list(mod.named_buffers(recurse=False)):
            if name.endswith("inv_freq"):  # inv_freq, original_inv_freq, full_attention_inv_freq...
                layer_type = name.removesuffix("inv_freq").removesuffix("_").removesuffix("original").removesuffix("_")
                rp = c.rope_parameters[layer_type] if layer_type else c.rope_parameters
                assert rp["rope_type"] == "default" and b.numel() == dim // 2, (name, rp)
                setattr(mod, name, 1.0 / rp["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
            elif b.is_floating_point():
                setattr(mod, name, b.to(torch.float64))

    def call(*a, **k):
        with float32_is_float64():
            return model(*a, **k)
    return call


def logprobs(model, ids):
    with torch.no_grad():
        logits = model(torch.tensor([ids]), use_cache=False).logits[0]
    return torch.log_softmax(logits.to(torch.float64), dim=-1)


def greedy(model, ids):
    """The free greedy continuation, recomputed from scratch each step (no KV cache), EOS ignored."""
    seq = list(ids)
    for _ in range(STEPS):
        seq.append(int(logprobs(model, seq)[-1].argmax()))
    return seq[len(ids):]


def forced(model, ids, ref):
    lp = logprobs(model, ids + ref)[len(ids) - 1:len(ids) - 1 + STEPS]
    steps = []
    for row, t in zip(lp, ref):
        top = torch.topk(row, 5)
        v, i = top.values.tolist(), top.indices.tolist()
        steps.append({"token": t, "logprob": row[t].item(), "top": [[a, b] for a, b in zip(i, v)], "margin": v[0] - v[1]})
    return steps


def prompts(family):
    tok = FAMILIES[family]["tokenizer"][0]
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    out = [(t, None, True) for t in (
        "The quick brown fox jumps over the lazy dog",
        "Once upon a time, there was",
        "In 2024, 3 robots cost $4.50 — naïve café!")]
    out.append((tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True), chat, False))
    return out


RUN_TEXT = {
    "f64": "from_pretrained(dtype=torch.float64): weights upcast exactly, float64 wherever transformers computes "
           "in the model's dtype (it keeps RoPE's inverse frequencies and cos/sin, RMSNorm and the attention softmax "
           "in float32)",
    "f64_strict": "as f64, with those float32 islands made float64 too (hf_checkpoints.py: strict_float64): "
                  "float64 throughout",
    "f32": "from_pretrained(dtype=torch.float32): weights upcast exactly (bf16/f16 checkpoints: the 'stored "
           "weights, float32 compute' form), compute in float32",
    "native": "from_pretrained(dtype=<storage dtype>): weights and compute in bfloat16/float16 as stored",
}


def reference(name, out, gguf):
    family, dtype = CHECKPOINTS[name]
    f = FAMILIES[family]
    d = out / name
    tok = AutoTokenizer.from_pretrained(d)
    runs = {"f64": torch.float64, "f64_strict": torch.float64, "f32": torch.float32}
    runs |= {"native": DTYPES[dtype]} if dtype != "f32" else {}
    loaded = {r: AutoModelForCausalLM.from_pretrained(d, dtype=t, attn_implementation="eager").eval()
              for r, t in runs.items()}
    config = loaded["f32"].config
    loaded["f64_strict"] = strict_float64(loaded["f64_strict"])
    check = tokenizers.Tokenizer.from_file(str(d / "tokenizer.json"))
    recs = []
    for text, chat, special in prompts(family):
        ids = tok(text, add_special_tokens=special)["input_ids"]
        # the engine reads tokenizer.json alone: it must say what transformers does
        assert check.encode(text, add_special_tokens=special).ids == ids, (name, text)
        assert 5 <= len(ids) <= 40, (name, text, len(ids))
        ref = greedy(loaded["f64"], ids)
        rec = {"text": text, "chat": chat, "add_special_tokens": special, "ids": ids, "reference": ref, "runs": {}}
        for r, m in loaded.items():
            rec["runs"][r] = {"greedy": ref if r == "f64" else greedy(m, ids), "forced": forced(m, ids, ref)}
        recs.append(rec)
    summary = {"margin_ok": sum(s["margin"] >= 1e-3 for p in recs for s in p["runs"]["f64"]["forced"]),
               "total_steps": STEPS * len(recs), "runs": {}}
    for r in runs:
        summary["runs"][r] = {"greedy_equal": sum(p["runs"][r]["greedy"] == p["reference"] for p in recs)}
        for base in ("f64", "f64_strict"):
            d_lp = [abs(a["logprob"] - b["logprob"]) for p in recs
                    for a, b in zip(p["runs"][r]["forced"], p["runs"][base]["forced"])]
            summary["runs"][r][f"vs_{base}"] = {"mean_abs_dlogprob": sum(d_lp) / len(d_lp), "max_abs_dlogprob": max(d_lp)}
    c = config
    rope = c.rope_parameters
    return {
        "schema": 1, "name": name, "checkpoint": name, "architecture": f["arch"], "model_type": c.model_type, "seed": f["seed"],
        "dtype": str(DTYPES[dtype]).removeprefix("torch."), "sharded": name in SHARDED,
        "versions": {"python": sys.version.split()[0], "torch": torch.__version__,
                     "transformers": transformers.__version__, "tokenizers": tokenizers.__version__,
                     "safetensors": safetensors.__version__, "sentencepiece": spm.__version__},
        "attn_implementation": "eager", "torch_threads": torch.get_num_threads(),
        "config": {"layers": c.num_hidden_layers, "hidden": c.hidden_size, "intermediate": c.intermediate_size,
                   "heads": c.num_attention_heads, "kv_heads": c.num_key_value_heads,
                   "head_dim": getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
                   "vocab": c.vocab_size, "tied_embeddings": c.tie_word_embeddings,
                   "rope_theta": {k: v["rope_theta"] for k, v in rope.items()} if "full_attention" in rope
                   else rope["rope_theta"], "rms_norm_eps": c.rms_norm_eps,
                   "sliding_window": getattr(c, "sliding_window", None) if family == "gemma3" else None,
                   "layer_types": c.layer_types if family == "gemma3" else None},
        "tokenizer": f["tokenizer_text"],
        "logprobs": "log_softmax(logits.to(torch.float64)) of one forward over the whole sequence, no KV cache",
        "runs": {r: RUN_TEXT[r] for r in runs}, "reference_run": "f64", "steps": STEPS, "gguf": gguf,
        "prompts": recs, "summary": summary,
    }


def convert(name, out):
    """llama.cpp's converter on the checkpoint, through scripts/ref/hf_convert.py (which names the
    pre-tokenizer that the converter's hash table does not know: ours are trained here)."""
    family, dtype = CHECKPOINTS[name]
    pre = LLAMA_CPP_PRE.get(FAMILIES[family]["tok"], "-")
    root = Path(__file__).resolve().parents[2]
    rel = lambda p: os.path.relpath(p, root)
    cmd = ["scripts/ref/hf_convert.py", pre, "--outtype", dtype, "--outfile", rel(out / f"{name}.gguf"), rel(out / name)]
    r = subprocess.run([sys.executable, *cmd], cwd=root, capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"conversion of {name} failed:\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}")
    src = str(LLAMA_CPP).replace(str(Path.home()), "$HOME")
    return {"file": f"{name}.gguf", "outtype": dtype,
            "command": f"DGR_LLAMA_CPP_SRC={src} {rel(sys.executable)} " + " ".join(cmd)}


def main():
    out = Path(sys.argv[1])
    names = sys.argv[2:] or list(CHECKPOINTS)
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)  # gentle, and the float32 bits do not depend on a thread count
    with tempfile.TemporaryDirectory() as tmp:
        for family in sorted({CHECKPOINTS[n][0] for n in names}):
            f = FAMILIES[family]
            kind = f["tok"]
            if kind in ("llama3", "qwen2"):
                f["tokenizer"] = (byte_bpe(kind), None)
                f["tokenizer_text"] = (f"byte-level BPE ({'Llama 3' if kind == 'llama3' else 'Qwen2'} pre-tokenizer regex) "
                                       "trained with tokenizers' BpeTrainer on the script's corpus")
            else:
                f["tokenizer"] = sentencepiece_bpe(kind, tmp)
                f["tokenizer_text"] = ("SentencePiece BPE with byte fallback trained on the script's corpus "
                                       f"(tokenizer.model), tokenizer.json from transformers' {type(f['tokenizer'][0]).__name__}")
            tok = f["tokenizer"][0]
            f["vocab"] = len(tok)
            f["bos"], f["eos"], f["pad"] = tok.bos_token_id, tok.eos_token_id, tok.pad_token_id
        for name in names:
            d = save_checkpoint(name, out)
            gguf = convert(name, out) if CHECKPOINTS[name][1] in ("f32", "bf16") else None
            ref = reference(name, out, gguf)
            (out / f"{name}.ref.json").write_text(json.dumps(ref, indent=1, ensure_ascii=False) + "\n")
            s = ref["summary"]
            print(f"{name}: margin>=1e-3 {s['margin_ok']}/{s['total_steps']}; |dlogprob| mean/max against f64, f64_strict; "
                  + "; ".join(f"{r} {v['vs_f64']['mean_abs_dlogprob']:.2g}/{v['vs_f64']['max_abs_dlogprob']:.2g}, "
                              f"{v['vs_f64_strict']['mean_abs_dlogprob']:.2g}/{v['vs_f64_strict']['max_abs_dlogprob']:.2g} "
                              f"greedy= {v['greedy_equal']}/{len(ref['prompts'])}" for r, v in s["runs"].items() if r != "f64"),
                  flush=True)


if __name__ == "__main__":
    main()
