//! Which engine computes a stage: the model's format, the backend, the numerics and the KV
//! dtype. Its string (`gguf-cpu-exact`, `gguf-cpu-exact-q8_0`) is what registrations, tickets,
//! the boundary schema, the compatibility key and the ledger carry; two stages share a batch or
//! a route only when their ids are equal, because only then do they compute the same bits.

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
    Gpu,
}

/// How activations meet weights: `exact` keeps f32 activations (fixed-order fused
/// multiply-adds); `fast` (the default) quantizes them to 16 bits per 32 values for integer dot
/// products where the weights are integer codes: 1/86 to 1/213 of llama.cpp's distance from the
/// float64 computation on the reference models (`accuracy_fast.rs`), and faster than exact.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum Numerics {
    Exact,
    #[default]
    Fast,
}

/// How a stage stores the keys and values it caches: `f32` as computed (the default); `f16`
/// rounded to nearest even (half the bytes); `q8_0` in blocks of 32 int8 with one f16 scale
/// (34 bytes per 32 values). Scores, softmax and sums stay f32 whatever it is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum KvDtype {
    #[default]
    F32,
    F16,
    Q8_0,
}

impl KvDtype {
    /// Bytes one position's keys (or values) of `width` floats take, quantized in blocks of
    /// `block` values (q8_0's; see `q8_block`).
    pub fn row_bytes(self, width: usize, block: usize) -> usize {
        match self {
            KvDtype::F32 => 4 * width,
            KvDtype::F16 => 2 * width,
            KvDtype::Q8_0 => width + 2 * width / block,
        }
    }

    /// How many positions take the memory `positions` take in `other` (in blocks of 32).
    pub fn positions_in(self, positions: usize, other: KvDtype) -> usize {
        positions * other.row_bytes(32, 32) / self.row_bytes(32, 32)
    }

    /// The values one q8_0 scale covers in heads of `head_dim`: 32 (ggml's block) where heads
    /// are whole blocks of 32, else the whole head, so a block never spans two heads.
    pub fn q8_block(head_dim: usize) -> usize {
        if head_dim.is_multiple_of(32) {
            32
        } else {
            head_dim
        }
    }
}

/// A stage's engine, written `format-backend-numerics`, then `-kv` when the KV dtype is not the
/// default f32 (so every id from before KV dtypes keeps its spelling and meaning).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct EngineId {
    pub format: Format,
    pub backend: BackendKind,
    pub numerics: Numerics,
    pub kv: KvDtype,
    /// The GPU adapter's digest (name, ids, driver): the same kernels give the same bits only
    /// on the same adapter and driver. None on the CPU.
    pub adapter: Option<u32>,
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
names!(BackendKind, "backend", Cpu = "cpu", Gpu = "gpu");
names!(Numerics, "numerics", Exact = "exact", Fast = "fast");
names!(KvDtype, "KV dtype", F32 = "f32", F16 = "f16", Q8_0 = "q8_0");

impl fmt::Display for EngineId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}-{}", self.format, self.backend)?;
        if let Some(a) = self.adapter {
            write!(f, ".{a:08x}")?;
        }
        write!(f, "-{}", self.numerics)?;
        match self.kv {
            KvDtype::F32 => Ok(()),
            kv => write!(f, "-{kv}"),
        }
    }
}

impl FromStr for EngineId {
    type Err = UnknownName;
    fn from_str(s: &str) -> Result<Self, UnknownName> {
        let whole = || {
            UnknownName {
            what: "engine",
            found: s.into(),
            known: "format-backend-numerics[-kv], e.g. gguf-cpu-exact, gguf-cpu-exact-q8_0 (f32 KV is written without -kv) or gguf-gpu.1a2b3c4d-exact",
        }
        };
        let mut parts = s.split('-');
        let (Some(format), Some(backend), Some(numerics), kv, None) =
            (parts.next(), parts.next(), parts.next(), parts.next(), parts.next())
        else {
            return Err(whole());
        };
        let kv = match kv {
            None => KvDtype::F32,
            // One spelling per id: ids are compared as strings too (tickets, the ledger).
            Some("f32") => return Err(whole()),
            Some(kv) => kv.parse()?,
        };
        // A GPU names its adapter (`gpu.1a2b3c4d`); the CPU never does.
        let (backend, adapter) = match backend.split_once('.') {
            Some((b, a)) if a.len() == 8 => (b, Some(u32::from_str_radix(a, 16).map_err(|_| whole())?)),
            Some(_) => return Err(whole()),
            None => (backend, None),
        };
        let backend: BackendKind = backend.parse()?;
        if (backend == BackendKind::Gpu) != adapter.is_some() {
            return Err(whole());
        }
        Ok(EngineId { format: format.parse()?, backend, numerics: numerics.parse()?, kv, adapter })
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
                    for &kv in KvDtype::ALL {
                        let adapter = (backend == BackendKind::Gpu).then_some(0x00c0_ffee);
                        let id = EngineId { format, backend, numerics, kv, adapter };
                        assert_eq!(id.to_string().parse::<EngineId>(), Ok(id));
                    }
                }
            }
        }
        let exact =
            EngineId { format: Format::Gguf, backend: BackendKind::Cpu, numerics: Numerics::Exact, kv: KvDtype::F32, adapter: None };
        let gpu = EngineId { backend: BackendKind::Gpu, adapter: Some(0x1a2b_3c4d), ..exact };
        assert_eq!(gpu.to_string(), "gguf-gpu.1a2b3c4d-exact");
        assert_eq!(exact.to_string(), "gguf-cpu-exact");
        assert_eq!(EngineId { kv: KvDtype::Q8_0, ..exact }.to_string(), "gguf-cpu-exact-q8_0");
        assert_eq!(EngineId { kv: KvDtype::F16, ..exact }.to_string(), "gguf-cpu-exact-f16");
    }

    #[test]
    fn unknown_names_are_refused_with_the_known_ones() {
        let e = "gguf-cpu-f32".parse::<EngineId>().unwrap_err();
        assert_eq!(e.to_string(), "unknown numerics \"f32\" (known: exact fast)");
        let e = "gguf-cpu-exact-q4".parse::<EngineId>().unwrap_err();
        assert_eq!(e.to_string(), "unknown KV dtype \"q4\" (known: f32 f16 q8_0)");
        for bad in [
            "",
            "gguf",
            "gguf-cpu",
            "gguf-cpu-exact-x",
            "gguf-cpu-exact-f32",
            "gguf-cpu-exact-f16-x",
            "onnx-cpu-exact",
            "gguf-tpu-exact",
            "gguf-gpu-exact",
            "gguf-cpu.1a2b3c4d-exact",
            "gguf-gpu.1a2b-exact",
            "gguf-gpu.zzzzzzzz-exact",
        ] {
            assert!(bad.parse::<EngineId>().is_err(), "{bad}");
        }
    }
}
