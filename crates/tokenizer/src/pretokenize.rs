//! BPE pre-tokenization: llama.cpp's `unicode_regex_split` for the regex sets
//! of the supported `tokenizer.ggml.pre` values.
//!
//! llama.cpp applies the regexes one after another, each splitting every piece
//! the previous one produced (matches and the gaps between them both become
//! pieces). The GPT-2 and LLaMA-3 regexes run through hand-written matchers
//! (`unicode_regex_split_custom_*`), ported here line by line; the remaining
//! regexes are simple character-class runs, matched directly.

use crate::error::TokenizerError;
use crate::unicode::{byte_to_char, Flags};

/// One regex of a pre-tokenizer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Pattern {
    /// `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)`
    Gpt2,
    /// `(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,max_digits}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`
    /// (LLaMA-3 with 3 digits; Qwen2's `\p{N}` variant is the same automaton with 1).
    Llama3 { max_digits: usize },
    /// A run of one character class, e.g. `\p{N}`, `\p{N}+`, `[0-9][0-9][0-9]`.
    Class(CharClass, Repeat),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CharClass {
    /// `\p{N}`
    Number,
    /// `[0-9]`
    AsciiDigit,
    /// `[\p{P}\$\+<=>\^~\|]`, plus `` ` `` when `backtick` (Falcon).
    PunctOrMath { backtick: bool },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Repeat {
    One,
    OneOrMore,
    Exactly(usize),
}

/// The regex set and vocabulary flags llama.cpp ties to a `tokenizer.ggml.pre`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PreTokenizer {
    pub patterns: Vec<Pattern>,
    /// A word that is itself a token is emitted without merging (LLaMA-3).
    pub ignore_merges: bool,
    /// llama.cpp's default for `add_bos` before the metadata key overrides it.
    pub add_bos: bool,
    /// The model has no BOS token by default (ChatGLM).
    pub no_bos: bool,
}

impl PreTokenizer {
    pub(crate) fn from_name(pre: Option<&str>) -> Result<PreTokenizer, TokenizerError> {
        use Pattern::*;
        let punct = |backtick| Class(CharClass::PunctOrMath { backtick }, Repeat::OneOrMore);
        let plain = |patterns| PreTokenizer { patterns, ignore_merges: false, add_bos: false, no_bos: false };
        let llama3 = Llama3 { max_digits: 3 };
        Ok(match pre.unwrap_or("default") {
            "default" => plain(vec![
                punct(false),
                Gpt2,
                Class(CharClass::Number, Repeat::OneOrMore),
                Class(CharClass::AsciiDigit, Repeat::Exactly(3)),
            ]),
            "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "falcon-h1" | "pixtral" | "midm-2.0" | "lfm2" | "jina-v5-nano" => {
                PreTokenizer { ignore_merges: true, add_bos: true, ..plain(vec![llama3]) }
            }
            "dbrx" | "smaug-bpe" => plain(vec![llama3]),
            "glm4" | "chatglm-bpe" => PreTokenizer { no_bos: true, ..plain(vec![llama3]) },
            "falcon" => plain(vec![punct(true), Gpt2, Class(CharClass::AsciiDigit, Repeat::Exactly(3))]),
            // "gpt2" is not a llama.cpp name but is what converters that omit
            // the pre-tokenizer would mean; llama.cpp's spelling is "gpt-2".
            "gpt2" | "gpt-2" | "phi-2" | "jina-es" | "jina-de" | "gigachat" | "jina-v2-es" | "jina-v2-de" | "a.x-4.0" | "mellum"
            | "modern-bert" | "exaone4" | "mpt" | "olmo" | "jais" | "trillion" | "granite-docling" => plain(vec![Gpt2]),
            "starcoder" | "refact" | "command-r" | "smollm" | "codeshell" | "exaone" | "minerva-7b" | "mellum2" => {
                plain(vec![Class(CharClass::Number, Repeat::One), Gpt2])
            }
            "qwen2" | "deepseek-r1-qwen" | "kormo" | "f2llmv2" | "megrez" | "stablelm2" | "hunyuan" | "solar-open" => {
                plain(vec![Llama3 { max_digits: 1 }])
            }
            other => return Err(TokenizerError::UnsupportedPreTokenizer(other.to_string())),
        })
    }

    /// Splits `text` into words, each already mapped through GPT-2's byte-to-char table.
    pub(crate) fn split(&self, text: &str) -> Vec<String> {
        let cpts: Vec<char> = text.chars().collect();
        let flags: Vec<Flags> = cpts.iter().map(|&c| Flags::of(c)).collect();
        let mut lengths = vec![cpts.len()];
        for &pattern in &self.patterns {
            let mut next = Vec::with_capacity(lengths.len());
            let mut start = 0;
            for &len in &lengths {
                let mut s = Splitter { cpts: &cpts, flags: &flags, ini: start, end: start + len, prev_end: start, out: &mut next };
                match pattern {
                    Pattern::Gpt2 => s.gpt2(),
                    Pattern::Llama3 { max_digits } => s.llama3(max_digits),
                    Pattern::Class(class, repeat) => s.class_runs(class, repeat),
                }
                start += len;
            }
            lengths = next;
        }

        let mut words = Vec::with_capacity(lengths.len());
        let mut start = 0;
        let mut buf = [0u8; 4];
        for len in lengths {
            let mut word = String::with_capacity(len * 2);
            for &c in &cpts[start..start + len] {
                for &b in c.encode_utf8(&mut buf).as_bytes() {
                    word.push(byte_to_char(b));
                }
            }
            words.push(word);
            start += len;
        }
        words
    }
}

/// Splits the codepoints `ini..end` into pieces, pushing their lengths to `out`.
struct Splitter<'a> {
    cpts: &'a [char],
    flags: &'a [Flags],
    ini: usize,
    end: usize,
    prev_end: usize,
    out: &'a mut Vec<usize>,
}

impl Splitter<'_> {
    fn cpt(&self, pos: usize) -> Option<char> {
        (self.ini..self.end).contains(&pos).then(|| self.cpts[pos])
    }

    fn flags(&self, pos: usize) -> Flags {
        if (self.ini..self.end).contains(&pos) {
            self.flags[pos]
        } else {
            Flags::OUTSIDE
        }
    }

    /// Ends the current piece at `end`; returns its length (0 pushes nothing).
    fn add(&mut self, end: usize) -> usize {
        let len = end - self.prev_end;
        if len > 0 {
            self.out.push(len);
        }
        self.prev_end = end;
        len
    }

    /// `'s|'t|'re|'ve|'m|'ll|'d` at `pos` (optionally case-insensitive); the match length.
    fn contraction(&self, pos: usize, ignore_case: bool) -> Option<usize> {
        if self.cpt(pos) != Some('\'') || pos + 1 >= self.end {
            return None;
        }
        // llama.cpp lowercases with its Unicode table; no non-ASCII codepoint
        // lowercases to one of the letters below, so ASCII folding is exact.
        let at = |p| self.cpt(p).map(|c| if ignore_case { c.to_ascii_lowercase() } else { c });
        let next = at(pos + 1);
        if matches!(next, Some('s' | 't' | 'm' | 'd')) {
            return Some(2);
        }
        if pos + 2 < self.end {
            if let (Some(a), Some(b)) = (next, at(pos + 2)) {
                if matches!((a, b), ('r', 'e') | ('v', 'e') | ('l', 'l')) {
                    return Some(3);
                }
            }
        }
        None
    }

    /// The last alternatives both splitters share: `\s+(?!\S)` (a run of whitespace less its
    /// last character, which goes with the next word), then `\s+`, else one character alone.
    /// Splits there and returns the position after.
    fn whitespace_or_one(&mut self, pos: usize, n_ws: usize) -> usize {
        let end = if n_ws > 1 && self.cpt(pos + n_ws).is_some() {
            pos + n_ws - 1
        } else if n_ws > 0 {
            pos + n_ws
        } else {
            pos + 1
        };
        self.add(end);
        end
    }

    fn whitespace_run(&self, pos: usize) -> usize {
        let mut n = 0;
        while self.flags(pos + n).is_whitespace() {
            n += 1;
        }
        n
    }

    /// `unicode_regex_split_custom_gpt2`.
    fn gpt2(&mut self) {
        let mut pos = self.ini;
        while pos < self.end {
            let cpt = self.cpts[pos];
            let flags = self.flags(pos);

            if let Some(len) = self.contraction(pos, false) {
                pos += self.add(pos + len);
                continue;
            }

            let space = usize::from(cpt == ' ');
            let mut flags2 = if cpt == ' ' { self.flags(pos + 1) } else { flags };
            // <space>?\p{L}+
            if flags2.is_letter() {
                pos += space;
                while flags2.is_letter() {
                    pos += 1;
                    flags2 = self.flags(pos);
                }
                self.add(pos);
                continue;
            }
            // <space>?\p{N}+
            if flags2.is_number() {
                pos += space;
                while flags2.is_number() {
                    pos += 1;
                    flags2 = self.flags(pos);
                }
                self.add(pos);
                continue;
            }
            // <space>?[^\s\p{L}\p{N}]+
            let other = |f: Flags| !(f.is_whitespace() || f.is_letter() || f.is_number()) && f.is_inside();
            if other(flags2) {
                pos += space;
                while other(flags2) {
                    pos += 1;
                    flags2 = self.flags(pos);
                }
                self.add(pos);
                continue;
            }

            let n_ws = self.whitespace_run(pos);
            pos = self.whitespace_or_one(pos, n_ws);
        }
    }

    /// `unicode_regex_split_custom_llama3`, with `\p{N}{1,max_digits}`.
    fn llama3(&mut self, max_digits: usize) {
        let mut pos = self.ini;
        while pos < self.end {
            let cpt = self.cpts[pos];
            let flags = self.flags(pos);

            if let Some(len) = self.contraction(pos, true) {
                pos += self.add(pos + len);
                continue;
            }

            // [^\r\n\p{L}\p{N}]?\p{L}+
            if !(cpt == '\r' || cpt == '\n' || flags.is_number()) && (flags.is_letter() || self.flags(pos + 1).is_letter()) {
                pos += 1;
                while self.flags(pos).is_letter() {
                    pos += 1;
                }
                self.add(pos);
                continue;
            }

            // \p{N}{1,max_digits}
            if flags.is_number() {
                let mut ini = pos;
                while self.flags(pos).is_number() {
                    pos += 1;
                    if pos - ini >= max_digits {
                        self.add(pos);
                        ini = pos;
                    }
                }
                self.add(pos);
                continue;
            }

            // <space>?[^\s\p{L}\p{N}]+[\r\n]*
            let other = |f: Flags| !(f.is_whitespace() || f.is_letter() || f.is_number());
            let mut flags2 = if cpt == ' ' { self.flags(pos + 1) } else { flags };
            if other(flags2) && flags.is_inside() {
                pos += usize::from(cpt == ' ');
                while other(flags2) && flags2.is_inside() {
                    pos += 1;
                    flags2 = self.flags(pos);
                }
                while matches!(self.cpt(pos), Some('\r' | '\n')) {
                    pos += 1;
                }
                self.add(pos);
                continue;
            }

            let mut n_ws = 0;
            let mut last_end_r_or_n = 0;
            while self.flags(pos + n_ws).is_whitespace() {
                if matches!(self.cpts[pos + n_ws], '\r' | '\n') {
                    last_end_r_or_n = pos + n_ws + 1;
                }
                n_ws += 1;
            }
            // \s*[\r\n]+
            if last_end_r_or_n > 0 {
                pos = last_end_r_or_n;
                self.add(pos);
                continue;
            }
            pos = self.whitespace_or_one(pos, n_ws);
        }
    }

    /// A regex made of one character class: matches and the gaps between
    /// them each become a piece (`unicode_regex_split_stl`).
    fn class_runs(&mut self, class: CharClass, repeat: Repeat) {
        let is_member = |pos: usize| {
            let c = self.cpts[pos];
            match class {
                CharClass::Number => self.flags[pos].is_number(),
                CharClass::AsciiDigit => c.is_ascii_digit(),
                CharClass::PunctOrMath { backtick } => {
                    self.flags[pos].is_punctuation() || matches!(c, '$' | '+' | '<' | '=' | '>' | '^' | '~' | '|') || (backtick && c == '`')
                }
            }
        };
        let mut pos = self.ini;
        while pos < self.end {
            let len = match repeat {
                Repeat::One => usize::from(is_member(pos)),
                Repeat::OneOrMore => (pos..self.end).take_while(|&p| is_member(p)).count(),
                Repeat::Exactly(n) => {
                    if pos + n <= self.end && (pos..pos + n).all(is_member) {
                        n
                    } else {
                        0
                    }
                }
            };
            if len == 0 {
                pos += 1;
                continue;
            }
            self.add(pos);
            pos += len;
            self.add(pos);
        }
        self.add(self.end);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::unicode::char_to_byte;

    fn split(pre: &str, text: &str) -> Vec<String> {
        PreTokenizer::from_name(Some(pre))
            .unwrap()
            .split(text)
            .into_iter()
            .map(|w| {
                let bytes: Vec<u8> = w.chars().map(|c| char_to_byte(c).unwrap()).collect();
                String::from_utf8(bytes).unwrap()
            })
            .collect()
    }

    #[test]
    fn gpt2_splits_like_the_regex() {
        assert_eq!(split("gpt-2", "Hello world"), ["Hello", " world"]);
        assert_eq!(split("gpt-2", " Hello  world "), [" Hello", " ", " world", " "]);
        assert_eq!(split("gpt-2", "don't I'm"), ["don", "'t", " I", "'m"]);
        assert_eq!(split("gpt-2", "x  \n\ty"), ["x", "  \n", "\t", "y"]);
        assert_eq!(split("gpt-2", "a...!b 12"), ["a", "...!", "b", " 12"]);
        assert_eq!(split("gpt-2", "ab   "), ["ab", "   "]);
    }

    #[test]
    fn smollm_isolates_digits_first() {
        assert_eq!(split("smollm", "x 123"), ["x", " ", "1", "2", "3"]);
        assert_eq!(split("smollm", "3.14"), ["3", ".", "1", "4"]);
    }

    #[test]
    fn llama3_and_qwen2() {
        assert_eq!(split("llama-bpe", "12345 DON'T\r\n\n  x"), ["123", "45", " DON", "'T", "\r\n\n", " ", " x"]);
        assert_eq!(split("qwen2", "12 ab"), ["1", "2", " ab"]);
        assert_eq!(split("llama-bpe", "!!\n\nx"), ["!!\n\n", "x"]);
        assert_eq!(split("llama-bpe", "(hi"), ["(hi"]);
    }

    #[test]
    fn default_applies_all_four_regexes() {
        assert_eq!(split("default", "a+b=12345"), ["a", "+", "b", "=", "123", "45"]);
    }

    #[test]
    fn unknown_pre_is_an_error() {
        assert!(PreTokenizer::from_name(Some("nope")).is_err());
    }
}
