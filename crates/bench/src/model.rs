//! Finding and opening the model a command runs on: the `--model` argument every command that
//! computes takes, the benchmarks' and the binary's alike.

use crate::error::{BenchError, Result};
use dgr_engine::{EngineId, EngineSpec, KvDtype, Numerics};
use dgr_gguf::Gguf;
use std::path::PathBuf;
use std::sync::Arc;

#[derive(clap::Args, Clone, Debug)]
pub struct ModelArg {
    /// GGUF model file, or a Transformers checkpoint directory (config.json, *.safetensors,
    /// tokenizer.json) [default: the cached SmolLM2-135M-Instruct Q4_1, fetched by scripts/fetch-model.sh]
    #[arg(long, short = 'm', env = "DGR_MODEL")]
    pub model: Option<PathBuf>,
}

impl ModelArg {
    pub fn path(&self) -> Result<PathBuf> {
        match &self.model {
            Some(p) => Ok(p.clone()),
            None => {
                let p = dgr_gguf::default_model_path();
                if !p.exists() {
                    return Err(BenchError::Usage(format!(
                        "no --model given and the default model is not at {}; fetch it with scripts/fetch-model.sh \
                         (set DGR_MODEL_DIR to choose where it is cached)",
                        p.display()
                    )));
                }
                Ok(p)
            }
        }
    }

    pub fn open(&self) -> Result<Arc<Gguf>> {
        let p = self.path()?;
        let g = dgr_hf::open_any(&p).map_err(|source| BenchError::Open { path: p.display().to_string(), source })?;
        Ok(Arc::new(g))
    }

    /// The tokenizer of the model, opened as `g`.
    pub fn tokenizer(&self, g: &Gguf) -> Result<dgr_tokenizer::Tokenizer> {
        let p = self.path()?;
        dgr_tokenizer::Tokenizer::for_model(&p, g).map_err(|source| BenchError::Tokenizer { path: p.display().to_string(), source })
    }
}

/// `--numerics` and `--kv-dtype` on every command that computes: how activations meet the
/// weights, and how keys and values are cached. Both are part of the engine's id, so workers
/// that differ in either never share a batch or a route.
#[derive(clap::Args, Clone, Copy, Debug)]
pub struct NumericsArg {
    /// fast: 16-bit integer activations where the weights are integer codes (about 1/100 of
    /// llama.cpp's distance from the float64 computation, and faster); exact: f32 activations,
    /// within ~1e-6 of it. Float weights compute exactly in both
    #[arg(long, default_value = "fast", value_parser = names::<Numerics>(Numerics::ALL.iter().map(|n| n.name())))]
    pub numerics: Numerics,
    /// How the KV cache stores keys and values: f32 as computed; f16 (half the bytes); q8_0,
    /// int8 in blocks of 32 with an f16 scale (34 bytes per 32 values, 0.27 of f32's). Scores
    /// and sums stay f32; README's KV dtype table has each one's measured accuracy
    #[arg(long, default_value = "f32", value_parser = names::<KvDtype>(KvDtype::ALL.iter().map(|n| n.name())))]
    pub kv_dtype: KvDtype,
}

/// A clap parser that takes exactly `names` (listing them when refused), parsed as a `T`.
fn names<T>(names: impl Iterator<Item = &'static str>) -> impl clap::builder::TypedValueParser<Value = T>
where
    T: std::str::FromStr + Clone + Send + Sync + 'static,
    T::Err: std::error::Error + Send + Sync + 'static,
{
    use clap::builder::TypedValueParser;
    clap::builder::PossibleValuesParser::new(names).try_map(|s| s.parse::<T>())
}

impl NumericsArg {
    /// The flags of the engine `id` computes with.
    pub fn of(id: EngineId) -> NumericsArg {
        NumericsArg { numerics: id.numerics, kv_dtype: id.kv }
    }

    /// The engine spec for `threads` threads in these numerics and KV dtype.
    pub fn spec(&self, threads: usize) -> EngineSpec {
        EngineSpec { numerics: self.numerics, kv: self.kv_dtype, ..EngineSpec::threads(threads) }
    }

    /// The flags that start a `dgr worker` in these numerics and KV dtype, refused here first
    /// (before any worker starts) if the CPU backend cannot compute in them.
    pub fn worker_flags(&self) -> std::result::Result<[String; 4], dgr_engine::EngineError> {
        dgr_engine::check_numerics(dgr_engine::BackendKind::Cpu, self.numerics)?;
        Ok(["--numerics".into(), self.numerics.name().into(), "--kv-dtype".into(), self.kv_dtype.name().into()])
    }
}
