//! What a routed request reports: its tokens and timings, and per seam and stage figures.

use serde::Serialize;

#[derive(Serialize, Default, Debug, Clone)]
pub struct Timings {
    pub ttft_ms: f64,
    pub prefill_ms: f64,
    pub decode_ms: f64,
    pub prefill_tok_per_s: f64,
    pub decode_tok_per_s: f64,
}

impl Timings {
    /// Records the first token, `start` being when the request began with `prompt` tokens.
    pub fn first_token(&mut self, start: std::time::Instant, prompt: usize) {
        let el = start.elapsed().as_secs_f64();
        self.ttft_ms = el * 1e3;
        self.prefill_ms = el * 1e3;
        self.prefill_tok_per_s = prompt as f64 / el;
    }

    /// Records the decode phase: `tokens` generated after the first since `since`.
    pub fn decoded(&mut self, since: std::time::Instant, tokens: usize) {
        if tokens > 0 {
            let el = since.elapsed().as_secs_f64();
            self.decode_ms = el * 1e3;
            self.decode_tok_per_s = tokens as f64 / el;
        }
    }
}

/// The seam from stage `from` to stage `from + 1`.
#[derive(Serialize, Default, Debug, Clone)]
pub struct SeamReport {
    pub from: u32,
    pub bytes: u64,
    pub latency_ms_p50: f64,
    pub latency_ms_p99: f64,
}

#[derive(Serialize, Default, Debug, Clone)]
pub struct StageReport {
    pub stage: u32,
    pub addr: String,
    pub queue_wait_ms_p50: f64,
    pub queue_wait_ms_max: f64,
    pub compute_ms_total: f64,
}

/// What one stage computed for the session, as it reported when the session was closed.
#[derive(Serialize, Default, Debug, Clone, PartialEq, Eq)]
pub struct UsageReport {
    pub stage: u32,
    pub tokens_prefilled: u64,
    pub tokens_decoded: u64,
    pub layer_tokens: u64,
}

#[derive(Serialize, Default, Debug, Clone)]
pub struct Completion {
    pub tokens: Vec<u32>,
    pub logprobs: Vec<f32>,
    pub top_logprobs: Vec<Vec<(u32, f32)>>,
    pub finish_reason: String,
    pub timings: Timings,
    pub seams: Vec<SeamReport>,
    pub stages: Vec<StageReport>,
    /// Per stage, in route order; a stage that did not report in time is missing.
    pub usage: Vec<UsageReport>,
}

/// The q-quantile (0..=1) of samples, nearest rank.
pub(crate) fn quantile(v: &[f64], q: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    s[((s.len() as f64 * q).ceil() as usize).clamp(1, s.len()) - 1]
}
