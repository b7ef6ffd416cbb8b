//! Fixture builders shared by the integration tests.
#![allow(dead_code)] // each test binary uses a different subset

use dgr_gguf::{GgmlType, GgufWriter, Value};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

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

/// Bytes of the given length, from `rng`.
pub fn random_bytes(rng: &mut XorShift, n: usize) -> Vec<u8> {
    (0..n).map(|_| rng.next_u64() as u8).collect()
}

/// The tensors of one llama block (hidden 32, ffn 64): name suffix, type, dims.
const BLOCK: [(&str, GgmlType, [u64; 2]); 9] = [
    ("attn_norm.weight", GgmlType::F32, [32, 1]),
    ("attn_q.weight", GgmlType::Q4_1, [32, 32]),
    ("attn_k.weight", GgmlType::Q4_1, [32, 32]),
    ("attn_v.weight", GgmlType::Q4_1, [32, 32]),
    ("attn_output.weight", GgmlType::Q4_1, [32, 32]),
    ("ffn_norm.weight", GgmlType::F32, [32, 1]),
    ("ffn_gate.weight", GgmlType::Q4_1, [32, 64]),
    ("ffn_up.weight", GgmlType::Q4_1, [32, 64]),
    ("ffn_down.weight", GgmlType::Q4_1, [64, 32]),
];

pub const N_LAYERS: u32 = 4;

/// A llama-like 4-layer model with random tensor bytes: token_embd, rope_freqs, the blocks,
/// output_norm and (unless `tied`) output.weight.
pub fn llama(tied: bool, seed: u64) -> GgufWriter {
    let mut rng = XorShift(seed);
    let mut w = GgufWriter::new();
    w.add_metadata("general.architecture", Value::String("llama".into())).unwrap();
    w.add_metadata("general.name", Value::String("tiny".into())).unwrap();
    w.add_metadata("llama.block_count", Value::U32(N_LAYERS)).unwrap();
    w.add_metadata("llama.embedding_length", Value::U32(32)).unwrap();
    w.add_metadata("tokenizer.ggml.tokens", Value::Array((0..16).map(|i| Value::String(format!("t{i}"))).collect())).unwrap();
    let mut add = |name: &str, ty: GgmlType, dims: &[u64]| {
        let dims: Vec<u64> = dims.iter().copied().filter(|&d| d != 1).collect();
        let n = ty.row_bytes(dims[0]).unwrap() * dims[1..].iter().product::<u64>();
        w.add_tensor(name, ty, &dims, random_bytes(&mut rng, n as usize)).unwrap();
    };
    add("token_embd.weight", GgmlType::F32, &[32, 16]);
    add("rope_freqs.weight", GgmlType::F32, &[8]);
    for i in 0..N_LAYERS {
        for (suffix, ty, dims) in BLOCK {
            add(&format!("blk.{i}.{suffix}"), ty, &dims);
        }
    }
    add("output_norm.weight", GgmlType::F32, &[32]);
    if !tied {
        add("output.weight", GgmlType::Q4_1, &[32, 16]);
    }
    w
}

/// A fresh directory, removed (with its contents) when dropped.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> TempDir {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("dgr-gguf-{tag}-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("create temp dir");
        TempDir(dir)
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }

    /// Writes `bytes` to `name` in the directory.
    pub fn file(&self, name: &str, bytes: &[u8]) -> PathBuf {
        let p = self.path(name);
        std::fs::write(&p, bytes).expect("write fixture");
        p
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        // A test may have made it read-only.
        let _ = set_mode(&self.0, 0o755);
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

pub fn set_mode(path: &Path, mode: u32) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
}
