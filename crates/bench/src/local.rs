//! Generation and embedding in one process: the whole model as one stage.

use crate::error::{BenchError, Result};
use dgr_driver::{Completion, FinishReason};
use dgr_engine::{Engine, Input, LogitRows, Pooler, SamplingParams, SeqInput, SeqState};
use std::time::Instant;

pub struct Request {
    pub prompt_tokens: Vec<u32>,
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    pub top_logprobs: usize,
    /// Keep going past end-of-generation tokens (as the reference runs do).
    pub ignore_eos: bool,
}

/// Prefills the prompt in one forward, then decodes one token per forward until `max_tokens`,
/// an end-of-generation token (unless ignored) or the context's end. `on_token` sees each token
/// as it is chosen.
pub fn generate<E: Engine>(stage: &E, is_eog: impl Fn(u32) -> bool, req: &Request, mut on_token: impl FnMut(u32)) -> Result<Completion> {
    if req.prompt_tokens.is_empty() {
        return Err(BenchError::Usage("the prompt is empty".into()));
    }
    let capacity = req.prompt_tokens.len() + req.max_tokens;
    let mut kv = stage.new_state(capacity, stage.layers())?;
    if kv.capacity() < req.prompt_tokens.len() + 1 {
        let why = format!("the prompt's {} tokens leave no room in the model's context of {}", req.prompt_tokens.len(), kv.capacity());
        return Err(BenchError::Usage(why));
    }
    let start = Instant::now();
    let mut out = Completion { finish_reason: FinishReason::Length, ..Default::default() };
    let mut input = req.prompt_tokens.clone();
    let mut decode_start = start;
    while out.tokens.len() < req.max_tokens {
        if kv.positions() + input.len() > kv.capacity() {
            out.finish_reason = FinishReason::Context;
            break;
        }
        let result = stage.forward(&mut [SeqInput { kv: &mut kv, input: Input::Tokens(&input), logits: LogitRows::Last }])?;
        let logits = &result[0].logits;
        let token = dgr_engine::sample(logits, &req.sampling, kv.positions() as u64);
        let (lp, top) = dgr_engine::logprobs(logits, token, req.top_logprobs);
        if out.tokens.is_empty() {
            out.timings.first_token(start, req.prompt_tokens.len());
            decode_start = Instant::now();
        }
        out.tokens.push(token);
        out.logprobs.push(lp);
        out.top_logprobs.push(top);
        on_token(token);
        if !req.ignore_eos && is_eog(token) {
            out.finish_reason = FinishReason::Stop;
            break;
        }
        input = vec![token];
    }
    out.timings.decoded(decode_start, out.tokens.len().saturating_sub(1));
    Ok(out)
}

/// The prompt's embedding in one process: one forward over the whole model, every row
/// final-normed, pooled as the model's metadata says and L2-normalised.
pub fn embed<E: Engine>(stage: &E, prompt_tokens: &[u32]) -> Result<Vec<f32>> {
    if prompt_tokens.is_empty() {
        return Err(BenchError::Usage("the input is empty".into()));
    }
    let mut pooler = Pooler::new(stage.config().pooling, stage.config().hidden)?;
    let mut kv = stage.new_state(prompt_tokens.len(), stage.layers())?;
    if kv.capacity() < prompt_tokens.len() {
        return Err(BenchError::Usage(format!(
            "the input's {} tokens exceed the model's context of {}",
            prompt_tokens.len(),
            kv.capacity()
        )));
    }
    let out = stage.forward(&mut [SeqInput { kv: &mut kv, input: Input::Tokens(prompt_tokens), logits: LogitRows::Normed }])?;
    pooler.push(&out[0].hidden);
    Ok(pooler.finish())
}
