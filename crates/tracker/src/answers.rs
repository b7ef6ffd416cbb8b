//! A client's requests: routes and their tickets, usage reports, the swarm, the ledger, keys,
//! and quarantines. One request and its answer at a time per connection.

use crate::server::{lock, random, refused, send, unix_ms, Shared};
use crate::store::{key_hash, StoreError};
use dgr_proto::{
    codec, Ack, KeyAdd, KeyAdded, RefusalKind, Refused, Registration, RequestUsage, RouteReply, RouteRequest, Suspect, SwarmReply, Ticket,
    TrackerBody, TrackerFrame, UsageQuery, UsageReply, WorkerStatus, TRACKER_MAX_FRAME,
};
use futures::StreamExt;
use prost::Message;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::net::TcpStream;
use tokio_util::codec::Framed;

/// A client connection with no request for this long is closed.
const CLIENT_IDLE: Duration = Duration::from_secs(120);

/// One request and its answer at a time, until the client goes or idles out.
pub(crate) async fn client_session(stream: TcpStream, first: TrackerBody, sh: &Arc<Shared>) {
    let mut conn = Framed::new(stream, codec(TRACKER_MAX_FRAME));
    let mut next = Some(first);
    loop {
        let body = match next.take() {
            Some(b) => b,
            None => match tokio::time::timeout(CLIENT_IDLE, conn.next()).await {
                Ok(Some(Ok(bytes))) => match TrackerFrame::decode(bytes) {
                    Ok(TrackerFrame { body: Some(b) }) => b,
                    _ => refused(RefusalKind::BadRequest, "undecodable frame"),
                },
                _ => return,
            },
        };
        let answer = match body {
            TrackerBody::Refused(r) => TrackerBody::Refused(r),
            b => answer(b, sh),
        };
        if let TrackerBody::Refused(r) = &answer {
            sh.metrics.refused(r.refusal_kind().name());
        }
        if !send(&mut conn, answer).await {
            return;
        }
    }
}

fn answer(body: TrackerBody, sh: &Arc<Shared>) -> TrackerBody {
    let result = match body {
        TrackerBody::RouteRequest(r) => route(r, sh),
        TrackerBody::RequestUsage(u) => request_usage(u, sh),
        TrackerBody::SwarmQuery(_) => Ok(swarm(sh)),
        TrackerBody::UsageQuery(q) => usage(q, sh),
        TrackerBody::KeyAdd(k) => key_add(k, sh),
        TrackerBody::Suspect(q) => suspect(q, sh),
        _ => Err(Refused::new(RefusalKind::BadRequest, "not a request a client may send")),
    };
    result.unwrap_or_else(TrackerBody::Refused)
}

pub(crate) fn store_err(e: StoreError) -> Refused {
    Refused::new(RefusalKind::Internal, e.to_string())
}

/// The key's name for the ledger: API keys are required once any exists; without any, every
/// request is "anonymous".
fn authorize(sh: &Shared, api_key: &str, check_quota: bool) -> Result<String, Refused> {
    let store = lock(&sh.store);
    if !store.has_keys().map_err(store_err)? {
        return Ok("anonymous".into());
    }
    let key = store.find_key(api_key).map_err(store_err)?.ok_or_else(|| Refused::new(RefusalKind::BadApiKey, "unknown API key"))?;
    if check_quota && key.quota_tokens > 0 {
        let used = store.key_used(&key.name).map_err(store_err)?;
        if used >= key.quota_tokens {
            let msg = format!("key {} has used {used} of its {} tokens", key.name, key.quota_tokens);
            return Err(Refused::new(RefusalKind::QuotaExceeded, msg));
        }
    }
    Ok(key.name)
}

fn route(r: RouteRequest, sh: &Shared) -> Result<TrackerBody, Refused> {
    let key_name = authorize(sh, &r.api_key, true)?;
    if r.budget_tokens == 0 || r.model_id.is_empty() {
        return Err(Refused::new(RefusalKind::BadRequest, "a route needs a model id and a token budget"));
    }
    let started = Instant::now();
    let planned = if r.fixed.is_empty() {
        lock(&sh.registry).plan_route(&r.model_id, &r.engine, &r.exclude)
    } else if r.fixed.len() > 1024 {
        return Err(Refused::new(RefusalKind::BadRequest, "at most 1024 fixed stages"));
    } else {
        lock(&sh.registry).plan_fixed(&r.model_id, &r.fixed, &r.exclude)
    };
    sh.metrics.planned(started.elapsed().as_micros() as u64);
    let p = planned.ok_or_else(|| Refused::new(RefusalKind::NoRoute, format!("no chain of live workers covers model {}", r.model_id)))?;
    let ticket = Ticket {
        session_id: random::<16>().to_vec(),
        request_id: r.request_id,
        model_id: r.model_id,
        engine: p.engine,
        stages: p.stages,
        budget_tokens: r.budget_tokens,
        expires_unix_ms: unix_ms() + sh.cfg.ticket_ttl.as_millis() as u64,
        key_id: sh.keys.current_id(),
    };
    sh.metrics.routes_issued.fetch_add(1, Relaxed);
    Ok(TrackerBody::RouteReply(RouteReply {
        ticket: Some(sh.keys.sign(&ticket)),
        route: Some(ticket),
        hidden: p.hidden,
        n_layers: p.n_layers,
        vocab: p.vocab,
        key_name,
    }))
}

fn request_usage(u: RequestUsage, sh: &Shared) -> Result<TrackerBody, Refused> {
    let name = authorize(sh, &u.api_key, false)?;
    if u.request_id.is_empty() || u.request_id.len() > 256 || u.stages.len() > 1024 {
        return Err(Refused::new(RefusalKind::BadRequest, "a usage report needs a request id (≤ 256 bytes) and ≤ 1024 stages"));
    }
    u.usage_status().map_err(|e| Refused::new(RefusalKind::BadRequest, e.to_string()))?;
    let added = lock(&sh.store).record_request(&name, &u, unix_ms()).map_err(store_err)?;
    let counter = if added { &sh.metrics.usage_reports } else { &sh.metrics.usage_duplicates };
    counter.fetch_add(1, Relaxed);
    Ok(TrackerBody::Ack(Ack { duplicate: !added }))
}

fn swarm(sh: &Shared) -> TrackerBody {
    let reg = lock(&sh.registry);
    let now = Instant::now();
    let mut workers: Vec<WorkerStatus> = reg
        .workers()
        .map(|w| WorkerStatus {
            worker_id: w.id.clone(),
            registration: Some(Registration { addr: w.addr.clone(), ..w.reg.clone() }),
            load: Some(w.load),
            last_seen_ms: now.duration_since(w.last_heartbeat).as_millis() as u64,
            relayed: w.relayed,
            recent_routes: w.unseen_routes() as u32,
            routes_total: w.routes_total,
            quarantined: reg.quarantined.get(&w.id).cloned().unwrap_or_default(),
        })
        .collect();
    workers.sort_by(|a, b| {
        let key = |w: &WorkerStatus| w.registration.as_ref().map(|r| (r.model_id.clone(), r.layer_start, r.layer_end));
        key(a).cmp(&key(b)).then(a.worker_id.cmp(&b.worker_id))
    });
    TrackerBody::SwarmReply(SwarmReply { workers, heartbeat_ms: reg.heartbeat.as_millis() as u32 })
}

fn usage(q: UsageQuery, sh: &Shared) -> Result<TrackerBody, Refused> {
    let by_worker = match q.by.as_str() {
        "key" | "" => false,
        "worker" => true,
        other => return Err(Refused::new(RefusalKind::BadRequest, format!("usage by {other:?}: use key or worker"))),
    };
    let rows = lock(&sh.store).usage(by_worker).map_err(store_err)?;
    Ok(TrackerBody::UsageReply(UsageReply { rows }))
}

fn key_add(k: KeyAdd, sh: &Shared) -> Result<TrackerBody, Refused> {
    if !token_ok(&k.join_token, &sh.cfg.join_token) {
        return Err(Refused::new(RefusalKind::BadJoinToken, "adding a key needs the join token"));
    }
    if k.name.is_empty() || k.name.len() > 128 {
        return Err(Refused::new(RefusalKind::BadRequest, "a key needs a name of 1 to 128 bytes"));
    }
    if !k.key.is_empty() {
        if k.key.len() < 16 || k.key.len() > 256 {
            return Err(Refused::new(RefusalKind::BadRequest, "a chosen key must be 16 to 256 bytes"));
        }
        lock(&sh.store).put_key(&k.name, &k.key, k.quota_tokens, unix_ms()).map_err(store_err)?;
        return Ok(TrackerBody::KeyAdded(KeyAdded { key: k.key }));
    }
    let key = format!("dgr-{}", hex::encode(random::<24>()));
    lock(&sh.store).add_key(&k.name, &key, k.quota_tokens, unix_ms()).map_err(|e| match e {
        StoreError::Sql(rusqlite::Error::SqliteFailure(f, _)) if f.code == rusqlite::ErrorCode::ConstraintViolation => {
            Refused::new(RefusalKind::BadRequest, format!("a key named {:?} exists", k.name))
        }
        e => store_err(e),
    })?;
    Ok(TrackerBody::KeyAdded(KeyAdded { key }))
}

/// A spot check caught a worker: it is out of every route from now on, also after a restart.
fn suspect(q: Suspect, sh: &Shared) -> Result<TrackerBody, Refused> {
    if !token_ok(&q.join_token, &sh.cfg.join_token) {
        return Err(Refused::new(RefusalKind::BadJoinToken, "a quarantine needs the join token"));
    }
    if q.worker_id.is_empty() || q.worker_id.len() > 128 || q.evidence.len() > 4096 {
        return Err(Refused::new(RefusalKind::BadRequest, "a worker id and at most 4 KiB of evidence"));
    }
    lock(&sh.store).quarantine(&q.worker_id, &q.evidence, unix_ms()).map_err(store_err)?;
    eprintln!("dgr tracker: quarantined worker {}: {}", q.worker_id, q.evidence);
    lock(&sh.registry).quarantine(q.worker_id, q.evidence);
    Ok(TrackerBody::Ack(Ack::default()))
}

/// Compares secrets by their hashes, so the time taken says nothing about the token.
pub(crate) fn token_ok(given: &str, want: &str) -> bool {
    key_hash(given) == key_hash(want)
}
