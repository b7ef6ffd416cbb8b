//! Fixture builders shared by the integration tests.
#![allow(dead_code)] // each test binary uses a different subset

use dgr_gguf::{GgmlType, GgufWriter, Value};

/// Deterministic xorshift64 PRNG, so failures reproduce.
pub struct XorShift(pub u64);

impl XorShift {
    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }

    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }

    /// Uniform in [-1, 1).
    pub fn signed_unit(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
}

/// A small valid file: a few metadata kinds and three tensors of different types.
pub fn small_file() -> Vec<u8> {
    let mut w = GgufWriter::new();
    w.add_metadata("general.architecture", Value::String("llama".into())).unwrap();
    w.add_metadata("llama.block_count", Value::U32(2)).unwrap();
    w.add_metadata("tokens", Value::Array(vec![Value::String("a".into()), Value::String("bc".into())])).unwrap();
    w.add_metadata("flag", Value::Bool(true)).unwrap();
    w.add_tensor("f32", GgmlType::F32, &[4, 2], (0..32).collect()).expect("f32 tensor");
    w.add_tensor("q8", GgmlType::Q8_0, &[32], vec![1; 34]).expect("q8 tensor");
    w.add_tensor("f16", GgmlType::F16, &[3], vec![0; 6]).expect("f16 tensor");
    w.to_bytes()
}

/// Raw little-endian GGUF assembly, for files the writer would refuse to produce.
#[derive(Default)]
pub struct Raw(pub Vec<u8>);

impl Raw {
    pub fn header(version: u32, n_tensors: u64, n_kv: u64) -> Raw {
        let mut r = Raw(b"GGUF".to_vec());
        r.u32(version).u64(n_tensors).u64(n_kv);
        r
    }

    pub fn u8(&mut self, v: u8) -> &mut Raw {
        self.0.push(v);
        self
    }

    pub fn u32(&mut self, v: u32) -> &mut Raw {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }

    pub fn u64(&mut self, v: u64) -> &mut Raw {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }

    pub fn str(&mut self, s: &str) -> &mut Raw {
        self.u64(s.len() as u64);
        self.0.extend_from_slice(s.as_bytes());
        self
    }

    pub fn tensor(&mut self, name: &str, dims: &[u64], ty: u32, offset: u64) -> &mut Raw {
        self.str(name).u32(dims.len() as u32);
        for &d in dims {
            self.u64(d);
        }
        self.u32(ty).u64(offset)
    }

    /// Pads to the default alignment and appends `n` data bytes.
    pub fn data(&mut self, n: usize) -> Vec<u8> {
        let start = self.0.len().next_multiple_of(32);
        self.0.resize(start + n, 0);
        self.0.clone()
    }
}
