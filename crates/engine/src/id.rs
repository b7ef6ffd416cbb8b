//! Which engine computes a stage: the model's format, the backend and the numerics. Its string
//! (`gguf-cpu-exact`) is what registrations, tickets, the boundary schema, the compatibility key
//! and the ledger carry; two stages share a batch or a route only when their ids are equal,
//! because only then do they compute the same bits.

use std::fmt;
use std::str::FromStr;

/// The format the weights were read from (they differ in identity, and in rewrites at load).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Format {
    Gguf,
    Transformers,
}

/// Where the operations run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BackendKind {
    Cpu,
}

/// How activations meet weights: `exact` keeps f32 activations (fixed-order fused
/// multiply-adds); `fast` quantizes them for integer dot products.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Numerics {
    Exact,
    Fast,
}

/// A stage's engine, written `format-backend-numerics`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct EngineId {
    pub format: Format,
    pub backend: BackendKind,
    pub numerics: Numerics,
}

/// A string that names no format, backend, numerics or engine.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown {what} {found:?} (known: {known})")]
pub struct UnknownName {
    pub what: &'static str,
    pub found: String,
    pub known: &'static str,
}

/// Names in one place, so Display and FromStr cannot drift apart.
macro_rules! names {
    ($ty:ident, $what:literal, $($v:ident = $s:literal),+) => {
        impl $ty {
            pub const ALL: &'static [$ty] = &[$($ty::$v),+];
            pub fn name(self) -> &'static str {
                match self { $($ty::$v => $s),+ }
            }
        }
        impl fmt::Display for $ty {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.name())
            }
        }
        impl FromStr for $ty {
            type Err = UnknownName;
            fn from_str(s: &str) -> Result<Self, UnknownName> {
                match s {
                    $($s => Ok($ty::$v),)+
                    _ => Err(UnknownName { what: $what, found: s.into(), known: concat!($($s, " "),+).trim_ascii_end() }),
                }
            }
        }
    };
}

names!(Format, "format", Gguf = "gguf", Transformers = "transformers");

impl Format {
    /// The format `model` was read from: a Transformers checkpoint is assembled in memory.
    pub fn of(model: &dgr_gguf::Gguf) -> Format {
        if model.is_assembled() {
            Format::Transformers
        } else {
            Format::Gguf
        }
    }
}
names!(BackendKind, "backend", Cpu = "cpu");
names!(Numerics, "numerics", Exact = "exact", Fast = "fast");

impl fmt::Display for EngineId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}-{}-{}", self.format, self.backend, self.numerics)
    }
}

impl FromStr for EngineId {
    type Err = UnknownName;
    fn from_str(s: &str) -> Result<Self, UnknownName> {
        let whole = || UnknownName { what: "engine", found: s.into(), known: "format-backend-numerics, e.g. gguf-cpu-exact" };
        let mut parts = s.split('-');
        let (Some(format), Some(backend), Some(numerics), None) = (parts.next(), parts.next(), parts.next(), parts.next()) else {
            return Err(whole());
        };
        Ok(EngineId { format: format.parse()?, backend: backend.parse()?, numerics: numerics.parse()? })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_id_round_trips_through_its_string() {
        for &format in Format::ALL {
            for &backend in BackendKind::ALL {
                for &numerics in Numerics::ALL {
                    let id = EngineId { format, backend, numerics };
                    assert_eq!(id.to_string().parse::<EngineId>(), Ok(id));
                }
            }
        }
        let exact = EngineId { format: Format::Gguf, backend: BackendKind::Cpu, numerics: Numerics::Exact };
        assert_eq!(exact.to_string(), "gguf-cpu-exact");
    }

    #[test]
    fn unknown_names_are_refused_with_the_known_ones() {
        let e = "gguf-cpu-f32".parse::<EngineId>().unwrap_err();
        assert_eq!(e.to_string(), "unknown numerics \"f32\" (known: exact fast)");
        for bad in ["", "gguf", "gguf-cpu", "gguf-cpu-exact-x", "onnx-cpu-exact", "gguf-tpu-exact"] {
            assert!(bad.parse::<EngineId>().is_err(), "{bad}");
        }
    }
}
