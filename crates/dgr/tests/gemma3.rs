//! gemma-3-270m (Q4_K_M) held against llama.cpp and the exact float64 computation of the same
//! weights: its tokenizer, teacher-forced log-probabilities, routes cut inside the
//! sliding-window pattern, and a session longer than the 512-position window.
#![cfg(feature = "real-model")]

mod common;
use common::*;
use serde_json::Value;
use std::time::Duration;

const LLAMA: &str = "gemma3-270m-q4_k_m-llamacpp.json";
const EXACT: &str = "gemma3-270m-q4_k_m-exact.json";
/// One prompt of ~700 tokens and 16 greedy tokens (scripts/ref/ made both files).
const LONG_LLAMA: &str = "gemma3-long-llamacpp.json";
const LONG_EXACT: &str = "gemma3-long-exact.json";

/// A step is clear when the exact computation's top two differ by more than this: there every
/// faithful implementation picks the same token (dgr's own error is about 1e-5).
const CLEAR_MARGIN: f64 = 0.02;

fn completions(v: &Value) -> &[Value] {
    v["completions"].as_array().expect("completions")
}

fn ids32(v: &Value) -> Vec<u32> {
    ids(v).into_iter().map(|t| t as u32).collect()
}

/// `dgr ARGS --model <gemma3>`, parsed as JSON; fails the test on a non-zero exit.
fn dgr_gemma(args: &[&str]) -> Value {
    let mut cmd = dgr();
    cmd.args(args).arg("--model").arg(gemma3_model());
    let out = Proc::spawn(cmd).wait_within(Duration::from_secs(900));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "dgr {args:?} failed ({:?}): {stdout}{}", out.status, String::from_utf8_lossy(&out.stderr));
    serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("dgr {args:?} printed no JSON ({e}): {stdout}"))
}

fn generate(args: &[&str]) -> Value {
    let mut all = vec!["generate", "--format", "json"];
    all.extend_from_slice(args);
    dgr_gemma(&all)
}

/// Teacher-forced steps of `continuation` after `prompt`, as `dgr score` gives them in exact
/// numerics: the near-exact bars below are f32 activations' (`accuracy_fast.rs` holds the
/// default, fast, to its own).
fn score(prompt: &str, continuation: &[u64]) -> Value {
    let cont: Vec<String> = continuation.iter().map(u64::to_string).collect();
    let args =
        ["score", "--prompt", prompt, "--continuation", &cont.join(","), "--top-logprobs", "5", "--threads", "2", "--numerics", "exact"];
    dgr_gemma(&args)
}

/// A step's logprob, from any of the formats: references (`logprob`) and `dgr score`'s.
fn logprob(step: &Value) -> f64 {
    step["logprob"].as_f64().expect("logprob")
}

fn top1(step: &Value) -> u64 {
    step["top"][0][0].as_u64().expect("top")
}

fn margin(step: &Value) -> f64 {
    step["top"][0][1].as_f64().unwrap() - step["top"][1][1].as_f64().unwrap()
}

/// Mean and max |Δ logprob| between two runs' steps on the same tokens.
fn distance(a: &[Value], b: &[Value]) -> (f64, f64) {
    assert_eq!(a.len(), b.len());
    let d: Vec<f64> = a.iter().zip(b).map(|(x, y)| (logprob(x) - logprob(y)).abs()).collect();
    (d.iter().sum::<f64>() / d.len() as f64, d.iter().cloned().fold(0.0, f64::max))
}

/// How many leading steps of a greedy run must equal the reference's tokens: up to the first
/// step that is not clear, or where the reference's token is not the exact argmax.
fn clear_prefix(reference_tokens: &[u64], exact: &[Value]) -> usize {
    exact.iter().zip(reference_tokens).take_while(|(e, t)| margin(e) > CLEAR_MARGIN && top1(e) == **t).count()
}

// ---------------------------------------------------------------------------------------------
// (a) The tokenizer

#[test]
fn tokenization_equals_llama_cpp_on_every_string() {
    let g = dgr_gguf::Gguf::open(&gemma3_model()).expect("opening the gemma3 model");
    let tok = dgr_tokenizer::Tokenizer::from_gguf(&g).expect("the gemma3 tokenizer");
    let llama = reference(LLAMA);
    let cases = llama["tokenize"].as_array().expect("tokenize");
    assert_eq!(cases.len(), 20);
    for case in cases {
        let text = case["text"].as_str().unwrap();
        let got = tok.encode(text, false, true).unwrap();
        assert_eq!(got, ids32(&case["tokens"]), "tokenizing {text:?}");
        assert_eq!(tok.decode(&got), text, "decoding the tokens of {text:?}");
    }
    let long = reference(LONG_LLAMA);
    let prompts = completions(&llama).iter().chain(completions(&long));
    let mut n = 0;
    for c in prompts {
        let prompt = c["prompt"].as_str().unwrap();
        // As llama.cpp tokenizes a completion prompt: BOS first, special tokens parsed.
        assert_eq!(tok.encode_prompt(prompt).unwrap(), ids32(&c["prompt_tokens"]), "the prompt {:?}", c["name"]);
        n += 1;
    }
    assert_eq!(n, 7);
    assert_eq!((tok.bos(), tok.eos(), tok.vocab_size()), (Some(2), Some(1), 262_144));
    assert!(tok.is_eog(106), "<end_of_turn> ends generation");
}

// ---------------------------------------------------------------------------------------------
// (b) Accuracy

#[test]
fn teacher_forced_logprobs_are_more_accurate_than_llama_cpp() {
    let _serial = serial();
    let exact = reference(EXACT);
    let llama = reference(LLAMA);
    let (mut ours_sum, mut llama_sum, mut n) = (0.0, 0.0, 0usize);
    for (e, l) in completions(&exact).iter().zip(completions(&llama)) {
        let name = e["name"].as_str().unwrap();
        assert_eq!(l["name"], e["name"]);
        let cont = ids(&e["continuation"]);
        assert_eq!(cont, ids(&l["greedy_tokens"]), "{name}: the exact file scores llama.cpp's tokens");
        let out = score(e["prompt"].as_str().unwrap(), &cont);
        assert_eq!(ids(&out["prompt_tokens"]), ids(&l["prompt_tokens"]), "{name}: prompt tokenization differs from llama.cpp");
        let (steps, exact_steps) = (out["steps"].as_array().unwrap(), e["steps"].as_array().unwrap());
        for (i, (o, x)) in steps.iter().zip(exact_steps).enumerate() {
            assert_eq!(o["token"], x["id"], "{name}: step {i} scores another token");
            if margin(x) > CLEAR_MARGIN {
                assert_eq!(top1(o), top1(x), "{name}: step {i}: argmax differs from exact's, whose margin is {}", margin(x));
            }
        }
        let (mean, max) = distance(steps, exact_steps);
        let (llama_mean, llama_max) = distance(l["steps"].as_array().unwrap(), exact_steps);
        println!("{name:>8}: mean |Δ logprob| vs exact: dgr {mean:.6} (max {max:.6}), llama.cpp {llama_mean:.4} (max {llama_max:.4})");
        assert!(mean <= llama_mean, "{name}: dgr's mean |Δ logprob| {mean} is worse than llama.cpp's {llama_mean}");
        assert!(max <= llama_max, "{name}: dgr's max |Δ logprob| {max} is worse than llama.cpp's {llama_max}");
        // The bar f32 activations reach on this model: near-exact.
        assert!(mean <= 1e-4 && max <= 1e-3, "{name}: dgr drifted from the exact computation");
        ours_sum += mean * steps.len() as f64;
        llama_sum += llama_mean * steps.len() as f64;
        n += steps.len();
    }
    let (ours, theirs) = (ours_sum / n as f64, llama_sum / n as f64);
    println!("overall: mean |Δ logprob| vs exact: dgr {ours:.6}, llama.cpp {theirs:.4}");
    assert!(ours <= theirs);
}

#[test]
fn greedy_generation_follows_llama_cpp_wherever_the_choice_is_clear() {
    let _serial = serial();
    let exact = reference(EXACT);
    for (e, l) in completions(&exact).iter().zip(completions(&reference(LLAMA))) {
        let name = e["name"].as_str().unwrap();
        let want = ids(&l["greedy_tokens"]);
        let n = want.len().to_string();
        let out = generate(&["--prompt", e["prompt"].as_str().unwrap(), "--max-tokens", &n, "--ignore-eos", "--threads", "2"]);
        let got = ids(&out["tokens"]);
        let clear = clear_prefix(&want, e["steps"].as_array().unwrap());
        assert_eq!(got[..clear], want[..clear], "{name}: greedy tokens differ from llama.cpp's within the first {clear} clear steps");
        let same = got.iter().zip(&want).take_while(|(a, b)| a == b).count();
        println!("{name:>8}: {same} of {} greedy tokens as llama.cpp's ({clear} required: clear steps before any near-tie)", want.len());
    }
}

// ---------------------------------------------------------------------------------------------
// (c) Routes cut inside the sliding-window pattern (layers 5, 11 and 17 are the global ones)

#[test]
fn a_route_cut_inside_the_window_pattern_equals_one_process_bitwise() {
    let _serial = serial();
    let llama = reference(LLAMA);
    let prompts: Vec<&str> = completions(&llama)
        .iter()
        .filter(|c| ["chat", "code", "long"].contains(&c["name"].as_str().unwrap()))
        .map(|c| c["prompt"].as_str().unwrap())
        .collect();
    let common = ["--max-tokens", "8", "--ignore-eos", "--top-logprobs", "5"];
    let whole: Vec<Value> = prompts
        .iter()
        .map(|p| {
            let mut a = vec!["--prompt", p, "--threads", "1"];
            a.extend(common);
            generate(&a)
        })
        .collect();
    for cuts in [&[0, 4, 18][..], &[0, 7, 13, 18]] {
        let w = Workers::start_on(&vec![gemma3_model(); cuts.len() - 1], cuts, 1, &[]);
        let route = w.route();
        for (p, want) in prompts.iter().zip(&whole) {
            let mut a = vec!["--prompt", p, "--route", &route];
            a.extend(common);
            let got = generate(&a);
            assert_same_generation(&got, want, &format!("over {}", layers_of(cuts)));
        }
        println!("{}: {} prompts, 8 tokens each, identical to one process", layers_of(cuts), prompts.len());
    }
}

// ---------------------------------------------------------------------------------------------
// (d) Past the window

#[test]
fn a_session_longer_than_the_window_matches_llama_cpp_past_it() {
    let _serial = serial();
    let (llama, exact) = (reference(LONG_LLAMA), reference(LONG_EXACT));
    let (l, e) = (&completions(&llama)[0], &completions(&exact)[0]);
    let prompt = l["prompt"].as_str().unwrap();
    let prompt_len = ids(&l["prompt_tokens"]).len();
    assert!(prompt_len > 512 + 128, "the prompt ({prompt_len} tokens) reaches well past the window");
    let want = ids(&l["greedy_tokens"]);
    let (llama_steps, exact_steps) = (l["steps"].as_array().unwrap(), e["steps"].as_array().unwrap());
    assert_eq!(ids(&e["continuation"]), want);

    // Greedy decoding, the whole prompt in one forward.
    let n = want.len().to_string();
    let args = ["--prompt", prompt, "--max-tokens", n.as_str(), "--ignore-eos", "--top-logprobs", "5"];
    let mut a = args.to_vec();
    a.extend(["--threads", "2"]);
    let whole = generate(&a);
    assert_eq!(ids(&whole["prompt_tokens"]), ids(&l["prompt_tokens"]));
    let got = ids(&whole["tokens"]);
    let clear = clear_prefix(&want, exact_steps);
    assert_eq!(got[..clear], want[..clear], "greedy tokens differ from llama.cpp's within the first {clear} clear steps");
    let same = got.iter().zip(&want).take_while(|(a, b)| a == b).count();
    // Where the tokens agree, the logprobs are llama.cpp's within its own error: ~0.1, more
    // where llama.cpp strays further from the exact computation.
    let lps = whole["logprobs"].as_array().unwrap();
    for (i, ((lp, s), x)) in lps.iter().zip(llama_steps).zip(exact_steps).take(same).enumerate() {
        let d = (lp.as_f64().unwrap() - logprob(s)).abs();
        let allowed = f64::max(0.1, (logprob(s) - logprob(x)).abs() + 0.01);
        assert!(d <= allowed, "step {i}: logprob {lp} is {d} from llama.cpp's {}", logprob(s));
    }
    println!("{prompt_len} prompt tokens: {same} of {} greedy tokens as llama.cpp's ({clear} required)", want.len());

    // Teacher-forced on llama.cpp's tokens, against the exact computation.
    let out = score(prompt, &want);
    let steps = out["steps"].as_array().unwrap();
    let (mean, max) = distance(steps, exact_steps);
    let (llama_mean, llama_max) = distance(llama_steps, exact_steps);
    println!("past the window: mean |Δ logprob| vs exact: dgr {mean:.6} (max {max:.6}), llama.cpp {llama_mean:.4} (max {llama_max:.4})");
    assert!(mean <= llama_mean && max <= llama_max, "dgr is less accurate than llama.cpp past the window");
    assert!(mean <= 1e-4 && max <= 1e-3, "dgr drifted from the exact computation past the window");

    // A route cut inside the pattern whose workers prefill 64 rows a step: the window slides
    // within and across forwards, and the output is still the one process's, bit for bit.
    let cuts = [0, 7, 13, 18];
    let w = Workers::start_on(&vec![gemma3_model(); 3], &cuts, 1, &["--prefill-chunk", "64"]);
    let route = w.route();
    let mut a = args.to_vec();
    a.extend(["--route", &route]);
    assert_same_generation(&generate(&a), &whole, &format!("the long prompt in chunks of 64 over {}", layers_of(&cuts)));
}
