//! The vocabulary as llama.cpp's `llama_vocab::impl::load` builds it: token
//! attributes, special-token defaults and detection, end-of-generation set,
//! merge ranks, and each token's decoded bytes.

use std::collections::{BTreeSet, HashMap};

use crate::config::TokenizerConfig;
use crate::error::TokenizerError;
use crate::pretokenize::PreTokenizer;
use crate::unicode::char_to_byte;

/// llama.cpp's `llama_token_attr` bits that matter here.
pub(crate) mod attr {
    pub const UNKNOWN: u32 = 1 << 0;
    pub const UNUSED: u32 = 1 << 1;
    pub const NORMAL: u32 = 1 << 2;
    pub const CONTROL: u32 = 1 << 3;
    pub const USER_DEFINED: u32 = 1 << 4;
    pub const BYTE: u32 = 1 << 5;

    /// From a `tokenizer.ggml.token_type` value (`llama_token_type`).
    pub fn from_token_type(t: i32) -> u32 {
        match t {
            1 => NORMAL,
            2 => UNKNOWN,
            3 => CONTROL,
            4 => USER_DEFINED,
            5 => UNUSED,
            6 => BYTE,
            _ => 0, // UNDEFINED
        }
    }
}

#[derive(Debug)]
pub(crate) struct Token {
    pub text: String,
    pub score: f32,
    pub attr: u32,
}

#[derive(Debug)]
pub(crate) enum Kind {
    /// `tokenizer.ggml.model = "llama"`
    Spm,
    /// `tokenizer.ggml.model = "gpt2"`
    Bpe(PreTokenizer),
}

#[derive(Debug)]
pub(crate) struct Vocab {
    pub kind: Kind,
    tokens: Vec<Token>,
    token_to_id: HashMap<String, u32>,
    /// (left id, right id) → rank
    merges: HashMap<(u32, u32), u32>,
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    pub add_bos: bool,
    pub add_eos: bool,
    pub add_space_prefix: bool,
    eog: BTreeSet<u32>,
    /// Control, user-defined and unknown tokens, longest text first: the
    /// order in which `tokenizer_st_partition` looks for them.
    pub special_tokens: Vec<u32>,
    /// `token_to_piece(id, special = true)` for every token.
    pieces: Vec<Vec<u8>>,
}

/// Texts llama.cpp takes to be an end-of-turn token when no id is given.
const EOT_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "<｜end▁of▁sentence｜>",
    "<end_of_utterance>",
];
const EOM_TEXTS: &[&str] = &["<|eom_id|>"];
const FIM_PRE_TEXTS: &[&str] =
    &["<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>", "<|code_prefix|>", "<|prefix|>"];
const FIM_SUF_TEXTS: &[&str] =
    &["<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>", "<|code_suffix|>", "<|suffix|>"];
const FIM_MID_TEXTS: &[&str] =
    &["<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>", "<|code_middle|>", "<|middle|>"];
const FIM_PAD_TEXTS: &[&str] = &["<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"];
const FIM_REP_TEXTS: &[&str] = &["<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"];
const FIM_SEP_TEXTS: &[&str] = &["<|file_sep|>"];
/// Texts that always end generation.
const EOG_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|flush|>",
    "<|calls|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "[EOS]",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<eos>",
    "<turn|>",
    "<|tool_response>",
    "<｜end▁of▁sentence｜>",
    "[e~[",
];
/// gpt-oss tokens llama.cpp always renders and matches as user-defined.
const FORCED_USER_DEFINED: &[&str] = &["<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"];

impl Vocab {
    pub(crate) fn new(cfg: &TokenizerConfig) -> Result<Vocab, TokenizerError> {
        let n_tokens = cfg.tokens.len();
        if n_tokens == 0 {
            return Err(TokenizerError::EmptyVocab);
        }
        let check_len = |key, len: Option<usize>| match len {
            Some(len) if len < n_tokens => Err(TokenizerError::LengthMismatch { key, len, n_tokens }),
            _ => Ok(()),
        };
        check_len("tokenizer.ggml.scores", cfg.scores.as_ref().map(Vec::len))?;
        check_len("tokenizer.ggml.token_type", cfg.token_types.as_ref().map(Vec::len))?;

        let (mut tokens, token_to_id) = read_tokens(cfg)?;

        // Defaults per vocabulary type, before the metadata keys override them.
        let (kind, mut bos, mut eos, mut add_bos, add_space_prefix) = match cfg.model.as_str() {
            "llama" => (Kind::Spm, Some(1), Some(2), true, true),
            "gpt2" => {
                let pre = PreTokenizer::from_name(cfg.pre.as_deref())?;
                let bos = if pre.no_bos { None } else { Some(11) };
                let add_bos = pre.add_bos;
                (Kind::Bpe(pre), bos, Some(11), add_bos, false)
            }
            other => return Err(TokenizerError::UnsupportedModel(other.to_string())),
        };
        let merges = match kind {
            Kind::Bpe(_) => merge_ranks(cfg, &token_to_id)?,
            Kind::Spm => HashMap::new(),
        };
        let add_space_prefix = cfg.add_space_prefix.unwrap_or(add_space_prefix);

        // llama.cpp drops out-of-range defaults silently.
        let in_range = |id: Option<u32>| id.filter(|&id| (id as usize) < n_tokens);
        let (mut eot, mut eom) = (None, None);
        let (mut fim_pre, mut fim_suf, mut fim_mid) = (None, None, None);
        let (mut fim_pad, mut fim_rep, mut fim_sep) = (None, None, None);
        let s = &cfg.special;
        for (key, slot, given) in [
            ("tokenizer.ggml.bos_token_id", &mut bos, s.bos),
            ("tokenizer.ggml.eos_token_id", &mut eos, s.eos),
            ("tokenizer.ggml.eot_token_id", &mut eot, s.eot),
            ("tokenizer.ggml.eom_token_id", &mut eom, s.eom),
            ("tokenizer.ggml.fim_pre_token_id", &mut fim_pre, s.fim_pre),
            ("tokenizer.ggml.fim_suf_token_id", &mut fim_suf, s.fim_suf),
            ("tokenizer.ggml.fim_mid_token_id", &mut fim_mid, s.fim_mid),
            ("tokenizer.ggml.fim_pad_token_id", &mut fim_pad, s.fim_pad),
            ("tokenizer.ggml.fim_rep_token_id", &mut fim_rep, s.fim_rep),
            ("tokenizer.ggml.fim_sep_token_id", &mut fim_sep, s.fim_sep),
            // validated only: the BPE and SPM paths never emit these
            ("tokenizer.ggml.unknown_token_id", &mut None, s.unk),
            ("tokenizer.ggml.seperator_token_id", &mut None, s.sep),
            ("tokenizer.ggml.padding_token_id", &mut None, s.pad),
        ] {
            *slot = in_range(*slot);
            if let Some(id) = given {
                if id as usize >= n_tokens {
                    return Err(TokenizerError::TokenIdOutOfRange { key, id: id.into(), n_tokens });
                }
                *slot = Some(id);
            }
        }
        add_bos = cfg.add_bos.unwrap_or(add_bos);
        let add_eos = cfg.add_eos.unwrap_or(false);
        if add_bos && bos.is_none() {
            return Err(TokenizerError::MissingBos);
        }
        if add_eos && eos.is_none() {
            return Err(TokenizerError::MissingEos);
        }

        // Detect unnamed special tokens by their text. llama.cpp walks a hash
        // map and keeps the first hit; the lowest id is the deterministic choice.
        let mut mark_control = BTreeSet::new();
        for (slot, texts) in [
            (&mut eot, EOT_TEXTS),
            (&mut eom, EOM_TEXTS),
            (&mut fim_pre, FIM_PRE_TEXTS),
            (&mut fim_suf, FIM_SUF_TEXTS),
            (&mut fim_mid, FIM_MID_TEXTS),
            (&mut fim_pad, FIM_PAD_TEXTS),
            (&mut fim_rep, FIM_REP_TEXTS),
            (&mut fim_sep, FIM_SEP_TEXTS),
        ] {
            if slot.is_none() {
                *slot = texts.iter().filter_map(|t| token_to_id.get(*t).copied()).min();
                mark_control.extend(*slot);
            }
        }

        let mut eog: BTreeSet<u32> = [fim_pad, fim_rep, fim_sep].into_iter().flatten().collect();
        for text in EOG_TEXTS {
            if let Some(&id) = token_to_id.get(*text) {
                eog.insert(id);
                mark_control.insert(id);
            }
        }
        // A detected end-of-something token must be parsed as special even
        // if the converter forgot to mark it.
        for id in mark_control {
            tokens[id as usize].attr |= attr::CONTROL;
        }
        for text in FORCED_USER_DEFINED {
            if let Some(&id) = token_to_id.get(*text) {
                tokens[id as usize].attr = attr::USER_DEFINED;
            }
        }
        eog.extend([eos, eot, eom].into_iter().flatten());
        // o200k_harmony / solar-open: "<|end|>" ends a message, not generation.
        let has = |t: &str| token_to_id.get(t).is_some_and(|id| eog.contains(id));
        let has_call = has("<|call|>") || has("<|calls|>");
        if (has("<|return|>") || has("<|flush|>")) && has_call && has("<|end|>") {
            let end = token_to_id["<|end|>"];
            eog.remove(&end);
            tokens[end as usize].attr = attr::USER_DEFINED;
        }

        let mut special_tokens: Vec<u32> = (0..n_tokens as u32)
            .filter(|&id| tokens[id as usize].attr & (attr::CONTROL | attr::USER_DEFINED | attr::UNKNOWN) != 0)
            .collect();
        special_tokens.sort_by_key(|&id| std::cmp::Reverse(tokens[id as usize].text.len()));

        let pieces = tokens.iter().map(|t| piece(&kind, t)).collect();

        Ok(Vocab { kind, tokens, token_to_id, merges, bos, eos, add_bos, add_eos, add_space_prefix, eog, special_tokens, pieces })
    }

    pub(crate) fn len(&self) -> usize {
        self.tokens.len()
    }

    pub(crate) fn token_id(&self, text: &str) -> Option<u32> {
        self.token_to_id.get(text).copied()
    }

    pub(crate) fn text(&self, id: u32) -> Option<&str> {
        self.tokens.get(id as usize).map(|t| t.text.as_str())
    }

    pub(crate) fn attr(&self, id: u32) -> u32 {
        self.tokens[id as usize].attr
    }

    /// Whether `id` is a control, unknown or unused token rather than text.
    pub(crate) fn is_control(&self, id: u32) -> bool {
        self.tokens.get(id as usize).is_some_and(|t| t.attr & (attr::CONTROL | attr::UNKNOWN | attr::UNUSED) != 0)
    }

    pub(crate) fn score(&self, id: u32) -> f32 {
        self.tokens[id as usize].score
    }

    pub(crate) fn merge_rank(&self, left: u32, right: u32) -> Option<u32> {
        self.merges.get(&(left, right)).copied()
    }

    pub(crate) fn is_eog(&self, id: u32) -> bool {
        self.eog.contains(&id)
    }

    pub(crate) fn eog_ids(&self) -> impl Iterator<Item = u32> + '_ {
        self.eog.iter().copied()
    }

    pub(crate) fn piece(&self, id: u32) -> Option<&[u8]> {
        self.pieces.get(id as usize).map(Vec::as_slice)
    }

    /// SPM byte fallback (`llama_vocab::byte_to_token`): `<0xNN>`, else the byte itself.
    pub(crate) fn byte_token(&self, b: u8) -> Result<u32, TokenizerError> {
        self.token_id(&format!("<0x{b:02X}>"))
            .or_else(|| b.is_ascii().then(|| self.token_id(char::from(b).encode_utf8(&mut [0; 4]))).flatten())
            .ok_or(TokenizerError::MissingByteToken(b))
    }
}

fn read_tokens(cfg: &TokenizerConfig) -> Result<(Vec<Token>, HashMap<String, u32>), TokenizerError> {
    let n_tokens = cfg.tokens.len();
    let mut tokens = Vec::with_capacity(n_tokens);
    let mut token_to_id = HashMap::with_capacity(n_tokens);
    for (i, text) in cfg.tokens.iter().enumerate() {
        let id = i as u32;
        // llama.cpp keeps empty tokens unmatchable under a placeholder text
        let text = if text.is_empty() { format!("[EMPTY_{i}]") } else { text.clone() };
        if let Some(&first) = token_to_id.get(&text) {
            return Err(TokenizerError::DuplicateToken { text, first, second: id });
        }
        token_to_id.insert(text.clone(), id);
        tokens.push(Token {
            text,
            score: cfg.scores.as_ref().map_or(0.0, |s| s[i]),
            attr: cfg.token_types.as_ref().map_or(attr::NORMAL, |t| attr::from_token_type(t[i])),
        });
    }
    Ok((tokens, token_to_id))
}

/// Merge ranks keyed by token ids; a merge naming a non-token is invalid
/// (Hugging Face's tokenizers rejects those too).
fn merge_ranks(cfg: &TokenizerConfig, token_to_id: &HashMap<String, u32>) -> Result<HashMap<(u32, u32), u32>, TokenizerError> {
    let list = cfg.merges.as_ref().ok_or(TokenizerError::MissingKey("tokenizer.ggml.merges"))?;
    let mut merges = HashMap::with_capacity(list.len());
    for (index, merge) in list.iter().enumerate() {
        let pair = split_merge(merge).and_then(|(l, r)| Some((*token_to_id.get(l)?, *token_to_id.get(r)?)));
        let pair = pair.ok_or_else(|| TokenizerError::BadMerge { index, merge: merge.clone() })?;
        merges.entry(pair).or_insert(index as u32);
    }
    Ok(merges)
}

/// llama.cpp splits a merge at the first space after its first byte.
fn split_merge(merge: &str) -> Option<(&str, &str)> {
    let pos = 1 + merge.as_bytes().get(1..)?.iter().position(|&b| b == b' ')?;
    Some((&merge[..pos], &merge[pos + 1..]))
}

/// `token_to_piece(special = true)`: the bytes a token stands for.
fn piece(kind: &Kind, token: &Token) -> Vec<u8> {
    let text = &token.text;
    if token.attr & (attr::UNKNOWN | attr::CONTROL | attr::USER_DEFINED) != 0 {
        return text.as_bytes().to_vec();
    }
    if token.attr & attr::NORMAL != 0 {
        return match kind {
            Kind::Spm => text.replace('\u{2581}', " ").into_bytes(),
            Kind::Bpe(_) => decode_byte_level(text),
        };
    }
    if token.attr & attr::BYTE != 0 {
        return vec![parse_byte_token(text)];
    }
    Vec::new() // unused / undefined tokens render as nothing
}

/// llama.cpp's `llama_decode_text`, including its marker for chars outside
/// the byte-level alphabet.
fn decode_byte_level(text: &str) -> Vec<u8> {
    let mut out = Vec::with_capacity(text.len());
    for c in text.chars() {
        match char_to_byte(c) {
            Some(b) => out.push(b),
            None => {
                out.extend_from_slice(b"[UNK_BYTE_0x");
                out.extend_from_slice(hex::encode(c.encode_utf8(&mut [0; 4])).as_bytes());
                out.extend_from_slice(text.as_bytes());
                out.push(b']');
            }
        }
    }
    out
}

/// `<0xNN>` → NN, parsed like llama.cpp's `strtol(text.substr(3, 2), 16)`.
fn parse_byte_token(text: &str) -> u8 {
    let digits = text.as_bytes().get(3..).unwrap_or_default();
    digits.iter().take(2).map_while(|&d| char::from(d).to_digit(16)).fold(0u8, |acc, d| acc * 16 + d as u8)
}
