//! A generation's text as it streams: token bytes become UTF-8 text, and the first stop string
//! ends it (the stop string itself is not part of the text). Text that could still turn out to
//! be the start of a stop string is held back until it cannot.

use dgr_tokenizer::Utf8Stream;

#[derive(Default)]
pub struct TextOut {
    utf8: Utf8Stream,
    stops: Vec<String>,
    held: String,
}

impl TextOut {
    pub fn new(stops: Vec<String>) -> TextOut {
        TextOut { stops: stops.into_iter().filter(|s| !s.is_empty()).collect(), ..Default::default() }
    }

    /// Adds a token's bytes; returns the text that is final now, and whether a stop string ended
    /// the generation.
    pub fn push(&mut self, bytes: &[u8]) -> (String, bool) {
        self.held.push_str(&self.utf8.push(bytes));
        if let Some(at) = self.stops.iter().filter_map(|s| self.held.find(s.as_str())).min() {
            let out = self.held[..at].to_string();
            self.held.clear();
            return (out, true);
        }
        // Hold back the longest tail that a stop string starts with.
        let keep = self
            .held
            .char_indices()
            .map(|(i, _)| i)
            .find(|&i| self.stops.iter().any(|s| s.starts_with(&self.held[i..])))
            .unwrap_or(self.held.len());
        let out = self.held[..keep].to_string();
        self.held.drain(..keep);
        (out, false)
    }

    /// The text still held back, once the generation ended without a stop string.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], pieces: &[&str]) -> (String, bool) {
        let mut t = TextOut::new(stops.iter().map(|s| s.to_string()).collect());
        let mut out = String::new();
        for p in pieces {
            let (text, stopped) = t.push(p.as_bytes());
            out.push_str(&text);
            if stopped {
                return (out, true);
            }
        }
        out.push_str(&t.finish());
        (out, false)
    }

    #[test]
    fn stops_end_the_text_and_are_not_part_of_it() {
        assert_eq!(run(&["\n\n"], &["Hello", " world", "\n", "\nmore"]), ("Hello world".into(), true));
        assert_eq!(run(&["END", "##"], &["a#", "b", "EN", "D!"]), ("a#b".into(), true));
        assert_eq!(run(&["xyz"], &["x", "y", "a"]), ("xya".into(), false));
        assert_eq!(run(&[], &["plain"]), ("plain".into(), false));
        assert_eq!(run(&["é"], &["caf", "é"]), ("caf".into(), true));
    }

    #[test]
    fn text_that_may_start_a_stop_is_held_back() {
        let mut t = TextOut::new(vec!["STOP".into()]);
        assert_eq!(t.push(b"abcST"), ("abc".into(), false));
        assert_eq!(t.push(b"x"), ("STx".into(), false));
        // A split UTF-8 sequence waits for its other bytes.
        assert_eq!(t.push(&[0xc3]), (String::new(), false));
        assert_eq!(t.push(&[0xa9]), ("é".into(), false));
    }
}
