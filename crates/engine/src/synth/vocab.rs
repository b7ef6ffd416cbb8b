//! Vocabularies for synthetic models that both dgr's tokenizer and llama.cpp's load: every byte
//! has a token, and the rest of the vocabulary is real merges, so text tokenizes to more than
//! bytes and the merge code paths run.

use super::MIN_VOCAB;
use dgr_gguf::Value;

/// Token types as llama.cpp numbers them.
const NORMAL: i32 = 1;
const UNKNOWN: i32 = 2;
const CONTROL: i32 = 3;
const BYTE: i32 = 6;

/// A vocabulary's metadata entries.
pub(super) type Keys = Vec<(&'static str, Value)>;

/// `n` pieces, each a previous piece (or `space`, or a letter) extended by one letter: "▁a",
/// …, "aa", "ab", …, "▁aa", … — as many as asked for, each mergeable from the ones before.
fn pieces(space: &str, n: usize) -> Vec<(String, String)> {
    let letters: Vec<String> = ('a'..='z').map(String::from).collect();
    let mut heads: Vec<String> = std::iter::once(space.to_owned()).chain(letters.iter().cloned()).collect();
    let mut out = Vec::with_capacity(n);
    let mut i = 0;
    while out.len() < n {
        let left = heads[i].clone();
        for l in letters.iter().take(n - out.len()) {
            out.push((left.clone(), l.clone()));
            heads.push(format!("{left}{l}"));
        }
        i += 1;
    }
    out
}

/// GPT-2's printable stand-in for each byte, so a byte-level vocabulary covers every input.
fn byte_token(b: u8) -> String {
    let printable = |c: u32| (33..=126).contains(&c) || (161..=172).contains(&c) || (174..=255).contains(&c);
    if printable(b as u32) {
        return char::from_u32(b as u32).map(String::from).unwrap_or_default();
    }
    let rank = (0..b as u32).filter(|c| !printable(*c)).count() as u32;
    char::from_u32(256 + rank).map(String::from).unwrap_or_default()
}

/// Byte-level BPE ("gpt2"): the 256 byte tokens, BOS 256, EOS 257, then one token per merge.
pub(super) fn bpe(size: usize, pre: &str) -> Keys {
    let merges = pieces(&byte_token(b' '), size - 258);
    let tokens = (0..=255u8)
        .map(byte_token)
        .chain(["<s>".into(), "</s>".into()])
        .chain(merges.iter().map(|(a, b)| format!("{a}{b}")))
        .map(Value::String)
        .collect();
    let types = (0..size).map(|i| Value::I32(if (256..258).contains(&i) { CONTROL } else { NORMAL })).collect();
    let merges = merges.iter().map(|(a, b)| Value::String(format!("{a} {b}"))).collect();
    vec![
        ("tokenizer.ggml.model", Value::String("gpt2".into())),
        ("tokenizer.ggml.pre", Value::String(pre.into())),
        ("tokenizer.ggml.tokens", Value::Array(tokens)),
        ("tokenizer.ggml.token_type", Value::Array(types)),
        ("tokenizer.ggml.merges", Value::Array(merges)),
        ("tokenizer.ggml.bos_token_id", Value::U32(256)),
        ("tokenizer.ggml.eos_token_id", Value::U32(257)),
        ("tokenizer.ggml.add_bos_token", Value::Bool(false)),
    ]
}

/// SentencePiece ("llama"): UNK 0, BOS 1, EOS 2, the byte fallbacks <0x00>…<0xFF>, then
/// "▁", the letters and their merges, scored so earlier pieces merge first.
pub(super) fn spm(size: usize, add_space_prefix: bool) -> Keys {
    let base = MIN_VOCAB;
    let singles = std::iter::once("▁".to_owned()).chain(('a'..='z').map(String::from));
    let words: Vec<String> =
        singles.chain(pieces("▁", size.saturating_sub(base + 27)).into_iter().map(|(a, b)| a + &b)).take(size - base).collect();
    let tokens = ["<unk>".to_owned(), "<s>".into(), "</s>".into()]
        .into_iter()
        .chain((0..=255u8).map(|b| format!("<0x{b:02X}>")))
        .chain(words)
        .map(Value::String)
        .collect();
    let types = (0..size)
        .map(|i| {
            Value::I32(match i {
                0 => UNKNOWN,
                1 | 2 => CONTROL,
                3..259 => BYTE,
                _ => NORMAL,
            })
        })
        .collect();
    let scores = (0..size).map(|i| Value::F32(if i < base { 0.0 } else { -((i - base) as f32) })).collect();
    vec![
        ("tokenizer.ggml.model", Value::String("llama".into())),
        ("tokenizer.ggml.tokens", Value::Array(tokens)),
        ("tokenizer.ggml.scores", Value::Array(scores)),
        ("tokenizer.ggml.token_type", Value::Array(types)),
        ("tokenizer.ggml.unknown_token_id", Value::U32(0)),
        ("tokenizer.ggml.bos_token_id", Value::U32(1)),
        ("tokenizer.ggml.eos_token_id", Value::U32(2)),
        ("tokenizer.ggml.add_bos_token", Value::Bool(false)),
        ("tokenizer.ggml.add_space_prefix", Value::Bool(add_space_prefix)),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_piece_extends_an_earlier_one() {
        let p = pieces("Ġ", 100);
        assert_eq!(p.len(), 100);
        assert_eq!(p[0], ("Ġ".into(), "a".into()));
        assert_eq!(p[26], ("a".into(), "a".into()));
        let words: Vec<String> = p.iter().map(|(a, b)| format!("{a}{b}")).collect();
        for (i, (left, _)) in p.iter().enumerate() {
            assert!(left.chars().count() == 1 || words[..i].contains(left), "{left} is merged before it exists");
        }
        let mut unique = words.clone();
        unique.sort();
        unique.dedup();
        assert_eq!(unique.len(), words.len());
    }
}
