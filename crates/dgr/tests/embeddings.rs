//! Embeddings on synthetic models, through real `dgr worker` processes on loopback: a text's
//! vector through a 1-, 2- or 3-stage route, and beside other sessions (generations and other
//! embeddings at once), is bitwise `dgr embed`'s one-process vector; a model whose metadata says
//! last pooling gives another vector than mean, each what a direct computation from the final-
//! normed rows gives; and an open with a pooling the wire does not know is a typed refusal.
//!
//! Every spawned process is killed when its guard drops and every wait has a deadline.

mod common;
use common::secure::SecureConn;
use common::*;

use dgr_driver::{embed_on, generate_on, DriveOptions, EmbedRequest, Flow, GenRequest, Links, Route};
use dgr_engine::{open_engine, Engine, EngineSpec, Input, LogitRows, SeqInput};
use dgr_proto::{Body, BoundarySchema, Embed, ErrorKind, Frame, Hello, OpenSession, Pooling, Role, Sampling, SeamDtype, PROTOCOL_VERSION};
use prost::Message;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

const TEXTS: [&str; 3] = ["the quick brown fox", "an embedding of a longer sentence, pooled over every position", "x"];

struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> TempDir {
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().subsec_nanos();
        let p = std::env::temp_dir().join(format!("dgr-embeddings-{}-{nanos}-{name}", std::process::id()));
        std::fs::create_dir_all(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
        TempDir(p)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A six-layer synthetic llama at `dir/name`, with `extra` synth flags.
fn synth(dir: &TempDir, name: &str, extra: &[&str]) -> PathBuf {
    let path = dir.0.join(name);
    let out = dgr().args(["synth", "--layers", "6", "--type", "q8_0", "--out"]).arg(&path).args(extra).output().expect("dgr synth");
    assert!(out.status.success(), "dgr synth: {}", String::from_utf8_lossy(&out.stderr));
    path
}

/// `dgr embed`'s vector and tokens for `text`.
fn one_process(model: &Path, text: &str) -> (Vec<f32>, Vec<u32>, String) {
    let out = dgr().args(["embed", "--threads", "1", "--text", text, "--model"]).arg(model).output().expect("dgr embed");
    assert!(out.status.success(), "dgr embed: {}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("dgr embed's JSON");
    let floats = v["embedding"].as_array().expect("embedding").iter().map(|x| x.as_f64().unwrap() as f32).collect();
    let tokens = v["tokens"].as_array().expect("tokens").iter().map(|x| x.as_u64().unwrap() as u32).collect();
    (floats, tokens, v["pooling"].as_str().unwrap().to_string())
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn request(tokens: &[u32]) -> EmbedRequest {
    EmbedRequest { prompt_tokens: tokens.to_vec(), pooling: Pooling::Model, seam_dtype: SeamDtype::F32, ticket: None }
}

fn discover(rt: &tokio::runtime::Runtime, w: &Workers) -> Route {
    rt.block_on(Route::discover(&w.addrs, Duration::from_secs(10))).unwrap_or_else(|e| panic!("discovering {:?}: {e}", w.addrs))
}

fn embed(rt: &tokio::runtime::Runtime, route: &Route, tokens: &[u32]) -> Vec<f32> {
    let c = rt.block_on(embed_on(&Links::new(), route, &request(tokens), &DriveOptions::default())).expect("embedding on the route");
    assert!(c.tokens.is_empty());
    c.embedding
}

#[test]
fn a_route_embeds_bitwise_as_one_process_alone_and_beside_other_sessions() {
    let dir = TempDir::new("routes");
    let model = synth(&dir, "mean.gguf", &[]);
    let refs: Vec<(Vec<f32>, Vec<u32>, String)> = TEXTS.iter().map(|t| one_process(&model, t)).collect();
    assert_eq!(refs[0].2, "mean", "a model that names no pooling is pooled by the mean");
    let rt = runtime();
    for cuts in [&[0, 6][..], &[0, 3, 6], &[0, 2, 4, 6]] {
        let mut w = Workers::start_on(&vec![model.clone(); cuts.len() - 1], cuts, 1, &[]);
        let route = discover(&rt, &w);
        for (text, (want, tokens, _)) in TEXTS.iter().zip(&refs) {
            assert_eq!(want.len(), 64);
            assert_eq!(bits(&embed(&rt, &route, tokens)), bits(want), "{cuts:?}: {text:?} alone");
        }
        // Every embedding and two generations at once, on shared connections: the workers batch
        // their prompts; each vector is still its one-process one, each generation its solo run.
        let links = Links::new();
        let opts = DriveOptions::default();
        let gen = |tokens: &[u32]| GenRequest {
            prompt_tokens: tokens.to_vec(),
            max_tokens: 6,
            sampling: Sampling { temperature: 0.0, top_k: 40, top_p: 0.95, seed: 0 },
            top_logprobs: 0,
            seam_dtype: SeamDtype::F32,
            ticket: None,
            hash_rows: false,
            constraint: None,
            stop_tokens: Vec::new(),
        };
        let gens = [gen(&refs[0].1), gen(&refs[1].1)];
        let solo: Vec<Vec<u32>> = gens
            .iter()
            .map(|g| rt.block_on(generate_on(&links, &route, g, &opts, |_| Flow::Continue)).expect("a solo generation").tokens)
            .collect();
        let embeds: Vec<EmbedRequest> = refs.iter().map(|(_, t, _)| request(t)).collect();
        let (vectors, generated) = rt.block_on(async {
            let vectors = futures::future::join_all(embeds.iter().map(|e| embed_on(&links, &route, e, &opts)));
            let generated = futures::future::join_all(gens.iter().map(|g| generate_on(&links, &route, g, &opts, |_| Flow::Continue)));
            futures::join!(vectors, generated)
        });
        for ((v, (want, _, _)), text) in vectors.into_iter().zip(&refs).zip(TEXTS) {
            assert_eq!(bits(&v.expect("an embedding beside others").embedding), bits(want), "{cuts:?}: {text:?} beside others");
        }
        for (g, want) in generated.into_iter().zip(&solo) {
            assert_eq!(&g.expect("a generation beside embeddings").tokens, want, "{cuts:?}: a generation beside embeddings");
        }
        let last = w.n() - 1;
        assert_eq!(w.metrics(last).get("dgr_worker_embeddings_total"), 2.0 * TEXTS.len() as f64, "{cuts:?}");
    }
}

/// The direct computation: the whole model's final-normed rows for `tokens`, pooled by the mean
/// (summed in f64) or taken at the last position, then L2-normalised.
fn direct(model: &Path, tokens: &[u32], last: bool) -> Vec<f32> {
    let g = Arc::new(dgr_gguf::Gguf::open(model).expect("the model"));
    let stage = open_engine(g, 0..6, EngineSpec::threads(1)).expect("the engine");
    let h = stage.config().hidden;
    let mut kv = stage.new_state(tokens.len(), 0..6).unwrap();
    let out = stage.forward(&mut [SeqInput { kv: &mut kv, input: Input::Tokens(tokens), logits: LogitRows::Normed }]).unwrap();
    let rows: Vec<&[f32]> = out[0].hidden.chunks_exact(h).collect();
    assert_eq!(rows.len(), tokens.len());
    let pooled: Vec<f64> = if last {
        rows[rows.len() - 1].iter().map(|&x| x as f64).collect()
    } else {
        (0..h).map(|i| rows.iter().map(|r| r[i] as f64).sum::<f64>() / rows.len() as f64).collect()
    };
    let norm = pooled.iter().map(|x| x * x).sum::<f64>().sqrt();
    pooled.iter().map(|x| (x / norm) as f32).collect()
}

#[test]
fn mean_and_last_pooling_differ_and_each_is_the_direct_computation() {
    let dir = TempDir::new("pooling");
    let mean = synth(&dir, "mean.gguf", &[]);
    let last = synth(&dir, "last.gguf", &["--pooling-type", "3"]);
    let rt = runtime();
    for text in TEXTS.iter().take(2) {
        let (m, tokens, pm) = one_process(&mean, text);
        let (l, tokens_l, pl) = one_process(&last, text);
        assert_eq!((pm.as_str(), pl.as_str(), &tokens), ("mean", "last", &tokens_l));
        let far = m.iter().zip(&l).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        assert!(far > 1e-3, "{text:?}: mean and last pooling agree to {far}");
        for (got, want, what) in [(&m, direct(&mean, &tokens, false), "mean"), (&l, direct(&last, &tokens, true), "last")] {
            let err = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            assert!(err < 1e-6, "{text:?}: {what} pooling is {err} from the direct computation");
        }
        // A route of the last-pooled model pools as its metadata says, bit for bit.
        let w = Workers::start_on(&[last.clone(), last.clone()], &[0, 3, 6], 1, &[]);
        assert_eq!(bits(&embed(&rt, &discover(&rt, &w), &tokens)), bits(&l), "{text:?} on a route of the last-pooled model");
    }
}

fn send(c: &mut SecureConn, body: Body) {
    let payload = Frame::new(body).encode_to_vec();
    let mut buf = (payload.len() as u32).to_be_bytes().to_vec();
    buf.extend_from_slice(&payload);
    c.write_all(&buf).expect("writing to the worker");
}

fn recv(c: &mut SecureConn) -> Body {
    let mut len = [0u8; 4];
    c.read_exact(&mut len).expect("a frame within the deadline");
    let mut payload = vec![0u8; u32::from_be_bytes(len) as usize];
    c.read_exact(&mut payload).expect("a frame within the deadline");
    Frame::decode(payload.as_slice()).expect("a frame").body.expect("a body")
}

#[test]
fn an_open_with_an_unknown_pooling_is_a_typed_refusal() {
    let dir = TempDir::new("hostile");
    let model = synth(&dir, "mean.gguf", &[]);
    let mut w = Workers::start_on(&[model], &[0, 6], 1, &[]);
    let mut c = SecureConn::connect(&w.addrs[0]);
    send(&mut c, Body::Hello(Hello { protocol_version: PROTOCOL_VERSION, role: Role::Driver as i32, info: None }));
    let Body::Hello(Hello { info: Some(info), .. }) = recv(&mut c) else { panic!("no Hello from the worker") };
    let open = |id: u8, pooling: i32| OpenSession {
        session_id: vec![id; 16],
        schema: Some(BoundarySchema {
            protocol_version: PROTOCOL_VERSION,
            model_id: info.model_id.clone(),
            layer_start: 0,
            layer_end: 6,
            hidden: info.hidden,
            seam_dtype: SeamDtype::F32 as i32,
            engine: info.engine.clone(),
        }),
        n_stages: 1,
        max_positions: 8,
        embed: Some(Embed { pooling }),
        ..Default::default()
    };
    for bad in [4, 99, -1] {
        send(&mut c, Body::Open(open(1, bad)));
        match recv(&mut c) {
            Body::Error(e) => {
                assert_eq!(e.error_kind(), ErrorKind::BadInput, "pooling {bad}: {e:?}");
                assert!(e.message.contains("pooling"), "{}", e.message);
            }
            other => panic!("pooling {bad} was answered with {other:?}"),
        }
    }
    // The connection and the worker go on: a good open is opened.
    send(&mut c, Body::Open(open(2, Pooling::Last as i32)));
    assert!(matches!(recv(&mut c), Body::Opened(_)));
    w.assert_alive(0, "after the refused opens");
}
