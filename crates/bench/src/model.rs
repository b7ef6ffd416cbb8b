//! Finding and opening the model a command runs on: the `--model` argument every command that
//! computes takes, the benchmarks' and the binary's alike.

use crate::error::{BenchError, Result};
use dgr_engine::{EngineSpec, Numerics};
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

/// `--numerics` on every command that computes: how activations meet the weights.
#[derive(clap::Args, Clone, Copy, Debug)]
pub struct NumericsArg {
    /// exact: f32 activations, within ~1e-6 of the float64 computation; fast: integer
    /// activations (refused at start where the engine has no fast kernels)
    #[arg(long, default_value = "exact", value_parser = numerics())]
    pub numerics: Numerics,
}

fn numerics() -> impl clap::builder::TypedValueParser<Value = Numerics> {
    use clap::builder::TypedValueParser;
    clap::builder::PossibleValuesParser::new(Numerics::ALL.iter().map(|n| n.name())).try_map(|s| s.parse::<Numerics>())
}

impl NumericsArg {
    /// The engine spec for `threads` threads in these numerics.
    pub fn spec(&self, threads: usize) -> EngineSpec {
        EngineSpec { numerics: self.numerics, ..EngineSpec::threads(threads) }
    }

    /// The flags that start a `dgr worker` in these numerics, refused here first (before any
    /// worker starts) if the CPU backend cannot compute in them.
    pub fn worker_flags(&self) -> std::result::Result<[String; 2], dgr_engine::EngineError> {
        dgr_engine::check_numerics(dgr_engine::BackendKind::Cpu, self.numerics)?;
        Ok(["--numerics".into(), self.numerics.name().into()])
    }
}
