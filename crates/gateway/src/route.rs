//! A route: the ordered workers that together hold every layer of one model.

use crate::conn::connect;
use crate::DriveError;
use dgr_proto::StageInfo;
use std::time::Duration;

#[derive(Clone, Debug)]
pub struct StageEndpoint {
    pub addr: String,
    pub info: StageInfo,
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
            return Err(DriveError::new("route", None, None, "a route needs at least one worker"));
        }
        let probes = addrs.iter().enumerate().map(|(i, a)| connect(a, i as u32, timeout, 1 << 20));
        let mut stages = Vec::new();
        for (addr, r) in addrs.iter().zip(futures::future::join_all(probes).await) {
            let (_, _, info) = r?;
            stages.push(StageEndpoint { addr: addr.clone(), info });
        }
        let route = Route { stages };
        route.check()?;
        Ok(route)
    }

    fn check(&self) -> Result<(), DriveError> {
        let first = &self.stages[0].info;
        let mut at = 0;
        for (i, s) in self.stages.iter().enumerate() {
            let bad = |msg: String| Err(DriveError::new("route", Some(i as u32), Some(&s.addr), msg));
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
                "route",
                Some(last as u32),
                Some(&self.stages[last].addr),
                format!("the route ends at layer {at} of {}", first.n_layers),
            ));
        }
        Ok(())
    }

    pub fn model_id(&self) -> &str {
        &self.stages[0].info.model_id
    }

    pub fn addrs(&self) -> Vec<String> {
        self.stages.iter().map(|s| s.addr.clone()).collect()
    }
}
