//! SentencePiece-style merging by score: llama.cpp's `llm_tokenizer_spm_session`.

use std::cmp::{Ordering, Reverse};
use std::collections::BinaryHeap;

use crate::error::TokenizerError;
use crate::vocab::Vocab;

struct Symbol {
    start: usize,
    len: usize,
    prev: Option<usize>,
    next: Option<usize>,
}

/// A candidate merge; the heap pops the highest score, leftmost on ties.
struct Bigram {
    score: f32,
    left: usize,
    right: usize,
    size: usize,
}

impl Ord for Bigram {
    fn cmp(&self, other: &Self) -> Ordering {
        self.score.total_cmp(&other.score).then_with(|| Reverse(self.left).cmp(&Reverse(other.left)))
    }
}
impl PartialOrd for Bigram {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl PartialEq for Bigram {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for Bigram {}

/// Tokenizes `text` (spaces already escaped to ▁), appending to `out`.
pub(crate) fn tokenize(vocab: &Vocab, text: &str, out: &mut Vec<u32>) -> Result<(), TokenizerError> {
    let mut symbols: Vec<Symbol> = Vec::with_capacity(text.len());
    for (start, c) in text.char_indices() {
        let len = c.len_utf8();
        let index = symbols.len();
        symbols.push(Symbol { start, len, prev: index.checked_sub(1), next: (start + len < text.len()).then_some(index + 1) });
    }

    let mut queue = BinaryHeap::new();
    let try_add = |queue: &mut BinaryHeap<Bigram>, symbols: &[Symbol], left: Option<usize>, right: Option<usize>| {
        let (Some(l), Some(r)) = (left, right) else {
            return;
        };
        let size = symbols[l].len + symbols[r].len;
        let start = symbols[l].start;
        if let Some(id) = vocab.token_id(&text[start..start + size]) {
            queue.push(Bigram { score: vocab.score(id), left: l, right: r, size });
        }
    };
    for i in 1..symbols.len() {
        try_add(&mut queue, &symbols, Some(i - 1), Some(i));
    }

    while let Some(Bigram { left: l, right: r, size, .. }) = queue.pop() {
        if symbols[l].len == 0 || symbols[r].len == 0 || symbols[l].len + symbols[r].len != size {
            continue;
        }
        symbols[l].len = size;
        symbols[r].len = 0;
        symbols[l].next = symbols[r].next;
        if let Some(n) = symbols[r].next {
            symbols[n].prev = Some(l);
        }
        try_add(&mut queue, &symbols, symbols[l].prev, Some(l));
        try_add(&mut queue, &symbols, Some(l), symbols[l].next);
    }

    // Every merge produced a token, so a symbol is either a token or a single
    // character; llama.cpp's `rev_merge` re-segmentation never applies and an
    // unknown character falls back to byte tokens.
    for sym in symbols.iter().filter(|s| s.len > 0) {
        let piece = &text[sym.start..sym.start + sym.len];
        match vocab.token_id(piece) {
            Some(id) => out.push(id),
            None => {
                for &b in piece.as_bytes() {
                    out.push(vocab.byte_token(b)?);
                }
            }
        }
    }
    Ok(())
}
