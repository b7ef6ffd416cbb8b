//! A route: the ordered workers that together hold every layer of one model.

use crate::conn::connect;
use crate::{DriveError, FailKind};
use dgr_proto::{RouteReply, StageInfo};
use std::time::Duration;

#[derive(Clone, Debug)]
pub struct StageEndpoint {
    pub addr: String,
    /// The part of the model this stage runs for the route (a sub-range of what it holds).
    pub info: StageInfo,
    /// Its id at the tracker that planned the route; empty on a ticketless route.
    pub worker_id: String,
}

#[derive(Clone, Debug)]
pub struct Route {
    pub stages: Vec<StageEndpoint>,
}

impl Route {
    /// Asks each worker what it serves and checks that, in order, they cover every layer of one
    /// model exactly once.
    pub async fn discover(addrs: &[String], timeout: Duration) -> Result<Route, DriveError> {
        if addrs.is_empty() {
            return Err(DriveError::new(FailKind::Route, None, None, "a route needs at least one worker"));
        }
        let probes = addrs.iter().enumerate().map(|(i, a)| connect(a, i as u32, timeout, 1 << 20));
        let mut stages = Vec::new();
        for (i, (addr, r)) in addrs.iter().zip(futures::future::join_all(probes).await).enumerate() {
            let (_, _, info, peer) = r?;
            // The route knows each stage by the key it proves now (or the one pinned at its
            // address), so every later link there must prove the same; a plaintext link proves none.
            let worker_id = match peer {
                Some(id) => {
                    dgr_proto::check_route_peer(addr, &id)
                        .map_err(|m| DriveError::new(FailKind::WrongPeer, Some(i as u32), Some(addr), m))?;
                    id
                }
                None => String::new(),
            };
            stages.push(StageEndpoint { addr: addr.clone(), info, worker_id });
        }
        let route = Route { stages };
        route.check()?;
        Ok(route)
    }

    /// The stages must serve one model's layers in order, each once. They may run different
    /// engines (CPU layers, then GPU layers): each stage is opened on its own engine and the seams
    /// carry f32 rows, so a mixed route works, though only a route of one engine computes the
    /// unsplit model's bits.
    fn check(&self) -> Result<(), DriveError> {
        let first = &self.stages[0].info;
        let mut at = 0;
        for (i, s) in self.stages.iter().enumerate() {
            let bad = |msg: String| Err(DriveError::new(FailKind::Route, Some(i as u32), Some(&s.addr), msg));
            if s.info.model_id != first.model_id || s.info.n_layers != first.n_layers || s.info.hidden != first.hidden {
                return bad(format!("serves model {} but stage 0 serves {}", s.info.model_id, first.model_id));
            }
            if s.info.layer_start != at || s.info.layer_end <= s.info.layer_start {
                return bad(format!("serves layers {}..{} where the route needs {at}..", s.info.layer_start, s.info.layer_end));
            }
            at = s.info.layer_end;
        }
        if at != first.n_layers {
            let last = self.stages.len() - 1;
            return Err(DriveError::new(
                FailKind::Route,
                Some(last as u32),
                Some(&self.stages[last].addr),
                format!("the route ends at layer {at} of {}", first.n_layers),
            ));
        }
        Ok(())
    }

    /// The route a tracker planned: its ticket's chain, with the model's shape from the reply.
    pub fn from_tracker(reply: &RouteReply) -> Result<Route, DriveError> {
        let t = reply.route.as_ref().ok_or_else(|| DriveError::new(FailKind::Tracker, None, None, "a route reply without a route"))?;
        if t.stages.is_empty() {
            return Err(DriveError::new(FailKind::Tracker, None, None, "an empty route"));
        }
        let stages = t
            .stages
            .iter()
            .map(|s| StageEndpoint {
                addr: s.addr.clone(),
                worker_id: s.worker_id.clone(),
                info: StageInfo {
                    model_id: t.model_id.clone(),
                    layer_start: s.layer_start,
                    layer_end: s.layer_end,
                    n_layers: reply.n_layers,
                    hidden: reply.hidden,
                    vocab: reply.vocab,
                    max_positions: t.budget_tokens,
                    version: String::new(),
                    engine: s.engine.clone(),
                },
            })
            .collect();
        let route = Route { stages };
        route.check()?;
        Ok(route)
    }

    /// The route engine (`dgr_proto::route_engine`): the engine id its stages share, or each
    /// engine with its layers where they differ.
    pub fn engine(&self) -> String {
        dgr_proto::route_engine(self.stages.iter().map(|s| (s.info.engine.as_str(), s.info.layer_start, s.info.layer_end)))
    }

    pub fn model_id(&self) -> &str {
        &self.stages[0].info.model_id
    }

    pub fn addrs(&self) -> Vec<String> {
        self.stages.iter().map(|s| s.addr.clone()).collect()
    }
}
