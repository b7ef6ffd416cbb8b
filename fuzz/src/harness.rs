//! The fuzz targets' bodies and their seed inputs.
//!
//! Shared by the fuzz binaries (`fuzz/fuzz_targets/*.rs`, built by `scripts/fuzz.sh` or
//! `cargo fuzz`) and by the main workspace's replay test (`crates/dgr/tests/fuzz_regressions.rs`,
//! which includes this file by path), so an input that failed under the fuzzer fails the same
//! way under `cargo test`. Each body must return normally on every input: a panic, a failed
//! assertion below included, is a finding. Each returns whether the input was accepted all the
//! way through, which the replay test uses to check that every seed reaches the deep paths.
//!
//! Uses only crates the replay test also has: dgr-gguf, dgr-proto, dgr-gateway, prost and
//! ed25519-dalek.

// Message literals end in `..Default::default()` even where every field is named, so that a field
// added to the protocol does not break the fuzz build.
#![allow(clippy::needless_update)]

use dgr_gguf::{quant, GgmlType, Gguf, GgufWriter, ModelIdentity, Value};
use dgr_proto::{
    check_forward, check_open, check_prefix_probes, check_ticket_open, decode_rows, encode_rows, key_id, session_id, sign_ticket,
    verify_ticket, verifying_key, worker_id, Body, BoundarySchema, Challenge, Embed, Embedding, ErrorKind, ErrorMsg, Forward, Frame,
    Heartbeat, Hello, Hop, Join, Joined, Load, OpenSession, Ping, PlaceRequest, Placed, Pooling, PrefixHeld, PrefixProbe, RefusalKind,
    Refused, Registration, Role, RouteReply, RouteRequest, RouteStage, Sampled, Sampling, SeamDtype, SessionRef, SignedTicket, SigningKey,
    StageInfo, Ticket, TicketError, TokenOut, TopEntry, TrackerBody, TrackerFrame, TrackerHello, TrackerKey, Usage, VerifyingKey,
    MAX_CHUNK, MAX_HELD_DIGESTS, MAX_OPENED_TAGS, PROTOCOL_VERSION,
};
use ed25519_dalek::{Signature, Signer};
use prost::Message;
use std::hint::black_box;
use std::sync::OnceLock;

/// A target's body: returns whether the input was accepted all the way through.
pub type Target = fn(&[u8]) -> bool;

/// Each target's name (its fuzz binary, corpus directory and regression directory) and body.
pub const TARGETS: [(&str, Target); 5] = [
    ("gguf_parse", gguf_parse),
    ("stage_frame", stage_frame),
    ("ticket", ticket),
    ("tracker_frame", tracker_frame),
    ("openai_body", openai_body),
];

// ---------------------------------------------------------------------------------------------
// GGUF

/// Parses the bytes as GGUF. An accepted file must be safe to use: every metadata value and
/// tensor byte is touched and the first row of each tensor dequantized. It must also survive the
/// project's writer: written back, it parses to the same content, and writing that again gives
/// the same bytes.
pub fn gguf_parse(data: &[u8]) -> bool {
    let Ok(g) = Gguf::from_bytes(data.to_vec()) else {
        return false;
    };
    for (key, value) in g.metadata() {
        assert!(g.get(key).is_some());
        touch(value);
    }
    black_box((g.get_u64("general.alignment").ok(), g.get_f32("general.alignment").ok(), g.get_str("general.architecture").ok()));
    for t in g.tensors() {
        let bytes = g.tensor_data(t);
        assert_eq!(bytes.len() as u64, t.n_bytes);
        assert!(g.tensor(&t.name).is_some());
        black_box((t.n_elements(), t.n_rows(), bytes.iter().fold(0u8, |a, &b| a ^ b)));
        // Cap the row so a long row in a tiny file cannot make an iteration slow.
        let row_len = t.row_len().min(1 << 16);
        if let Some(n) = t.ty.row_bytes(row_len).and_then(|n| usize::try_from(n).ok()) {
            let mut row = vec![0.0f32; row_len as usize];
            let _ = quant::dequantize_row(t.ty, &bytes[..n.min(bytes.len())], &mut row);
        }
    }
    // With no tensors the data section may start past the end of the file, and the writer pads
    // up to it: skip alignments that would make that padding large.
    if g.alignment() <= 1 << 16 {
        let once = rewrite(&g);
        let back = Gguf::from_bytes(once.clone()).expect("the writer's copy of an accepted file parses");
        assert_eq!((back.version(), back.alignment()), (g.version(), g.alignment()));
        assert_eq!(back.metadata().len(), g.metadata().len());
        for ((k1, v1), (k2, v2)) in g.metadata().iter().zip(back.metadata()) {
            assert_eq!(k1, k2);
            assert!(same_value(v1, v2), "{k1}: {v1:?} became {v2:?}");
        }
        assert_eq!(back.tensors().len(), g.tensors().len());
        for (t1, t2) in g.tensors().iter().zip(back.tensors()) {
            assert_eq!((&t1.name, t1.ty, &t1.dims, t1.n_bytes), (&t2.name, t2.ty, &t2.dims, t2.n_bytes));
            assert_eq!(g.tensor_data(t1), back.tensor_data(t2));
        }
        assert_eq!(rewrite(&back), once);
    }
    true
}

fn touch(v: &Value) {
    black_box((v.type_name(), v.as_u64(), v.as_i64(), v.as_f32(), v.as_bool(), v.as_str()));
    for item in v.as_array().unwrap_or(&[]) {
        touch(item);
    }
}

/// The file as the project's writer writes it back.
fn rewrite(g: &Gguf) -> Vec<u8> {
    let mut w = GgufWriter::new();
    w.set_version(g.version());
    for (k, v) in g.metadata() {
        w.add_metadata(k, v.clone()).expect("an accepted metadata value is writable");
    }
    for t in g.tensors() {
        w.add_tensor(&t.name, t.ty, &t.dims, g.tensor_data(t).to_vec()).expect("an accepted tensor is writable");
    }
    w.to_bytes()
}

/// Equality with floats compared bit for bit (NaN is a value like any other here).
fn same_value(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::F32(x), Value::F32(y)) => x.to_bits() == y.to_bits(),
        (Value::F64(x), Value::F64(y)) => x.to_bits() == y.to_bits(),
        (Value::Array(x), Value::Array(y)) => x.len() == y.len() && x.iter().zip(y).all(|(a, b)| same_value(a, b)),
        _ => a == b,
    }
}

// ---------------------------------------------------------------------------------------------
// The stage protocol

/// The model id the stages below serve; the seeds use it.
const MODEL_ID: &str = "fuzz-model";

/// Stages an `OpenSession` is checked against: (what the stage serves, the seam dtypes it takes).
fn stages() -> [(BoundarySchema, &'static [SeamDtype]); 2] {
    let schema = |layer_start, layer_end, hidden| BoundarySchema {
        protocol_version: PROTOCOL_VERSION,
        model_id: MODEL_ID.into(),
        layer_start,
        layer_end,
        hidden,
        seam_dtype: 0,
        ..Default::default()
    };
    [(schema(0, 8, 8), &[SeamDtype::F32]), (schema(4, 12, 16), &[SeamDtype::F32, SeamDtype::F16, SeamDtype::Bf16])]
}

/// Decodes the bytes as a stage-protocol `Frame` (what `read_frame` does with a frame's bytes)
/// and runs what a receiver checks before using it: `check_open` against two stages,
/// `check_forward` for each place and seam dtype, session ids, error kinds.
pub fn stage_frame(data: &[u8]) -> bool {
    let Ok(frame) = Frame::decode(data) else {
        return false;
    };
    reencodes(&frame);
    match &frame.body {
        Some(Body::Open(open)) => {
            if let Some(signed) = &open.ticket {
                black_box(verify_ticket(signed, key_of, NOW_MS).is_ok());
            }
            let mut accepted = false;
            for (ours, dtypes) in stages() {
                match check_open(open, &ours, dtypes) {
                    Ok((id, dtype)) => {
                        accepted = true;
                        assert_eq!(&id[..], &open.session_id[..]);
                        assert!(dtypes.contains(&dtype));
                        let s = open.schema.as_ref().expect("an accepted open has a schema");
                        assert!(ours.layer_start <= s.layer_start && s.layer_start < s.layer_end && s.layer_end <= ours.layer_end);
                        assert_eq!((s.hidden, s.protocol_version), (ours.hidden, PROTOCOL_VERSION));
                        assert!(open.stage_index < open.n_stages);
                    }
                    Err(e) => {
                        black_box((e.kind(), e.to_string()));
                    }
                }
            }
            accepted
        }
        Some(Body::Forward(f)) => {
            let mut accepted = false;
            for first_stage in [true, false] {
                for dtype in [SeamDtype::F32, SeamDtype::F16, SeamDtype::Bf16] {
                    for (hidden, max_rows) in [(8, 16), (16, 4), (1, 4096)] {
                        match check_forward(f, first_stage, hidden, dtype, max_rows) {
                            Ok(rows) => {
                                accepted = true;
                                assert!((1..=max_rows).contains(&rows));
                                if first_stage {
                                    assert_eq!(rows, f.tokens.len());
                                } else {
                                    let values = decode_rows(&f.hidden, dtype);
                                    assert_eq!(values.len(), rows * hidden);
                                    if dtype == SeamDtype::F32 {
                                        assert_eq!(encode_rows(&values, dtype), f.hidden);
                                    }
                                }
                            }
                            Err(e) => {
                                black_box((e.kind(), e.to_string()));
                            }
                        }
                    }
                }
            }
            accepted && session_id(&f.session_id).is_ok()
        }
        Some(Body::Opened(r) | Body::Cancel(r) | Body::Close(r)) => session_id(&r.session_id).is_ok(),
        Some(Body::Token(t)) => session_id(&t.session_id).is_ok(),
        Some(Body::Usage(u)) => session_id(&u.session_id).is_ok(),
        Some(Body::Progress(p)) => session_id(&p.session_id).is_ok(),
        Some(Body::Embedding(e)) => session_id(&e.session_id).is_ok() && e.values.len() % 4 == 0,
        Some(Body::Error(e)) => {
            black_box((e.error_kind().name(), e.stage, &e.message));
            true
        }
        Some(Body::Hello(h)) => Role::try_from(h.role).is_ok(),
        Some(Body::Ping(_) | Body::Pong(_)) => true,
        // A fetcher opens a manifest as a GGUF slice and takes the identity its table claims.
        Some(Body::Manifest(m)) => match Gguf::from_bytes(m.gguf.clone()) {
            Ok(g) => black_box(ModelIdentity::claimed(&g)).is_some(),
            Err(e) => {
                black_box(e.to_string());
                false
            }
        },
        Some(Body::Fetch(a)) => a.len <= MAX_CHUNK,
        Some(Body::Chunk(c)) => !c.data.is_empty(),
        None => false,
    }
}

/// A decoded message re-encodes to bytes that decode to the same bytes again (prost drops what
/// it does not know, so the first re-encoding is the canonical one).
fn reencodes<M: Message + Default>(m: &M) {
    let once = m.encode_to_vec();
    assert_eq!(once.len(), m.encoded_len());
    let again = M::decode(once.as_slice()).expect("a re-encoded message decodes");
    assert_eq!(again.encode_to_vec(), once);
}

// ---------------------------------------------------------------------------------------------
// Route tickets

/// The time tickets are checked at (unix ms): fixed, so a run is reproducible.
const NOW_MS: u64 = 1_700_000_000_000;
/// The worker a ticket is checked for, unless the input's mode picks the one the ticket names.
const WORKER: &str = "w0";

/// The tracker's key pair the seeds are signed with (a fixed seed: only tests use it).
fn tracker_keys() -> &'static (SigningKey, VerifyingKey) {
    static KEYS: OnceLock<(SigningKey, VerifyingKey)> = OnceLock::new();
    KEYS.get_or_init(|| {
        let key = SigningKey::from_bytes(&[0x5a; 32]);
        let public = key.verifying_key();
        (key, public)
    })
}

/// The tracker key set of the fuzz inputs: the one key, under its id.
fn key_of(id: u64) -> Option<VerifyingKey> {
    let public = tracker_keys().1;
    (id == key_id(&public)).then_some(public)
}

/// Splits off a part behind a little-endian u16 length; the rest is the second part.
fn split(bytes: &[u8]) -> (&[u8], &[u8]) {
    match bytes {
        [a, b, rest @ ..] => rest.split_at(usize::from(u16::from_le_bytes([*a, *b])).min(rest.len())),
        _ => (bytes, &[]),
    }
}

/// A worker's ticket check. Input: a mode byte, a u16 length, that many bytes of ticket, then an
/// `OpenSession`. Mode bit 0 clear: the ticket part is a `SignedTicket` off the wire, checked by
/// `verify_ticket` (signature, decoding, expiry); set: it is a `Ticket` the tracker signs here,
/// so that any ticket content gets past the signature. Either way a verified ticket is then
/// checked by `check_ticket_open` against the open, for worker "w0" (bit 1 clear) or for the
/// worker the ticket names at the open's stage (bit 1 set). Bit 2 also parses the ticket part as
/// a public key.
pub fn ticket(data: &[u8]) -> bool {
    let Some((&mode, rest)) = data.split_first() else {
        return false;
    };
    let (ticket_part, open_part) = split(rest);
    if mode & 4 != 0 {
        black_box(verifying_key(ticket_part));
    }
    let (key, public) = tracker_keys();
    let t = if mode & 1 == 0 {
        let Ok(signed) = SignedTicket::decode(ticket_part) else {
            return false;
        };
        match verify_ticket(&signed, key_of, NOW_MS) {
            Ok(t) => t,
            Err(e) => {
                black_box(e.name());
                return false;
            }
        }
    } else {
        let Ok(t) = Ticket::decode(ticket_part) else {
            return false;
        };
        // Named by the key that signs it, as a tracker does.
        let t = Ticket { key_id: key_id(public), ..t };
        match verify_ticket(&sign_ticket(&t, key), key_of, NOW_MS) {
            Ok(back) => {
                assert_eq!(back, t);
                back
            }
            Err(e) => {
                assert_eq!(e, TicketError::Expired);
                assert!(t.expires_unix_ms < NOW_MS);
                return false;
            }
        }
    };
    assert!(t.expires_unix_ms >= NOW_MS);
    let Ok(open) = OpenSession::decode(open_part) else {
        return false;
    };
    let worker = if mode & 2 == 0 {
        WORKER.to_string()
    } else {
        t.stages.get(open.stage_index as usize).map_or_else(String::new, |s| s.worker_id.clone())
    };
    match check_ticket_open(&t, &open, &worker) {
        Ok(()) => {
            let i = open.stage_index as usize;
            let schema = open.schema.as_ref().expect("an accepted open has a schema");
            assert_eq!(t.stages[i].worker_id, worker);
            assert_eq!((t.stages[i].layer_start, t.stages[i].layer_end), (schema.layer_start, schema.layer_end));
            assert_eq!((&t.session_id, &t.model_id), (&open.session_id, &schema.model_id));
            assert_eq!(t.stages.len(), open.n_stages as usize);
            assert!(open.max_positions <= t.budget_tokens);
            true
        }
        Err(e) => {
            black_box(e.name());
            false
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The tracker protocol

/// The challenge nonce the join seeds sign.
const JOIN_NONCE: &[u8] = b"fuzz-nonce-0123456789abcdef";

/// Decodes the bytes as a `TrackerFrame` and checks what a receiver checks with no state: a
/// join's identity key and its signature of the challenge (as the tracker's `check_join` does),
/// a challenge's tracker key, a route reply's signed ticket, a route request's prefix probes and
/// the size of a heartbeat's held prefix blocks.
pub fn tracker_frame(data: &[u8]) -> bool {
    let Ok(frame) = TrackerFrame::decode(data) else {
        return false;
    };
    reencodes(&frame);
    match &frame.body {
        Some(TrackerBody::Join(j)) => {
            let Some(key) = verifying_key(&j.identity) else { return false };
            black_box(worker_id(&key));
            let Ok(sig) = Signature::from_slice(&j.signature) else { return false };
            key.verify_strict(JOIN_NONCE, &sig).is_ok()
        }
        Some(TrackerBody::Challenge(c)) => !c.keys.is_empty() && c.keys.iter().all(|k| verifying_key(&k.public_key).is_some()),
        Some(TrackerBody::RouteReply(r)) => {
            let Some(signed) = &r.ticket else { return false };
            verify_ticket(signed, key_of, NOW_MS).is_ok()
        }
        // What the tracker checks of a route request's probes and of a heartbeat's lists.
        Some(TrackerBody::RouteRequest(r)) => check_prefix_probes(&r.prefix).is_ok(),
        Some(TrackerBody::Heartbeat(h)) => {
            h.prefix.as_ref().is_none_or(|p| p.digests.len() <= MAX_HELD_DIGESTS) && h.opened.len() <= MAX_OPENED_TAGS
        }
        Some(TrackerBody::Refused(r)) => {
            black_box((r.refusal_kind().name(), &r.message));
            true
        }
        Some(_) => true,
        None => false,
    }
}

// ---------------------------------------------------------------------------------------------
// The OpenAI gateway

/// Runs the bytes through the gateway's request-body checks, as a completions body and as a
/// chat completions body.
pub fn openai_body(data: &[u8]) -> bool {
    let completion = dgr_gateway::fuzz_request_body(data, false);
    let chat = dgr_gateway::fuzz_request_body(data, true);
    completion.is_ok() || chat.is_ok()
}

// ---------------------------------------------------------------------------------------------
// Seeds

/// Valid inputs for each target, each accepted all the way through: (target, name, bytes).
pub fn seeds() -> Vec<(&'static str, String, Vec<u8>)> {
    let mut out = Vec::new();
    for (name, bytes) in gguf_seeds() {
        out.push(("gguf_parse", name.to_string(), bytes));
    }
    for (name, frame) in frame_seeds() {
        out.push(("stage_frame", name.to_string(), frame.encode_to_vec()));
    }
    for (name, bytes) in ticket_seeds() {
        out.push(("ticket", name.to_string(), bytes));
    }
    for (name, frame) in tracker_seeds() {
        out.push(("tracker_frame", name.to_string(), frame.encode_to_vec()));
    }
    for (name, json) in openai_seeds() {
        out.push(("openai_body", name.to_string(), json.as_bytes().to_vec()));
    }
    out
}

/// Deterministic filler bytes.
fn filler(n: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

fn add_tensor(w: &mut GgufWriter, name: &str, ty: GgmlType, dims: &[u64]) {
    let rows: u64 = dims[1..].iter().product();
    let n = ty.row_bytes(dims[0]).expect("a seed's row size") * rows;
    // Filler for the quantized types, small floats for the float types (so dequantizing gives
    // ordinary numbers, as in a real model).
    let data = match ty {
        GgmlType::F32 => (0..n / 4).flat_map(|i| (i as f32 * 0.25 - 1.0).to_le_bytes()).collect(),
        GgmlType::F16 | GgmlType::BF16 => (0..n / 2).flat_map(|i| [0, 0x3c + (i % 3) as u8]).collect(),
        _ => filler(n as usize, n ^ ty.id() as u64),
    };
    w.add_tensor(name, ty, dims, data).expect("a seed tensor");
}

fn gguf_seeds() -> Vec<(&'static str, Vec<u8>)> {
    let mut seeds = Vec::new();

    let empty = GgufWriter::new();
    seeds.push(("empty", empty.to_bytes()));

    // Shaped like a tiny llama model's file: the metadata a loader reads and a few tensors.
    let mut w = GgufWriter::new();
    let kv = [
        ("general.architecture", Value::String("llama".into())),
        ("general.name", Value::String("fuzz".into())),
        ("llama.block_count", Value::U32(2)),
        ("llama.context_length", Value::U32(128)),
        ("llama.embedding_length", Value::U32(32)),
        ("llama.attention.head_count", Value::U32(4)),
        ("llama.attention.layer_norm_rms_epsilon", Value::F32(1e-5)),
        ("llama.rope.freq_base", Value::F32(10000.0)),
        ("tokenizer.ggml.model", Value::String("llama".into())),
        ("tokenizer.ggml.tokens", Value::Array(["<unk>", "<s>", "</s>", "a", "b"].map(|s| Value::String(s.into())).to_vec())),
        ("tokenizer.ggml.scores", Value::Array([0.0, 0.0, 0.0, -1.0, -2.0].map(Value::F32).to_vec())),
        ("tokenizer.ggml.token_type", Value::Array([2, 3, 3, 1, 1].map(Value::I32).to_vec())),
        ("tokenizer.ggml.bos_token_id", Value::U32(1)),
        ("tokenizer.ggml.add_bos_token", Value::Bool(true)),
    ];
    for (k, v) in kv {
        w.add_metadata(k, v).expect("seed metadata");
    }
    add_tensor(&mut w, "token_embd.weight", GgmlType::Q8_0, &[32, 5]);
    add_tensor(&mut w, "blk.0.attn_norm.weight", GgmlType::F32, &[32]);
    add_tensor(&mut w, "blk.0.ffn_down.weight", GgmlType::Q4_K, &[256, 2]);
    add_tensor(&mut w, "blk.1.ffn_up.weight", GgmlType::Q6_K, &[256]);
    add_tensor(&mut w, "output.weight", GgmlType::F16, &[32, 5]);
    seeds.push(("llama-like", w.to_bytes()));

    // Every metadata type, nested arrays, and one tensor of each type at a wider alignment.
    let mut w = GgufWriter::new();
    w.set_version(2);
    let kv = [
        ("general.alignment", Value::U32(64)),
        ("u8", Value::U8(200)),
        ("i8", Value::I8(-5)),
        ("u16", Value::U16(60000)),
        ("i16", Value::I16(-300)),
        ("i32", Value::I32(-70000)),
        ("u64", Value::U64(1 << 40)),
        ("i64", Value::I64(-(1 << 40))),
        ("f64", Value::F64(2.5)),
        ("bool", Value::Bool(false)),
        ("empty", Value::Array(Vec::new())),
        ("nested", Value::Array(vec![Value::Array(vec![Value::U16(1), Value::U16(2)]), Value::Array(Vec::new())])),
    ];
    for (k, v) in kv {
        w.add_metadata(k, v).expect("seed metadata");
    }
    for ty in GgmlType::ALL {
        add_tensor(&mut w, &format!("t.{}", ty.name()), ty, &[ty.block_size() as u64, 1, 1]);
    }
    seeds.push(("all-types", w.to_bytes()));
    seeds
}

fn schema(layer_start: u32, layer_end: u32, hidden: u32, dtype: SeamDtype) -> BoundarySchema {
    BoundarySchema {
        protocol_version: PROTOCOL_VERSION,
        model_id: MODEL_ID.into(),
        layer_start,
        layer_end,
        hidden,
        seam_dtype: dtype as i32,
        ..Default::default()
    }
}

fn seed_ticket() -> Ticket {
    let stage = |w: &str, a, b, addr: &str| RouteStage {
        worker_id: w.into(),
        addr: addr.into(),
        layer_start: a,
        layer_end: b,
        ..Default::default()
    };
    Ticket {
        session_id: vec![1; 16],
        request_id: "req-1".into(),
        model_id: MODEL_ID.into(),
        engine: "dgr".into(),
        stages: vec![stage("w0", 0, 6, "127.0.0.1:7001"), stage("w1", 6, 12, "127.0.0.1:7002")],
        budget_tokens: 512,
        expires_unix_ms: NOW_MS + 60_000,
        key_id: key_id(&tracker_keys().1),
        ..Default::default()
    }
}

fn seed_open(stage_index: u32) -> OpenSession {
    let (range, next) = if stage_index == 0 { ((0, 6), "127.0.0.1:7002") } else { ((6, 12), "") };
    OpenSession {
        session_id: vec![1; 16],
        schema: Some(schema(range.0, range.1, if stage_index == 0 { 8 } else { 16 }, SeamDtype::F32)),
        stage_index,
        n_stages: 2,
        next: next.into(),
        sampling: Some(Sampling { temperature: 0.7, top_k: 40, top_p: 0.9, seed: 42, ..Default::default() }),
        top_logprobs: 2,
        max_positions: 256,
        ticket: Some(sign_ticket(&seed_ticket(), &tracker_keys().0)),
        hash_rows: true,
        ..Default::default()
    }
}

fn frame_seeds() -> Vec<(&'static str, Frame)> {
    let id = vec![1u8; 16];
    let hop = Hop {
        stage: 0,
        queue_us: 10,
        compute_us: 200,
        bytes_out: 64,
        recv_unix_us: 5,
        sent_unix_us: 9,
        last_row_hash: 7,
        last_row_position: 3,
        ..Default::default()
    };
    let rows = |n: u32, hidden: usize, dtype: SeamDtype| Forward {
        session_id: id.clone(),
        position: 4,
        hidden: encode_rows(&(0..n as usize * hidden).map(|i| i as f32 * 0.5 - 3.0).collect::<Vec<_>>(), dtype),
        dtype: dtype as i32,
        n_rows: n,
        sample: true,
        trace: vec![hop],
        ..Default::default()
    };
    let info = StageInfo {
        model_id: MODEL_ID.into(),
        layer_start: 0,
        layer_end: 8,
        n_layers: 12,
        hidden: 8,
        vocab: 32,
        max_positions: 4096,
        version: "0.1.0".into(),
        ..Default::default()
    };
    let mut open_upstream = seed_open(1);
    open_upstream.schema = Some(schema(4, 12, 16, SeamDtype::Bf16));
    vec![
        (
            "hello",
            Frame::new(Body::Hello(Hello {
                protocol_version: PROTOCOL_VERSION,
                role: Role::Worker as i32,
                info: Some(info),
                ..Default::default()
            })),
        ),
        ("open", Frame::new(Body::Open(seed_open(0)))),
        ("open-bf16", Frame::new(Body::Open(open_upstream))),
        ("open-embed", Frame::new(Body::Open(OpenSession { embed: Some(Embed { pooling: Pooling::Last as i32 }), ..seed_open(0) }))),
        (
            "embedding",
            Frame::new(Body::Embedding(Embedding {
                session_id: id.clone(),
                values: [0.6f32, -0.8].iter().flat_map(|v| v.to_le_bytes()).collect(),
                n_tokens: 4,
                trace: vec![hop],
            })),
        ),
        ("opened", Frame::new(Body::Opened(SessionRef { session_id: id.clone(), ..Default::default() }))),
        (
            "forward-tokens",
            Frame::new(Body::Forward(Forward { session_id: id.clone(), tokens: vec![1, 5, 9, 2], sample: true, ..Default::default() })),
        ),
        (
            "forward-draft",
            Frame::new(Body::Forward(Forward {
                session_id: id.clone(),
                position: 4,
                tokens: vec![9, 5, 9],
                draft: vec![5, 9],
                sample: true,
                ..Default::default()
            })),
        ),
        ("forward-f32", Frame::new(Body::Forward(rows(2, 8, SeamDtype::F32)))),
        ("forward-f32-draft", Frame::new(Body::Forward(Forward { draft: vec![3], ..rows(2, 8, SeamDtype::F32) }))),
        ("forward-f16", Frame::new(Body::Forward(rows(3, 16, SeamDtype::F16)))),
        ("forward-bf16", Frame::new(Body::Forward(rows(1, 16, SeamDtype::Bf16)))),
        (
            "token",
            Frame::new(Body::Token(TokenOut {
                session_id: id.clone(),
                position: 5,
                token: 17,
                logprob: -0.25,
                top: vec![
                    TopEntry { id: 17, logprob: -0.25, ..Default::default() },
                    TopEntry { id: 3, logprob: -2.0, ..Default::default() },
                ],
                trace: vec![hop, Hop { stage: 1, ..hop }],
                ..Default::default()
            })),
        ),
        ("cancel", Frame::new(Body::Cancel(SessionRef { session_id: id.clone(), ..Default::default() }))),
        ("close", Frame::new(Body::Close(SessionRef { session_id: id.clone(), ..Default::default() }))),
        (
            "close-cached",
            Frame::new(Body::Close(SessionRef {
                session_id: id.clone(),
                prefix_blocks: vec![vec![7; 32]],
                positions: 20,
                ..Default::default()
            })),
        ),
        (
            "token-speculative",
            Frame::new(Body::Token(TokenOut {
                session_id: id.clone(),
                position: 5,
                token: 17,
                logprob: -0.25,
                more: vec![Sampled {
                    position: 6,
                    token: 4,
                    logprob: -0.5,
                    top: vec![TopEntry { id: 4, logprob: -0.5, ..Default::default() }],
                }],
                ..Default::default()
            })),
        ),
        ("error", Frame::new(Body::Error(ErrorMsg::new(&id, ErrorKind::BadInput, 1, "3 rows (at most 2 per frame)")))),
        (
            "usage",
            Frame::new(Body::Usage(Usage {
                session_id: id.clone(),
                stage: 1,
                tokens_prefilled: 12,
                tokens_decoded: 30,
                layer_tokens: 252,
                ..Default::default()
            })),
        ),
        ("ping", Frame::new(Body::Ping(Ping { nonce: 99, ..Default::default() }))),
        ("pong", Frame::new(Body::Pong(Ping { nonce: 99, ..Default::default() }))),
    ]
}

/// A ticket target input: mode, length-prefixed ticket part, open.
fn ticket_input(mode: u8, ticket_part: &[u8], open: &OpenSession) -> Vec<u8> {
    let mut out = vec![mode];
    out.extend_from_slice(&(ticket_part.len() as u16).to_le_bytes());
    out.extend_from_slice(ticket_part);
    out.extend_from_slice(&open.encode_to_vec());
    out
}

fn ticket_seeds() -> Vec<(&'static str, Vec<u8>)> {
    let signed = sign_ticket(&seed_ticket(), &tracker_keys().0).encode_to_vec();
    let body = seed_ticket().encode_to_vec();
    vec![
        ("signed-first-stage", ticket_input(0, &signed, &seed_open(0))),
        ("signed-last-stage", ticket_input(2, &signed, &seed_open(1))),
        ("unsigned-first-stage", ticket_input(1, &body, &seed_open(0))),
        ("unsigned-last-stage", ticket_input(3, &body, &seed_open(1))),
    ]
}

fn tracker_seeds() -> Vec<(&'static str, TrackerFrame)> {
    let worker = SigningKey::from_bytes(&[0x33; 32]);
    let registration = Registration {
        engine: "dgr".into(),
        model_id: MODEL_ID.into(),
        n_layers: 12,
        layer_start: 0,
        layer_end: 6,
        hidden: 8,
        vocab: 32,
        addr: "127.0.0.1:7001".into(),
        kv_tokens: 4096,
        max_sessions: 8,
        threads: 2,
        step_us_per_layer: 125.5,
        max_positions: 2048,
        version: "0.1.0".into(),
        ..Default::default()
    };
    let join = Join {
        join_token: "token".into(),
        identity: worker.verifying_key().to_bytes().to_vec(),
        signature: worker.sign(JOIN_NONCE).to_bytes().to_vec(),
        registration: Some(registration),
        ..Default::default()
    };
    let reply = RouteReply {
        ticket: Some(sign_ticket(&seed_ticket(), &tracker_keys().0)),
        route: Some(seed_ticket()),
        hidden: 8,
        n_layers: 12,
        vocab: 32,
        key_name: "default".into(),
        ..Default::default()
    };
    let ask = RouteRequest {
        model_id: MODEL_ID.into(),
        engine: "dgr".into(),
        budget_tokens: 512,
        api_key: "sk-test".into(),
        request_id: "req-1".into(),
        exclude: vec!["w2".into()],
        prefix: (1..=40).map(|blocks| PrefixProbe { blocks, chain: 0x9e37_79b9_7f4a_7c15u64.wrapping_mul(u64::from(blocks)) }).collect(),
        ..Default::default()
    };
    let beat = Heartbeat {
        load: Some(Load {
            sessions: 3,
            queue_depth: 1,
            kv_used_tokens: 900,
            recent_step_us: 812.5,
            device_memory_total: 1 << 33,
            device_memory_free: 1 << 32,
            kv_reserved_tokens: 4096,
        }),
        prefix: Some(PrefixHeld { digests: (0..300).map(|i| 0x5851_f42d_4c95_7f2du64.wrapping_mul(i + 1)).collect() }),
        opened: (0..20).map(|i| 0x2545_f491_4f6c_dd1du64.wrapping_mul(i + 1)).collect(),
    };
    vec![
        ("hello", TrackerFrame::new(TrackerHello::body())),
        (
            "challenge",
            TrackerFrame::new(TrackerBody::Challenge(Challenge {
                protocol_version: PROTOCOL_VERSION,
                nonce: JOIN_NONCE.to_vec(),
                keys: vec![TrackerKey { key_id: key_id(&tracker_keys().1), public_key: tracker_keys().1.to_bytes().to_vec() }],
                ..Default::default()
            })),
        ),
        ("join", TrackerFrame::new(TrackerBody::Join(join))),
        (
            "joined",
            TrackerFrame::new(TrackerBody::Joined(Joined {
                worker_id: worker_id(&worker.verifying_key()),
                heartbeat_ms: 1000,
                ..Default::default()
            })),
        ),
        ("route-request", TrackerFrame::new(TrackerBody::RouteRequest(ask))),
        ("heartbeat", TrackerFrame::new(TrackerBody::Heartbeat(beat))),
        ("route-reply", TrackerFrame::new(TrackerBody::RouteReply(reply))),
        ("refused", TrackerFrame::new(TrackerBody::Refused(Refused::new(RefusalKind::NoRoute, "no worker serves layers 6..12")))),
        (
            "place-request",
            TrackerFrame::new(TrackerBody::PlaceRequest(PlaceRequest {
                join_token: "join-token".into(),
                model_id: "m".into(),
                n_layers: 30,
                max_layers: 12,
            })),
        ),
        ("placed", TrackerFrame::new(TrackerBody::Placed(Placed { layer_start: 12, layer_end: 24 }))),
    ]
}

fn openai_seeds() -> Vec<(&'static str, &'static str)> {
    vec![
        ("completion", r#"{"model":"m","prompt":"Once upon a time","max_tokens":16,"temperature":0.8,"top_p":0.95,"top_k":40,"seed":7}"#),
        ("completion-tokens", r#"{"model":"m","prompt":[1,2,3],"stop":["\n","."],"logprobs":2,"ignore_eos":true,"user":"u"}"#),
        ("completion-texts", r#"{"model":"m","prompt":["hi"],"stop":"END","n":1,"best_of":1,"echo":false,"suffix":"","logit_bias":{}}"#),
        (
            "chat",
            r#"{"model":"m","messages":[{"role":"system","content":"Be brief."},{"role":"user","content":"Hi","name":"ann"}],"max_completion_tokens":32,"presence_penalty":0,"frequency_penalty":0.0}"#,
        ),
        (
            "chat-parts",
            r#"{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]},{"role":"assistant","content":null}],"logprobs":true,"top_logprobs":3}"#,
        ),
        (
            "chat-stream",
            r#"{"model":"m","messages":[{"role":"user","content":"\u00e9\ud83d\ude00"}],"stream":true,"stream_options":{"include_usage":true}}"#,
        ),
    ]
}
