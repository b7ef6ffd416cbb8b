//! Tiny hand-made vocabularies with answers worked out by hand from
//! llama.cpp's algorithms.

use dgr_tokenizer::{ChatMessage, SpecialIds, Tokenizer, TokenizerConfig, TokenizerError};

fn id(tokens: &[&str], text: &str) -> u32 {
    tokens.iter().position(|t| *t == text).unwrap() as u32
}

const BPE_TOKENS: &[&str] = &["a", "b", "c", "Ġ", "ab", "bc", "abc", "Ġa", "aa", "<|end|>", "<u>", "<", "|"];

fn bpe_config(merges: &[&str]) -> TokenizerConfig {
    let mut types = vec![1; BPE_TOKENS.len()];
    types[id(BPE_TOKENS, "<|end|>") as usize] = 3;
    types[id(BPE_TOKENS, "<u>") as usize] = 4;
    TokenizerConfig {
        model: "gpt2".into(),
        pre: Some("gpt-2".into()),
        tokens: BPE_TOKENS.iter().map(|s| s.to_string()).collect(),
        token_types: Some(types),
        merges: Some(merges.iter().map(|s| s.to_string()).collect()),
        ..Default::default()
    }
}

fn bpe(merges: &[&str]) -> Tokenizer {
    Tokenizer::from_config(bpe_config(merges)).unwrap()
}

fn bpe_ids(texts: &[&str]) -> Vec<u32> {
    texts.iter().map(|t| id(BPE_TOKENS, t)).collect()
}

#[test]
fn bpe_merges_lowest_rank_first() {
    let tok = bpe(&["b c", "a b", "ab c", "Ġ a", "a a"]);
    assert_eq!(tok.encode("abc", false, false).unwrap(), bpe_ids(&["a", "bc"]));
    let tok = bpe(&["a b", "b c", "ab c", "Ġ a", "a a"]);
    assert_eq!(tok.encode("abc", false, false).unwrap(), bpe_ids(&["abc"]));
    assert_eq!(tok.encode("cab a", false, false).unwrap(), bpe_ids(&["c", "ab", "Ġa"]));
}

#[test]
fn bpe_breaks_ties_leftmost() {
    let tok = bpe(&["a a"]);
    assert_eq!(tok.encode("aaa", false, false).unwrap(), bpe_ids(&["aa", "a"]));
    assert_eq!(tok.encode("aaaaa", false, false).unwrap(), bpe_ids(&["aa", "aa", "a"]));
}

#[test]
fn bpe_drops_bytes_without_tokens() {
    // llama.cpp emits nothing for a byte whose encoded char is not a token
    let tok = bpe(&["a b"]);
    assert_eq!(tok.encode("axb", false, false).unwrap(), bpe_ids(&["a", "b"]));
    assert_eq!(tok.encode("é", false, false).unwrap(), Vec::<u32>::new());
}

#[test]
fn bpe_special_tokens() {
    let tok = bpe(&["a b"]);
    let end = id(BPE_TOKENS, "<|end|>");
    let user = id(BPE_TOKENS, "<u>");
    assert_eq!(tok.encode("ab<|end|>c", false, true).unwrap(), vec![id(BPE_TOKENS, "ab"), end, 2]);
    // unparsed control text is plain text; user-defined tokens always match
    assert_eq!(tok.encode("<|end|>", false, false).unwrap(), bpe_ids(&["<", "|", "|"]));
    assert_eq!(tok.encode("a<u>b", false, false).unwrap(), vec![0, user, 1]);
    assert!(tok.is_eog(end));
    assert!(!tok.is_eog(0));
    assert_eq!(tok.token_bytes(end).unwrap(), b"<|end|>");
    assert_eq!(tok.token_bytes(id(BPE_TOKENS, "Ġa")).unwrap(), b" a");
    // gpt2 models get no BOS unless the metadata asks; id 11 is llama.cpp's default
    assert_eq!(tok.bos(), Some(11));
    assert_eq!(tok.encode_prompt("ab").unwrap(), bpe_ids(&["ab"]));
}

#[test]
fn bpe_add_bos_from_metadata() {
    let mut cfg = bpe_config(&["a b"]);
    cfg.special.bos = Some(id(BPE_TOKENS, "<|end|>"));
    cfg.add_bos = Some(true);
    let tok = Tokenizer::from_config(cfg).unwrap();
    assert_eq!(tok.encode_prompt("ab").unwrap(), vec![9, 4]);
}

const SPM_TOKENS: &[(&str, f32, i32)] = &[
    ("<unk>", 0.0, 2),
    ("<s>", 0.0, 3),
    ("</s>", 0.0, 3),
    ("<0x0A>", 0.0, 6),
    ("<0xC3>", 0.0, 6),
    ("<0xA9>", 0.0, 6),
    ("▁", -10.0, 1),
    ("h", -10.0, 1),
    ("e", -10.0, 1),
    ("l", -10.0, 1),
    ("o", -10.0, 1),
    ("▁h", -3.0, 1),
    ("el", -2.0, 1),
    ("ll", -1.0, 1),
    ("lo", -4.0, 1),
    ("▁he", -2.5, 1),
    ("llo", -0.5, 1),
    ("a", -1.0, 1),
    ("aa", -1.0, 1),
];

fn spm(add_space_prefix: Option<bool>) -> Tokenizer {
    Tokenizer::from_config(TokenizerConfig {
        model: "llama".into(),
        tokens: SPM_TOKENS.iter().map(|t| t.0.to_string()).collect(),
        scores: Some(SPM_TOKENS.iter().map(|t| t.1).collect()),
        token_types: Some(SPM_TOKENS.iter().map(|t| t.2).collect()),
        add_space_prefix,
        ..Default::default()
    })
    .unwrap()
}

fn spm_ids(texts: &[&str]) -> Vec<u32> {
    let names: Vec<&str> = SPM_TOKENS.iter().map(|t| t.0).collect();
    texts.iter().map(|t| id(&names, t)).collect()
}

#[test]
fn spm_merges_highest_score_first() {
    let tok = spm(None);
    // ▁hello: ll(-1), then llo(-0.5), then ▁h(-3), then ▁he(-2.5); el and lo go stale
    assert_eq!(tok.encode("hello", false, false).unwrap(), spm_ids(&["▁he", "llo"]));
    assert_eq!(tok.decode(&tok.encode("hello", false, false).unwrap()), " hello");
}

#[test]
fn spm_byte_fallback() {
    let tok = spm(None);
    let ids = tok.encode("héllo\n", false, false).unwrap();
    assert_eq!(ids, spm_ids(&["▁h", "<0xC3>", "<0xA9>", "llo", "<0x0A>"]));
    assert_eq!(tok.decode(&ids), " héllo\n");
    assert!(matches!(tok.encode("z", false, false), Err(TokenizerError::MissingByteToken(b'z'))));
}

#[test]
fn spm_space_prefix_and_bos() {
    let tok = spm(None);
    // BOS by default for SPM; the dummy prefix also follows special tokens
    assert_eq!(tok.encode_prompt("hello").unwrap(), spm_ids(&["<s>", "▁he", "llo"]));
    assert_eq!(tok.encode("</s>hello", false, true).unwrap(), spm_ids(&["</s>", "▁he", "llo"]));
    assert_eq!(tok.token_bytes(1).unwrap(), b"<s>");
    assert!(tok.is_eog(2));
    // ties go to the leftmost pair
    let tok = spm(Some(false));
    assert_eq!(tok.encode("aaa", false, false).unwrap(), spm_ids(&["aa", "a"]));
}

#[test]
fn invalid_metadata_is_an_error() {
    let build = |f: &dyn Fn(&mut TokenizerConfig)| {
        let mut cfg = bpe_config(&["a b"]);
        f(&mut cfg);
        Tokenizer::from_config(cfg).unwrap_err()
    };
    assert!(matches!(build(&|c| c.tokens.clear()), TokenizerError::EmptyVocab));
    assert!(matches!(build(&|c| c.tokens[1] = "a".into()), TokenizerError::DuplicateToken { first: 0, second: 1, .. }));
    assert!(matches!(build(&|c| c.merges = Some(vec!["a zz".into()])), TokenizerError::BadMerge { index: 0, .. }));
    assert!(matches!(build(&|c| c.merges = Some(vec!["ab".into()])), TokenizerError::BadMerge { .. }));
    assert!(matches!(build(&|c| c.merges = None), TokenizerError::MissingKey(_)));
    assert!(matches!(
        build(&|c| c.special = SpecialIds { eos: Some(99), ..Default::default() }),
        TokenizerError::TokenIdOutOfRange { id: 99, .. }
    ));
    assert!(matches!(build(&|c| c.token_types = Some(vec![1])), TokenizerError::LengthMismatch { .. }));
    assert!(matches!(build(&|c| c.model = "bert".into()), TokenizerError::UnsupportedModel(_)));
    assert!(matches!(build(&|c| c.pre = Some("nope".into())), TokenizerError::UnsupportedPreTokenizer(_)));
    // the default BOS id 11 is out of range for a 10-token vocabulary
    assert!(matches!(
        build(&|c| {
            c.tokens.truncate(10);
            c.token_types = None;
            c.add_bos = Some(true);
        }),
        TokenizerError::MissingBos
    ));
}

#[test]
fn chat_template_errors() {
    let tok = bpe(&["a b"]);
    let msgs = [ChatMessage::new("user", "hi")];
    assert!(matches!(tok.apply_chat_template(&msgs, true), Err(TokenizerError::NoChatTemplate)));

    let mut cfg = bpe_config(&["a b"]);
    cfg.chat_template =
        Some("{% if messages|length > 1 %}{{ raise_exception('one only') }}{% endif %}{{ messages[0].content.strip() }}".into());
    let tok = Tokenizer::from_config(cfg).unwrap();
    assert_eq!(tok.apply_chat_template(&[ChatMessage::new("user", "  hi ")], false).unwrap(), "hi");
    assert!(matches!(tok.apply_chat_template(&[msgs[0].clone(), msgs[0].clone()], false), Err(TokenizerError::Template(_))));
}
