//! What the tracker reports at /metrics, as Prometheus text.

use dgr_telemetry::prom::{Kind::*, Text};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Mutex;

#[derive(Default)]
pub struct Metrics {
    pub workers_live: AtomicU64,
    pub joins: AtomicU64,
    pub routes_issued: AtomicU64,
    /// Routes with a stage on a worker holding part of the request's prefix.
    pub routes_prefix: AtomicU64,
    pub route_plan_us_total: AtomicU64,
    pub route_plan_us_max: AtomicU64,
    pub usage_reports: AtomicU64,
    pub usage_duplicates: AtomicU64,
    pub relay_sessions: AtomicU64,
    pub connections_open: AtomicU64,
    pub connections_refused: AtomicU64,
    pub quarantined: AtomicU64,
    pub reservations_expired: AtomicU64,
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
        let mut t = Text::new();
        let get = |a: &AtomicU64| a.load(Relaxed);
        t.metric("dgr_tracker_workers_live", "Workers connected and heard from within three heartbeats.", Gauge, get(&self.workers_live));
        t.metric("dgr_tracker_joins_total", "Workers admitted (joins and re-joins).", Counter, get(&self.joins));
        t.metric("dgr_tracker_routes_issued_total", "Route tickets signed.", Counter, get(&self.routes_issued));
        t.metric(
            "dgr_tracker_routes_prefix_total",
            "Routes with a stage on a worker that holds part of the request's prompt in its prefix cache.",
            Counter,
            get(&self.routes_prefix),
        );
        t.metric("dgr_tracker_route_plan_us_total", "Microseconds spent planning routes.", Counter, get(&self.route_plan_us_total));
        t.metric("dgr_tracker_route_plan_us_max", "Longest route planning, microseconds.", Gauge, get(&self.route_plan_us_max));
        t.metric("dgr_tracker_usage_reports_total", "Usage reports stored.", Counter, get(&self.usage_reports));
        t.metric("dgr_tracker_usage_duplicates_total", "Usage reports received again and ignored.", Counter, get(&self.usage_duplicates));
        t.metric("dgr_tracker_relay_sessions_total", "Connections spliced through the relay.", Counter, get(&self.relay_sessions));
        t.metric("dgr_tracker_connections_open", "Connections open now.", Gauge, get(&self.connections_open));
        t.metric("dgr_tracker_connections_refused_total", "Connections refused at the cap.", Counter, get(&self.connections_refused));
        t.metric("dgr_tracker_workers_quarantined", "Workers quarantined by spot checks (never routed to).", Gauge, get(&self.quarantined));
        t.metric(
            "dgr_tracker_reservations_expired_total",
            "Route reservations dropped unsettled after their TTL.",
            Counter,
            get(&self.reservations_expired),
        );
        let mut refusals = t.family("dgr_tracker_refusals_total", "Requests refused, by kind.", Counter);
        for (kind, n) in self.refusals.lock().unwrap_or_else(|p| p.into_inner()).iter() {
            refusals.sample(&[("kind", kind)], n);
        }
        t.finish()
    }
}
