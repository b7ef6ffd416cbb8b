//! Finding and opening the model a command runs on: the `--model` argument every command that
//! computes takes, the benchmarks' and the binary's alike.

use crate::error::{BenchError, Result};
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
