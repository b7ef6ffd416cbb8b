//! The SmolLM2 tokenizer against token ids recorded from llama.cpp.
#![cfg(feature = "real-model")]

mod common;

use dgr_tokenizer::ChatMessage;
use serde_json::Value;

fn reference() -> Value {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/data/smollm2-q4_1-llamacpp.json");
    serde_json::from_str(&std::fs::read_to_string(path).expect("read reference data")).expect("parse reference data")
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

#[test]
fn tokenize_matches_llama_cpp() {
    let tok = common::smollm();
    let cases = reference()["tokenize"].as_array().unwrap().clone();
    assert!(!cases.is_empty());
    for case in &cases {
        let text = case["text"].as_str().unwrap();
        assert_eq!(tok.encode(text, false, true).unwrap(), ids(&case["tokens"]), "text {text:?}");
    }
}

#[test]
fn completion_prompts_match_llama_cpp() {
    let tok = common::smollm();
    let cases = reference()["completions"].as_array().unwrap().clone();
    assert!(!cases.is_empty());
    for case in &cases {
        let prompt = case["prompt"].as_str().unwrap();
        assert_eq!(tok.encode_prompt(prompt).unwrap(), ids(&case["prompt_tokens"]), "prompt {prompt:?}");
    }
}

#[test]
fn decode_inverts_encode() {
    let tok = common::smollm();
    let data = reference();
    let texts = data["tokenize"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| &c["text"])
        .chain(data["completions"].as_array().unwrap().iter().map(|c| &c["prompt"]));
    for text in texts {
        let text = text.as_str().unwrap();
        assert_eq!(tok.decode(&tok.encode(text, false, true).unwrap()), text);
        assert_eq!(tok.decode(&tok.encode(text, false, false).unwrap()), text);
    }
}

#[test]
fn special_tokens_and_metadata() {
    let tok = common::smollm();
    assert_eq!(tok.vocab_size(), 49152);
    assert_eq!(tok.bos(), Some(1));
    assert_eq!(tok.eos(), Some(2));
    assert!(tok.is_eog(2)); // <|im_end|>
    assert!(tok.is_eog(0)); // <|endoftext|>
    assert!(!tok.is_eog(1));
    assert!(!tok.is_eog(198));
    assert_eq!(tok.token_bytes(1).unwrap(), b"<|im_start|>");
    assert_eq!(tok.token_bytes(216).unwrap(), b" ");
    assert_eq!(tok.token_bytes(198).unwrap(), b"\n");
    assert_eq!(tok.token_bytes(49152), None);
    // unparsed, control-token text is ordinary text
    let plain = tok.encode("<|im_end|>", false, false).unwrap();
    assert!(plain.len() > 1 && !plain.contains(&2));
    assert_eq!(tok.decode(&plain), "<|im_end|>");
    assert_eq!(tok.encode("hi", true, false).unwrap()[0], 1);
}

#[test]
fn chat_template_renders_chatml() {
    let tok = common::smollm();
    let messages = [ChatMessage::new("user", "What is 2+2?")];
    assert_eq!(
        tok.apply_chat_template(&messages, true).unwrap(),
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n\
         <|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    );
    let messages = [ChatMessage::new("system", "Be brief."), ChatMessage::new("user", "Hi")];
    assert_eq!(
        tok.apply_chat_template(&messages, false).unwrap(),
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    );
}
