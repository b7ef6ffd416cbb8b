//! What the gateway reports at /metrics, as Prometheus text: requests and tokens by model and
//! key, time to first token and inter-token latency histograms, errors by kind, the queue.

use dgr_telemetry::prom::{Histogram, Kind::*, Text};
use std::collections::BTreeMap;
use std::sync::Mutex;

#[derive(Default, Clone, Copy)]
pub struct Tally {
    pub requests: u64,
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
}

#[derive(Default)]
pub struct HttpMetrics {
    pub ttft: Histogram,
    pub itl: Histogram,
    /// Per (model, key).
    tallies: Mutex<BTreeMap<(String, String), Tally>>,
    errors: Mutex<BTreeMap<String, u64>>,
    /// Spot checks by result (agree, quarantined, undecided, ...).
    checks: Mutex<BTreeMap<String, u64>>,
    /// Tokens and latencies as they happen, for the dashboard's history.
    pub feed: crate::history::Feed,
    /// Speculative decoding over all requests: verification steps, drafts, drafts accepted.
    drafts: Mutex<dgr_driver::DraftStats>,
    /// Embedding requests, inputs and tokens by model: (requests, failed, inputs, tokens).
    embeddings: Mutex<BTreeMap<String, [u64; 4]>>,
}

impl HttpMetrics {
    pub fn error(&self, kind: &str) {
        *self.errors.lock().unwrap_or_else(|p| p.into_inner()).entry(kind.to_string()).or_default() += 1;
    }

    pub fn check(&self, result: &str) {
        *self.checks.lock().unwrap_or_else(|p| p.into_inner()).entry(result.to_string()).or_default() += 1;
    }

    pub fn finished(&self, model: &str, key: &str, prompt: usize, completion: usize, error: Option<&str>) {
        {
            let mut t = self.tallies.lock().unwrap_or_else(|p| p.into_inner());
            let e = t.entry((model.to_string(), key.to_string())).or_default();
            e.requests += 1;
            e.prompt_tokens += prompt as u64;
            e.completion_tokens += completion as u64;
        }
        if let Some(kind) = error {
            self.error(kind);
        }
    }

    /// A finished generation's speculative steps and drafts.
    pub fn drafted(&self, d: &dgr_driver::DraftStats) {
        self.drafts.lock().unwrap_or_else(|p| p.into_inner()).add(d);
    }

    /// A finished `/v1/embeddings` request of `inputs` inputs and `tokens` tokens in all.
    pub fn embedded(&self, model: &str, inputs: usize, tokens: usize, ok: bool) {
        let mut e = self.embeddings.lock().unwrap_or_else(|p| p.into_inner());
        let row = e.entry(model.to_string()).or_default();
        row[0] += 1;
        row[1] += !ok as u64;
        row[2] += inputs as u64;
        row[3] += tokens as u64;
    }

    pub fn tallies(&self) -> Vec<((String, String), Tally)> {
        self.tallies.lock().unwrap_or_else(|p| p.into_inner()).iter().map(|(k, v)| (k.clone(), *v)).collect()
    }

    pub fn render(&self, queue_depth: usize, running: usize) -> String {
        let mut t = Text::new();
        let tallies = self.tallies();
        for (name, help, f) in [
            ("dgr_gateway_requests_total", "Requests finished, by model and key.", (|t: &Tally| t.requests) as fn(&Tally) -> u64),
            ("dgr_gateway_prompt_tokens_total", "Prompt tokens, by model and key.", |t: &Tally| t.prompt_tokens),
            ("dgr_gateway_completion_tokens_total", "Completion tokens, by model and key.", |t: &Tally| t.completion_tokens),
        ] {
            let mut family = t.family(name, help, Counter);
            for ((model, key), tally) in &tallies {
                family.sample(&[("model", model), ("key", key)], f(tally));
            }
        }
        let embeddings: Vec<(String, [u64; 4])> =
            self.embeddings.lock().unwrap_or_else(|p| p.into_inner()).iter().map(|(k, v)| (k.clone(), *v)).collect();
        for (i, name, help) in [
            (0, "dgr_gateway_embedding_requests_total", "Embedding requests finished, by model."),
            (1, "dgr_gateway_embedding_failures_total", "Embedding requests that failed, by model."),
            (2, "dgr_gateway_embedding_inputs_total", "Inputs of embedding requests, by model."),
            (3, "dgr_gateway_embedding_tokens_total", "Tokens of embedding requests' inputs, by model."),
        ] {
            let mut family = t.family(name, help, Counter);
            for (model, row) in &embeddings {
                family.sample(&[("model", model)], row[i]);
            }
        }
        let d = *self.drafts.lock().unwrap_or_else(|p| p.into_inner());
        t.metric("dgr_gateway_verify_steps_total", "Speculative decode steps (steps that carried drafts).", Counter, d.steps);
        let mut drafts = t.family("dgr_gateway_draft_tokens_total", "Draft tokens sent to be verified, by outcome.", Counter);
        drafts.sample(&[("outcome", "accepted")], d.accepted);
        drafts.sample(&[("outcome", "rejected")], d.drafted - d.accepted);
        t.histogram("dgr_gateway_ttft_seconds", "Time to first token.", &self.ttft);
        t.histogram("dgr_gateway_inter_token_seconds", "Time between successive tokens of a stream.", &self.itl);
        let mut errors = t.family("dgr_gateway_errors_total", "Requests refused or failed, by kind.", Counter);
        for (kind, n) in self.errors.lock().unwrap_or_else(|p| p.into_inner()).iter() {
            errors.sample(&[("kind", kind)], n);
        }
        let mut checks = t.family("dgr_gateway_spot_checks_total", "Stage spot checks, by result.", Counter);
        for (result, n) in self.checks.lock().unwrap_or_else(|p| p.into_inner()).iter() {
            checks.sample(&[("result", result)], n);
        }
        t.metric("dgr_gateway_queue_depth", "Requests waiting for admission.", Gauge, queue_depth);
        t.metric("dgr_gateway_running", "Generations running.", Gauge, running);
        t.finish()
    }
}

/// The usage reporter's counters: reports waiting for a tracker, stored, retried, refused, and
/// how often the queue was full (zeros before the first report).
pub fn render_reports(stats: Option<&dgr_driver::ReportStats>) -> String {
    use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
    let n = |f: fn(&dgr_driver::ReportStats) -> &AtomicU64| stats.map_or(0, |s| f(s).load(Relaxed));
    let mut t = Text::new();
    t.metric(
        "dgr_gateway_usage_reports_pending",
        "Usage reports of finished requests not yet stored by a tracker.",
        Gauge,
        n(|s| &s.pending),
    );
    t.metric("dgr_gateway_usage_reports_recorded_total", "Usage reports a tracker stored (or had already).", Counter, n(|s| &s.recorded));
    t.metric(
        "dgr_gateway_usage_report_retries_total",
        "Usage report sends that reached no tracker and were retried.",
        Counter,
        n(|s| &s.retries),
    );
    t.metric("dgr_gateway_usage_reports_refused_total", "Usage reports a tracker refused for good.", Counter, n(|s| &s.refused));
    t.metric(
        "dgr_gateway_usage_queue_full_total",
        "Finished requests that found the usage report queue full and waited.",
        Counter,
        n(|s| &s.queue_full),
    );
    t.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The families, labels and values the dashboard, the tests and scrapers read, as they were
    /// written before the renderer moved to dgr-telemetry.
    #[test]
    fn renders_the_names_labels_and_values_it_always_has() {
        let m = HttpMetrics::default();
        m.finished("smol", "k\"1", 9, 4, None);
        m.finished("smol", "k\"1", 3, 0, Some("route_failed"));
        m.check("agree");
        m.embedded("smol", 32, 160, true);
        m.drafted(&dgr_driver::DraftStats { steps: 3, drafted: 10, accepted: 7 });
        m.ttft.observe(0.03);
        let text = m.render(2, 1);
        for line in [
            "# HELP dgr_gateway_requests_total Requests finished, by model and key.",
            "# TYPE dgr_gateway_requests_total counter",
            "dgr_gateway_requests_total{model=\"smol\",key=\"k\\\"1\"} 2",
            "dgr_gateway_prompt_tokens_total{model=\"smol\",key=\"k\\\"1\"} 12",
            "dgr_gateway_completion_tokens_total{model=\"smol\",key=\"k\\\"1\"} 4",
            "# TYPE dgr_gateway_ttft_seconds histogram",
            "dgr_gateway_ttft_seconds_bucket{le=\"0.02\"} 0",
            "dgr_gateway_ttft_seconds_bucket{le=\"0.05\"} 1",
            "dgr_gateway_ttft_seconds_bucket{le=\"+Inf\"} 1",
            "dgr_gateway_ttft_seconds_sum 0.03",
            "dgr_gateway_ttft_seconds_count 1",
            "dgr_gateway_inter_token_seconds_count 0",
            "dgr_gateway_errors_total{kind=\"route_failed\"} 1",
            "dgr_gateway_verify_steps_total 3",
            "dgr_gateway_draft_tokens_total{outcome=\"accepted\"} 7",
            "dgr_gateway_draft_tokens_total{outcome=\"rejected\"} 3",
            "dgr_gateway_spot_checks_total{result=\"agree\"} 1",
            "dgr_gateway_embedding_requests_total{model=\"smol\"} 1",
            "dgr_gateway_embedding_failures_total{model=\"smol\"} 0",
            "dgr_gateway_embedding_inputs_total{model=\"smol\"} 32",
            "dgr_gateway_embedding_tokens_total{model=\"smol\"} 160",
            "# HELP dgr_gateway_queue_depth Requests waiting for admission.\n# TYPE dgr_gateway_queue_depth gauge\ndgr_gateway_queue_depth 2",
            "# HELP dgr_gateway_running Generations running.\n# TYPE dgr_gateway_running gauge\ndgr_gateway_running 1\n",
        ] {
            assert!(text.contains(line), "missing {line:?} in\n{text}");
        }
    }
}
