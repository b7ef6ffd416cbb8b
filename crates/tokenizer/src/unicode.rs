//! Codepoint classification and GPT-2 byte-level mapping, as llama.cpp's unicode.cpp.

use crate::unicode_data::RANGES_FLAGS;

/// llama.cpp's `unicode_cpt_flags`. `Flags::OUTSIDE` (all zero) marks a position
/// outside the fragment being split; every real codepoint has a nonzero category.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Flags(u16);

impl Flags {
    pub(crate) const OUTSIDE: Flags = Flags(0);
    const NUMBER: u16 = 0x0002;
    const LETTER: u16 = 0x0004;
    const PUNCTUATION: u16 = 0x0020;
    const WHITESPACE: u16 = 0x0100;

    pub(crate) fn of(c: char) -> Flags {
        let cpt = c as u32;
        let idx = RANGES_FLAGS.partition_point(|&(start, _)| start <= cpt) - 1;
        let mut bits = RANGES_FLAGS[idx].1;
        if is_whitespace(cpt) {
            bits |= Self::WHITESPACE;
        }
        Flags(bits)
    }

    pub(crate) fn is_number(self) -> bool {
        self.0 & Self::NUMBER != 0
    }
    pub(crate) fn is_letter(self) -> bool {
        self.0 & Self::LETTER != 0
    }
    pub(crate) fn is_punctuation(self) -> bool {
        self.0 & Self::PUNCTUATION != 0
    }
    pub(crate) fn is_whitespace(self) -> bool {
        self.0 & Self::WHITESPACE != 0
    }
    /// llama.cpp's `as_uint() != 0`: the position holds a codepoint.
    pub(crate) fn is_inside(self) -> bool {
        self.0 != 0
    }
}

/// llama.cpp's `unicode_set_whitespace` (the Unicode White_Space property).
fn is_whitespace(cpt: u32) -> bool {
    matches!(
        cpt,
        0x09..=0x0D | 0x20 | 0x85 | 0xA0 | 0x1680 | 0x2000..=0x200A | 0x2028 | 0x2029 | 0x202F | 0x205F | 0x3000
    )
}

/// GPT-2's `bytes_to_unicode`: printable bytes map to themselves, the rest to
/// U+0100 onwards in byte order.
pub(crate) fn byte_to_char(b: u8) -> char {
    BYTE_TO_CHAR[b as usize]
}

/// Inverse of [`byte_to_char`].
pub(crate) fn char_to_byte(c: char) -> Option<u8> {
    let slot = *CHAR_TO_BYTE.get(c as usize)?;
    u8::try_from(slot).ok()
}

const fn is_printable_byte(b: usize) -> bool {
    matches!(b, 0x21..=0x7E | 0xA1..=0xAC | 0xAE..=0xFF)
}

// Non-printable bytes take U+0100.. in order; 68 of them, so every mapped
// char lies below U+0144.
const MAPPED_CHARS: usize = 0x144;

static BYTE_TO_CHAR: [char; 256] = build_byte_to_char();
static CHAR_TO_BYTE: [i16; MAPPED_CHARS] = build_char_to_byte();

const fn mapped_codepoint(b: usize, n_unprintable_before: u32) -> u32 {
    if is_printable_byte(b) {
        b as u32
    } else {
        0x100 + n_unprintable_before
    }
}

const fn build_byte_to_char() -> [char; 256] {
    let mut map = ['\0'; 256];
    let mut n = 0;
    let mut b = 0;
    while b < 256 {
        map[b] = match char::from_u32(mapped_codepoint(b, n)) {
            Some(c) => c,
            None => panic!("unreachable: mapped codepoints are below U+0144"),
        };
        if !is_printable_byte(b) {
            n += 1;
        }
        b += 1;
    }
    map
}

const fn build_char_to_byte() -> [i16; MAPPED_CHARS] {
    let mut map = [-1i16; MAPPED_CHARS];
    let mut n = 0;
    let mut b = 0;
    while b < 256 {
        map[mapped_codepoint(b, n) as usize] = b as i16;
        if !is_printable_byte(b) {
            n += 1;
        }
        b += 1;
    }
    map
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_mapping_round_trips() {
        for b in 0..=255u8 {
            assert_eq!(char_to_byte(byte_to_char(b)), Some(b));
        }
        assert_eq!(byte_to_char(b' '), 'Ġ');
        assert_eq!(byte_to_char(b'\n'), 'Ċ');
        assert_eq!(char_to_byte('a'), Some(b'a'));
        assert_eq!(char_to_byte('日'), None);
    }

    #[test]
    fn flags_match_llama_cpp_table() {
        assert!(Flags::of('a').is_letter());
        assert!(Flags::of('é').is_letter());
        assert!(Flags::of('7').is_number());
        assert!(Flags::of('²').is_number());
        assert!(Flags::of('!').is_punctuation());
        assert!(Flags::of(' ').is_whitespace());
        assert!(Flags::of('\u{3000}').is_whitespace());
        assert!(!Flags::of('\u{200B}').is_whitespace());
        // unassigned codepoints are "undefined", still inside a fragment
        assert!(Flags::of('\u{0378}').is_inside());
        assert!(Flags::of('\u{10FFFF}').is_inside());
    }
}
