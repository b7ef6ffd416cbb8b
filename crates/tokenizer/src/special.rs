//! Special-token partitioning: llama.cpp's `tokenizer_st_partition`.

use crate::vocab::{attr, Vocab};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Fragment<'a> {
    Text(&'a str),
    Token(u32),
}

/// Splits `text` around special-token texts, longest tokens first. Without
/// `parse_special` only user-defined tokens are recognised.
pub(crate) fn partition<'a>(vocab: &Vocab, text: &'a str, parse_special: bool) -> Vec<Fragment<'a>> {
    let mut fragments = Vec::new();
    if !text.is_empty() {
        fragments.push(Fragment::Text(text));
    }
    for &id in &vocab.special_tokens {
        if !parse_special && vocab.attr(id) & (attr::CONTROL | attr::UNKNOWN) != 0 {
            continue;
        }
        let Some(needle) = vocab.text(id) else {
            continue;
        };
        if !fragments.iter().any(|f| matches!(f, Fragment::Text(t) if t.contains(needle))) {
            continue;
        }
        let mut next = Vec::with_capacity(fragments.len() + 2);
        for fragment in fragments {
            let Fragment::Text(t) = fragment else {
                next.push(fragment);
                continue;
            };
            let mut rest = 0;
            for (at, _) in t.match_indices(needle) {
                if at > rest {
                    next.push(Fragment::Text(&t[rest..at]));
                }
                next.push(Fragment::Token(id));
                rest = at + needle.len();
            }
            if rest < t.len() {
                next.push(Fragment::Text(&t[rest..]));
            }
        }
        fragments = next;
    }
    fragments
}
