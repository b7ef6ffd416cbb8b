//! Lowercase hex, for SHA-256 digests.

pub(crate) fn encode(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    bytes.iter().flat_map(|b| [DIGITS[usize::from(b >> 4)], DIGITS[usize::from(b & 15)]]).map(char::from).collect()
}

/// A 64-digit lowercase hex digest; None for anything else (uppercase included, so each digest
/// has one spelling).
pub(crate) fn decode32(s: &str) -> Option<[u8; 32]> {
    let digit = |c: u8| match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        _ => None,
    };
    let s = s.as_bytes();
    if s.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (o, pair) in out.iter_mut().zip(s.chunks_exact(2)) {
        *o = digit(pair[0])? << 4 | digit(pair[1])?;
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_rejects_other_spellings() {
        let bytes: [u8; 32] = std::array::from_fn(|i| (i * 37) as u8);
        let s = encode(&bytes);
        assert_eq!(s.len(), 64);
        assert_eq!(decode32(&s), Some(bytes));
        assert_eq!(decode32(&s.to_uppercase()), None);
        assert_eq!(decode32(&s[1..]), None);
        assert_eq!(decode32(&format!("{}g", &s[1..])), None);
        assert_eq!(decode32(&format!("{}é", &s[2..])), None);
    }
}
