//! A client's requests: routes and their tickets, usage reports, the swarm, the ledger, keys,
//! and quarantines. One request and its answer at a time per connection.

use crate::registry::{Probe, Want};
use crate::server::{lock, random, refused, send, unix_ms, Shared};
use crate::store::{key_hash, Grant, Reservation, StoreError};
use dgr_proto::{
    check_prefix_probes, codec, session_tag, tenant_mask, Ack, KeyAdd, KeyAdded, PlaceRequest, Placed, RefusalKind, Refused, Registration,
    RequestUsage, RouteReply, RouteRequest, SecureStream, Suspect, SwarmReply, Ticket, TrackerBody, TrackerFrame, UsageQuery, UsageReply,
    WorkerStatus, MAX_ROUTE_ENGINE, TRACKER_MAX_FRAME,
};
use futures::StreamExt;
use prost::Message;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio_util::codec::Framed;

/// A client connection with no request for this long is closed.
const CLIENT_IDLE: Duration = Duration::from_secs(120);

/// One request and its answer at a time, until the client goes or idles out.
pub(crate) async fn client_session(stream: SecureStream, first: TrackerBody, sh: &Arc<Shared>) {
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
            b => answer(b, sh).await,
        };
        if let TrackerBody::Refused(r) = &answer {
            sh.metrics.refused(r.refusal_kind().name());
        }
        if !send(&mut conn, answer).await {
            return;
        }
    }
}

async fn answer(body: TrackerBody, sh: &Arc<Shared>) -> TrackerBody {
    let result = match body {
        TrackerBody::RouteRequest(r) => route(r, sh).await,
        TrackerBody::RequestUsage(u) => request_usage(u, sh).await,
        TrackerBody::SwarmQuery(_) => Ok(swarm(sh)),
        TrackerBody::UsageQuery(q) => usage(q, sh).await,
        TrackerBody::KeyAdd(k) => key_add(k, sh).await,
        TrackerBody::Suspect(q) => suspect(q, sh).await,
        TrackerBody::PlaceRequest(p) => place(p, sh).await,
        _ => Err(Refused::new(RefusalKind::BadRequest, "not a request a client may send")),
    };
    result.unwrap_or_else(TrackerBody::Refused)
}

/// A ledger failure as a refusal: an unreachable database is `Unavailable` (retry later),
/// never a request served unbilled.
pub(crate) fn store_err(e: StoreError) -> Refused {
    let kind = match e {
        StoreError::Unavailable(_) => RefusalKind::Unavailable,
        StoreError::Busy(_) => RefusalKind::Overloaded,
        StoreError::Conflict(_) => RefusalKind::BadRequest,
        _ => RefusalKind::Internal,
    };
    Refused::new(kind, e.to_string())
}

/// Checks the key, reserves the request's budget against its quota, and plans the route (the
/// registry locked once); a reservation no route came of is given back.
async fn route(r: RouteRequest, sh: &Arc<Shared>) -> Result<TrackerBody, Refused> {
    if r.budget_tokens == 0 || r.model_id.is_empty() || r.request_id.is_empty() || r.request_id.len() > 256 {
        return Err(Refused::new(RefusalKind::BadRequest, "a route needs a model id, a request id (≤ 256 bytes) and a token budget"));
    }
    if r.fixed.len() > 1024 {
        return Err(Refused::new(RefusalKind::BadRequest, "at most 1024 fixed stages"));
    }
    if r.exclude.len() > 1024 {
        return Err(Refused::new(RefusalKind::BadRequest, "at most 1024 excluded workers"));
    }
    check_prefix_probes(&r.prefix).map_err(|e| Refused::new(RefusalKind::BadRequest, e.to_string()))?;
    let want = Want::parse(&r.engine).map_err(|e| Refused::new(RefusalKind::BadRequest, e.to_string()))?;
    let budget = r.budget_tokens;
    let expires_ms = unix_ms() + sh.cfg.reservation_ttl.as_millis() as u64;
    let reservation = Reservation { api_key: r.api_key.clone(), request_id: r.request_id.clone(), budget, expires_ms };
    let grant = sh.store.reserve(reservation).await.map_err(store_err)?;
    let (key_name, reserved) = match grant {
        Grant::Anonymous => ("anonymous".to_string(), false),
        Grant::Granted { key_name, new } => (key_name, new),
        Grant::UnknownKey => return Err(Refused::new(RefusalKind::BadApiKey, "unknown API key")),
        Grant::OverQuota { key_name, used, reserved, quota } => {
            let msg = format!("key {key_name} has used {used} and reserved {reserved} of its {quota} tokens; this request needs {budget}");
            return Err(Refused::new(RefusalKind::QuotaExceeded, msg));
        }
        Grant::Settled => return Err(Refused::new(RefusalKind::BadRequest, "this request id's usage is recorded already")),
    };
    let started = Instant::now();
    // The workers cached the prompt's blocks under the tenant the ticket will name.
    let mask = tenant_mask(&key_name);
    let probes: Vec<Probe> = r.prefix.iter().map(|p| (p.blocks, p.chain ^ mask)).collect();
    let session_id = random::<16>();
    let tag = session_tag(&session_id);
    let planned = {
        let mut reg = lock(&sh.registry);
        if r.fixed.is_empty() {
            reg.plan_route(&r.model_id, &want, &r.exclude, &probes, budget, tag)
                .ok_or_else(|| reg.covered_but_full(&r.model_id, &want, &r.exclude, budget))
        } else {
            reg.plan_fixed(&r.model_id, &r.fixed, &r.exclude, budget, tag).ok_or(false)
        }
    };
    sh.metrics.planned(started.elapsed().as_micros() as u64);
    let p = match planned {
        Ok(p) => p,
        Err(full) => {
            if reserved {
                let id = r.request_id.clone();
                // If this fails the reservation expires by itself.
                let _ = sh.store.call(move |s| s.release(&id)).await;
            }
            return Err(if full {
                Refused::new(RefusalKind::Full, format!("every chain of workers serving model {} is full", r.model_id))
            } else {
                Refused::new(RefusalKind::NoRoute, format!("no chain of live workers covers model {}", r.model_id))
            });
        }
    };
    let ticket = Ticket {
        session_id: session_id.to_vec(),
        request_id: r.request_id,
        model_id: r.model_id,
        engine: p.engine,
        stages: p.stages,
        budget_tokens: r.budget_tokens,
        expires_unix_ms: unix_ms() + sh.cfg.ticket_ttl.as_millis() as u64,
        key_id: sh.keys.current_id(),
        key_name: key_name.clone(),
    };
    sh.metrics.routes_issued.fetch_add(1, Relaxed);
    if p.prefix_stages > 0 {
        sh.metrics.routes_prefix.fetch_add(1, Relaxed);
    }
    Ok(TrackerBody::RouteReply(RouteReply {
        ticket: Some(sh.keys.sign(&ticket)),
        route: Some(ticket),
        hidden: p.hidden,
        n_layers: p.n_layers,
        vocab: p.vocab,
        key_name,
    }))
}

/// Stores a driver's report (settling its reservation) under the key it names.
async fn request_usage(u: RequestUsage, sh: &Arc<Shared>) -> Result<TrackerBody, Refused> {
    if u.request_id.is_empty() || u.request_id.len() > 256 || u.stages.len() > 1024 || u.engine.len() > MAX_ROUTE_ENGINE {
        let msg = format!("a usage report needs a request id (≤ 256 bytes), ≤ 1024 stages and an engine of ≤ {MAX_ROUTE_ENGINE} bytes");
        return Err(Refused::new(RefusalKind::BadRequest, msg));
    }
    u.usage_status().map_err(|e| Refused::new(RefusalKind::BadRequest, e.to_string()))?;
    let now = unix_ms();
    let added = sh.store.record(u, now).await.map_err(store_err)?.ok_or_else(|| Refused::new(RefusalKind::BadApiKey, "unknown API key"))?;
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
            prefix_blocks: w.prefix_blocks() as u32,
        })
        .collect();
    workers.sort_by(|a, b| {
        let key = |w: &WorkerStatus| w.registration.as_ref().map(|r| (r.model_id.clone(), r.layer_start, r.layer_end));
        key(a).cmp(&key(b)).then(a.worker_id.cmp(&b.worker_id))
    });
    TrackerBody::SwarmReply(SwarmReply { workers, heartbeat_ms: reg.heartbeat.as_millis() as u32 })
}

async fn usage(q: UsageQuery, sh: &Shared) -> Result<TrackerBody, Refused> {
    let by_worker = match q.by.as_str() {
        "key" | "" => false,
        "worker" => true,
        other => return Err(Refused::new(RefusalKind::BadRequest, format!("usage by {other:?}: use key or worker"))),
    };
    let rows = sh.store.call(move |s| s.usage(by_worker)).await.map_err(store_err)?;
    Ok(TrackerBody::UsageReply(UsageReply { rows }))
}

async fn key_add(k: KeyAdd, sh: &Shared) -> Result<TrackerBody, Refused> {
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
        let (name, key, quota) = (k.name, k.key.clone(), k.quota_tokens);
        sh.store.call(move |s| s.put_key(&name, &key, quota, unix_ms())).await.map_err(store_err)?;
        return Ok(TrackerBody::KeyAdded(KeyAdded { key: k.key }));
    }
    let key = format!("dgr-{}", hex::encode(random::<24>()));
    let (name, chosen, quota) = (k.name.clone(), key.clone(), k.quota_tokens);
    sh.store.call(move |s| s.add_key(&name, &chosen, quota, unix_ms())).await.map_err(|e| match e {
        StoreError::Conflict(_) => Refused::new(RefusalKind::BadRequest, format!("a key named {:?} exists", k.name)),
        e => store_err(e),
    })?;
    Ok(TrackerBody::KeyAdded(KeyAdded { key }))
}

/// A spot check caught a worker: it is out of every route from now on, also after a restart.
async fn suspect(q: Suspect, sh: &Shared) -> Result<TrackerBody, Refused> {
    if !token_ok(&q.join_token, &sh.cfg.join_token) {
        return Err(Refused::new(RefusalKind::BadJoinToken, "a quarantine needs the join token"));
    }
    if q.worker_id.is_empty() || q.worker_id.len() > 128 || q.evidence.len() > 4096 {
        return Err(Refused::new(RefusalKind::BadRequest, "a worker id and at most 4 KiB of evidence"));
    }
    let (id, evidence) = (q.worker_id.clone(), q.evidence.clone());
    sh.store.call(move |s| s.quarantine(&id, &evidence, unix_ms())).await.map_err(store_err)?;
    eprintln!("dgr tracker: quarantined worker {}: {}", q.worker_id, q.evidence);
    lock(&sh.registry).quarantine(q.worker_id, q.evidence);
    Ok(TrackerBody::Ack(Ack::default()))
}

/// The layers a starting worker is to serve (`place::Placement`), worked out off the runtime's
/// threads and without the registry's lock: it takes a sort of the layers for each window.
async fn place(p: PlaceRequest, sh: &Shared) -> Result<TrackerBody, Refused> {
    if !token_ok(&p.join_token, &sh.cfg.join_token) {
        return Err(Refused::new(RefusalKind::BadJoinToken, "a placement needs the join token"));
    }
    if p.model_id.is_empty() || p.model_id.len() > 256 {
        return Err(Refused::new(RefusalKind::BadRequest, "a placement needs a model id of 1 to 256 bytes"));
    }
    let placement = lock(&sh.registry).placement(&p.model_id, p.n_layers, p.max_layers, Instant::now());
    let placement = placement.map_err(|why| Refused::new(RefusalKind::BadRequest, why))?;
    let best =
        tokio::task::spawn_blocking(move || placement.best()).await.map_err(|e| Refused::new(RefusalKind::Internal, e.to_string()))?;
    lock(&sh.registry).hold(&p.model_id, best, Instant::now());
    eprintln!("dgr tracker: a starting worker of model {} takes layers {}..{}", p.model_id, best.start, best.end);
    Ok(TrackerBody::Placed(Placed { layer_start: best.start, layer_end: best.end }))
}

/// Compares secrets by their hashes, so the time taken says nothing about the token.
pub(crate) fn token_ok(given: &str, want: &str) -> bool {
    key_hash(given) == key_hash(want)
}
