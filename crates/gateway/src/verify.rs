//! Spot checks. A stage's output is a function of its input alone, bit for bit, so a worker's
//! honesty can be checked: for a sampled session, one step is recomputed once per stage on a
//! route where only that stage's worker is swapped for another replica of the same layers, and
//! the hashes of the stage's last output row are compared. A disagreement is settled by a third
//! replica; the odd one out is quarantined by the tracker and never routed to again.

use crate::service::Gateway;
use dgr_driver::{generate_on, tracker, DriveOptions, Flow, GenRequest, Route};
use dgr_proto::{Hop, RouteRequest, RouteStage, Sampling, SeamDtype, Suspect, TrackerBody};

/// A finished session to check: its route, its tokens, and each step's trace.
pub struct Sample {
    pub route: Route,
    pub model_id: String,
    pub prompt: Vec<u32>,
    pub tokens: Vec<u32>,
    pub traces: Vec<Vec<Hop>>,
    pub sampling: Sampling,
}

/// Stage `stage`'s hop that ends at the step's last row.
fn last_hop(trace: &[Hop], stage: u32) -> Option<Hop> {
    trace.iter().filter(|h| h.stage == stage).max_by_key(|h| h.last_row_position).copied()
}

impl Gateway {
    /// Recomputes step `step` of the sample with stage `stage` served by another replica (one
    /// not in `avoid`); that replica's id and its hop, or None when there is no such replica.
    async fn recompute(&self, s: &Sample, step: usize, stage: usize, avoid: &[String]) -> Option<(String, Hop)> {
        let fixed: Vec<RouteStage> = s
            .route
            .stages
            .iter()
            .enumerate()
            .map(|(i, st)| RouteStage {
                worker_id: if i == stage { String::new() } else { st.worker_id.clone() },
                addr: String::new(),
                layer_start: st.info.layer_start,
                layer_end: st.info.layer_end,
                engine: st.info.engine.clone(),
            })
            .collect();
        let mut prompt = s.prompt.clone();
        prompt.extend_from_slice(&s.tokens[..step]);
        let ask = RouteRequest {
            model_id: s.model_id.clone(),
            budget_tokens: prompt.len() as u64 + 1,
            request_id: tracker::new_request_id(),
            exclude: avoid.to_vec(),
            fixed,
            ..Default::default()
        };
        let answer = self.tracker_call(TrackerBody::RouteRequest(ask)).await.ok()?;
        let (route, ticket) = tracker::routed(answer).ok()?;
        let replica = route.stages.get(stage)?.worker_id.clone();
        let req = GenRequest {
            prompt_tokens: prompt,
            max_tokens: 1,
            sampling: s.sampling,
            top_logprobs: 0,
            seam_dtype: SeamDtype::F32,
            ticket: Some(ticket),
            hash_rows: true,
            constraint: None,
            stop_tokens: Vec::new(),
        };
        let mut trace = Vec::new();
        generate_on(&self.links, &route, &req, &DriveOptions::default(), |t| {
            trace = t.trace.clone();
            Flow::Stop
        })
        .await
        .ok()?;
        Some((replica, last_hop(&trace, stage as u32)?))
    }

    /// Checks every stage of the sample at one random step; quarantines a worker caught lying.
    pub async fn spot_check(&self, s: Sample) {
        let Some(step) = pick(s.tokens.len()) else { return };
        for stage in 0..s.route.stages.len() {
            let Some(theirs) = s.traces.get(step).and_then(|t| last_hop(t, stage as u32)) else { continue };
            let suspect = s.route.stages[stage].worker_id.clone();
            let Some((second, mine)) = self.recompute(&s, step, stage, std::slice::from_ref(&suspect)).await else {
                self.metrics.check("no_replica");
                continue;
            };
            if mine.last_row_position != theirs.last_row_position {
                self.metrics.check("failed");
                continue;
            }
            if mine.last_row_hash == theirs.last_row_hash {
                self.metrics.check("agree");
                continue;
            }
            // Two replicas disagree: a third says which one computed something else.
            let Some((_, third)) = self.recompute(&s, step, stage, &[suspect.clone(), second.clone()]).await else {
                self.metrics.check("undecided");
                continue;
            };
            let liar = if third.last_row_hash == mine.last_row_hash {
                suspect
            } else if third.last_row_hash == theirs.last_row_hash {
                second
            } else {
                self.metrics.check("undecided");
                continue;
            };
            let evidence = format!(
                "layers {}..{}, position {}: its row hash differs from two other replicas'",
                s.route.stages[stage].info.layer_start, s.route.stages[stage].info.layer_end, theirs.last_row_position
            );
            self.quarantine(&liar, &evidence).await;
        }
    }

    async fn quarantine(&self, worker_id: &str, evidence: &str) {
        let Some(join_token) = self.cfg.join_token.clone() else {
            self.metrics.check("caught_not_reported");
            eprintln!(
                "dgr gateway: spot check caught worker {worker_id} ({evidence}), but without the join token it cannot be quarantined"
            );
            return;
        };
        let q = Suspect { join_token, worker_id: worker_id.into(), evidence: evidence.into() };
        // Every tracker keeps the quarantine in its registry (and the shared ledger): tell all.
        match self.tracker_broadcast(TrackerBody::Suspect(q)).await {
            Ok(_) => {
                self.metrics.check("quarantined");
                eprintln!("dgr gateway: spot check caught worker {worker_id} ({evidence}); quarantined");
            }
            Err(e) => {
                self.metrics.check("caught_not_reported");
                eprintln!("dgr gateway: spot check caught worker {worker_id} ({evidence}); the tracker did not take it: {e}");
            }
        }
    }
}

/// A random step of `n`.
fn pick(n: usize) -> Option<usize> {
    let mut b = [0u8; 8];
    getrandom::fill(&mut b).ok()?;
    (n > 0).then(|| (u64::from_le_bytes(b) % n as u64) as usize)
}

/// Whether this session is checked, with probability `fraction`.
pub fn sampled(fraction: f64) -> bool {
    let mut b = [0u8; 8];
    if fraction <= 0.0 || getrandom::fill(&mut b).is_err() {
        return false;
    }
    ((u64::from_le_bytes(b) >> 11) as f64 / (1u64 << 53) as f64) < fraction
}
