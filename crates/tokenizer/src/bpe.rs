//! Byte-level BPE merging: llama.cpp's `llm_tokenizer_bpe_session`.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use crate::vocab::Vocab;

/// A run of the word's bytes; merged-away symbols have `len == 0`.
struct Symbol {
    start: usize,
    len: usize,
    prev: Option<usize>,
    next: Option<usize>,
    /// The token whose text this symbol spells, if any. Merges only ever
    /// pair two tokens, so a symbol without one never merges again.
    id: Option<u32>,
}

/// Tokenizes one pre-tokenized (byte-encoded) word, appending to `out`.
pub(crate) fn tokenize_word(vocab: &Vocab, word: &str, ignore_merges: bool, out: &mut Vec<u32>) {
    if ignore_merges {
        if let Some(id) = vocab.token_id(word) {
            out.push(id);
            return;
        }
    }

    let mut symbols: Vec<Symbol> = Vec::with_capacity(word.len());
    for (start, c) in word.char_indices() {
        let len = c.len_utf8();
        let index = symbols.len();
        symbols.push(Symbol {
            start,
            len,
            prev: index.checked_sub(1),
            next: (start + len < word.len()).then_some(index + 1),
            id: vocab.token_id(&word[start..start + len]),
        });
    }

    // Lowest rank first, leftmost on ties. Entries go stale when a neighbour
    // merges; since symbols only grow rightwards, a changed total length
    // detects that (llama.cpp compares the text, which is equivalent).
    let mut queue: BinaryHeap<Reverse<(u32, usize, usize, usize)>> = BinaryHeap::new();
    let push_pair = |queue: &mut BinaryHeap<_>, symbols: &[Symbol], left: Option<usize>, right: Option<usize>| {
        let (Some(l), Some(r)) = (left, right) else {
            return;
        };
        let (Some(lid), Some(rid)) = (symbols[l].id, symbols[r].id) else {
            return;
        };
        if let Some(rank) = vocab.merge_rank(lid, rid) {
            queue.push(Reverse((rank, l, r, symbols[l].len + symbols[r].len)));
        }
    };
    for i in 1..symbols.len() {
        push_pair(&mut queue, &symbols, Some(i - 1), Some(i));
    }

    while let Some(Reverse((_, l, r, size))) = queue.pop() {
        if symbols[l].len == 0 || symbols[r].len == 0 || symbols[l].len + symbols[r].len != size {
            continue;
        }
        let start = symbols[l].start;
        symbols[l].len = size;
        symbols[l].id = vocab.token_id(&word[start..start + size]);
        symbols[r].len = 0;
        symbols[l].next = symbols[r].next;
        if let Some(n) = symbols[r].next {
            symbols[n].prev = Some(l);
        }
        push_pair(&mut queue, &symbols, symbols[l].prev, Some(l));
        push_pair(&mut queue, &symbols, Some(l), symbols[l].next);
    }

    for sym in symbols.iter().filter(|s| s.len > 0) {
        match sym.id {
            Some(id) => out.push(id),
            // A merge result outside the vocabulary: llama.cpp looks up each
            // byte of the encoded text alone, which only ASCII bytes can match.
            None => {
                let text = &word[sym.start..sym.start + sym.len];
                for b in text.bytes().filter(u8::is_ascii) {
                    if let Some(id) = vocab.token_id(char::from(b).encode_utf8(&mut [0; 4])) {
                        out.push(id);
                    }
                }
            }
        }
    }
}
