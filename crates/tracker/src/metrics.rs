//! What the tracker reports at /metrics, as Prometheus text.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Mutex;

#[derive(Default)]
pub struct Metrics {
    pub workers_live: AtomicU64,
    pub joins: AtomicU64,
    pub routes_issued: AtomicU64,
    pub route_plan_us_total: AtomicU64,
    pub route_plan_us_max: AtomicU64,
    pub usage_reports: AtomicU64,
    pub usage_duplicates: AtomicU64,
    pub relay_sessions: AtomicU64,
    pub connections_open: AtomicU64,
    pub connections_refused: AtomicU64,
    pub quarantined: AtomicU64,
    /// Refusals by kind (bad join token, no route, quota, ...).
    refusals: Mutex<BTreeMap<&'static str, u64>>,
}

impl Metrics {
    pub fn refused(&self, kind: &'static str) {
        *self.refusals.lock().unwrap_or_else(|p| p.into_inner()).entry(kind).or_default() += 1;
    }

    pub fn planned(&self, us: u64) {
        self.route_plan_us_total.fetch_add(us, Relaxed);
        self.route_plan_us_max.fetch_max(us, Relaxed);
    }

    pub fn render(&self) -> String {
        let mut out = String::new();
        let mut line = |name: &str, help: &str, kind: &str, v: u64| {
            out.push_str(&format!("# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {v}\n"));
        };
        let get = |a: &AtomicU64| a.load(Relaxed);
        line("dgr_tracker_workers_live", "Workers connected and heard from within three heartbeats.", "gauge", get(&self.workers_live));
        line("dgr_tracker_joins_total", "Workers admitted (joins and re-joins).", "counter", get(&self.joins));
        line("dgr_tracker_routes_issued_total", "Route tickets signed.", "counter", get(&self.routes_issued));
        line("dgr_tracker_route_plan_us_total", "Microseconds spent planning routes.", "counter", get(&self.route_plan_us_total));
        line("dgr_tracker_route_plan_us_max", "Longest route planning, microseconds.", "gauge", get(&self.route_plan_us_max));
        line("dgr_tracker_usage_reports_total", "Usage reports stored.", "counter", get(&self.usage_reports));
        line("dgr_tracker_usage_duplicates_total", "Usage reports received again and ignored.", "counter", get(&self.usage_duplicates));
        line("dgr_tracker_relay_sessions_total", "Connections spliced through the relay.", "counter", get(&self.relay_sessions));
        line("dgr_tracker_connections_open", "Connections open now.", "gauge", get(&self.connections_open));
        line("dgr_tracker_connections_refused_total", "Connections refused at the cap.", "counter", get(&self.connections_refused));
        line("dgr_tracker_workers_quarantined", "Workers quarantined by spot checks (never routed to).", "gauge", get(&self.quarantined));
        out.push_str("# HELP dgr_tracker_refusals_total Requests refused, by kind.\n# TYPE dgr_tracker_refusals_total counter\n");
        for (kind, n) in self.refusals.lock().unwrap_or_else(|p| p.into_inner()).iter() {
            out.push_str(&format!("dgr_tracker_refusals_total{{kind=\"{kind}\"}} {n}\n"));
        }
        out
    }
}
