use thiserror::Error;

/// Everything that can go wrong building a tokenizer or using it.
#[derive(Debug, Error)]
pub enum TokenizerError {
    #[error("tokenizer metadata is missing key `{0}`")]
    MissingKey(&'static str),
    #[error("tokenizer metadata key `{key}` has the wrong type (expected {expected})")]
    WrongType { key: &'static str, expected: &'static str },
    #[error("unsupported tokenizer model `{0}`")]
    UnsupportedModel(String),
    #[error("unsupported pre-tokenizer `{0}`")]
    UnsupportedPreTokenizer(String),
    #[error("the vocabulary is empty")]
    EmptyVocab,
    #[error("duplicate token {text:?} at ids {first} and {second}")]
    DuplicateToken { text: String, first: u32, second: u32 },
    #[error("`{key}` has {len} entries but the vocabulary has {n_tokens}")]
    LengthMismatch { key: &'static str, len: usize, n_tokens: usize },
    #[error("merge #{index} {merge:?} does not split into two vocabulary tokens")]
    BadMerge { index: usize, merge: String },
    #[error("`{key}` = {id} is out of range for a vocabulary of {n_tokens} tokens")]
    TokenIdOutOfRange { key: &'static str, id: u64, n_tokens: usize },
    #[error("a BOS token was requested but the model has none")]
    MissingBos,
    #[error("an EOS token was requested but the model has none")]
    MissingEos,
    #[error("the vocabulary has no token for byte 0x{0:02X}")]
    MissingByteToken(u8),
    #[error("the model has no chat template")]
    NoChatTemplate,
    #[error("{path}: {reason}")]
    HfFile { path: String, reason: String },
    #[error("tokenizer.json could not encode the text: {0}")]
    HfEncode(String),
    #[error("chat template: {0}")]
    Template(#[from] minijinja::Error),
}
