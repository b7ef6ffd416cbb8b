//! Speculative decoding as a request sees it: how many drafts a step may carry, and what the
//! steps did. The drafting itself runs on a ring's first stage (`dgr_proto::Drafter`).

use serde::Serialize;

/// How many draft tokens a step may carry: `Off`, or at most `n` (at most `MAX_DRAFT`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Speculate {
    Off,
    Up(usize),
}

impl Speculate {
    /// The default: prompt lookup with up to 8 drafts a step, adapted per session.
    pub const DEFAULT: Speculate = Speculate::Up(8);

    /// `off`, or a number of drafts from 1 to `MAX_DRAFT` (0 is off).
    pub fn parse(s: &str) -> Result<Speculate, String> {
        match s.trim() {
            "off" | "0" => Ok(Speculate::Off),
            n => match n.parse::<usize>() {
                Ok(n) if n <= dgr_proto::MAX_DRAFT => Ok(Speculate::Up(n)),
                _ => Err(format!("--speculate takes off or a number of draft tokens up to {}, not {s:?}", dgr_proto::MAX_DRAFT)),
            },
        }
    }

    pub(crate) fn max(self) -> usize {
        match self {
            Speculate::Off => 0,
            Speculate::Up(n) => n.min(dgr_proto::MAX_DRAFT),
        }
    }
}

impl Default for Speculate {
    fn default() -> Self {
        Speculate::DEFAULT
    }
}

impl std::fmt::Display for Speculate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Speculate::Off => f.write_str("off"),
            Speculate::Up(n) => write!(f, "{n}"),
        }
    }
}

/// What speculation did for a request: verification steps, drafts sent and drafts accepted.
#[derive(Serialize, Default, Debug, Clone, Copy, PartialEq, Eq)]
pub struct DraftStats {
    pub steps: u64,
    pub drafted: u64,
    pub accepted: u64,
}

impl DraftStats {
    pub fn add(&mut self, o: &DraftStats) {
        self.steps += o.steps;
        self.drafted += o.drafted;
        self.accepted += o.accepted;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_flag_takes_off_or_a_count() {
        assert_eq!(Speculate::parse("off"), Ok(Speculate::Off));
        assert_eq!(Speculate::parse("0"), Ok(Speculate::Off));
        assert_eq!(Speculate::parse("5"), Ok(Speculate::Up(5)));
        assert!(Speculate::parse("17").is_err() && Speculate::parse("on").is_err() && Speculate::parse("-1").is_err());
        assert_eq!((Speculate::Up(5).to_string(), Speculate::Off.to_string()), ("5".to_string(), "off".to_string()));
    }
}
