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

/// Why a generation ended. Serialized as its name (`as_str`); the OpenAI API shows a
/// cancelled one as "stop".
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-generation token, or a stop string.
    Stop,
    /// `max_tokens` reached.
    #[default]
    Length,
    /// The caller stopped it (the client left).
    Cancelled,
    /// The one-process driver's context is full.
    Context,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Cancelled => "cancelled",
            FinishReason::Context => "context",
        }
    }
}

by_name!(FinishReason);

#[derive(Serialize, Default, Debug, Clone)]
pub struct Completion {
    pub tokens: Vec<u32>,
    pub logprobs: Vec<f32>,
    pub top_logprobs: Vec<Vec<(u32, f32)>>,
    pub finish_reason: FinishReason,
    pub timings: Timings,
    pub seams: Vec<SeamReport>,
    pub stages: Vec<StageReport>,
    /// Per stage, in route order; a stage that did not report in time is missing.
    pub usage: Vec<UsageReport>,
    /// An embedding session's vector (L2-normalised, the model's hidden size); empty otherwise.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub embedding: Vec<f32>,
    /// Prompt tokens every stage attached from its prefix cache instead of computing.
    pub cached_tokens: usize,
    /// Speculative steps, their drafts and the drafts accepted.
    pub drafts: crate::DraftStats,
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finish_reasons_keep_their_names() {
        let all = [
            (FinishReason::Stop, "stop"),
            (FinishReason::Length, "length"),
            (FinishReason::Cancelled, "cancelled"),
            (FinishReason::Context, "context"),
        ];
        for (r, name) in all {
            assert_eq!((r.as_str(), r.to_string(), serde_json::to_value(r).unwrap()), (name, name.to_string(), serde_json::json!(name)));
            assert!(r == name);
        }
        assert_eq!(Completion::default().finish_reason, FinishReason::Length);
    }
}
