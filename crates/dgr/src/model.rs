//! Finding and opening the model a command runs on.

use anyhow::{bail, Context, Result};
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
                    bail!(
                        "no --model given and the default model is not at {}; fetch it with scripts/fetch-model.sh \
                         (set DGR_MODEL_DIR to choose where it is cached)",
                        p.display()
                    );
                }
                Ok(p)
            }
        }
    }

    pub fn open(&self) -> Result<Arc<Gguf>> {
        let p = self.path()?;
        let g = dgr_hf::open_any(&p).with_context(|| format!("opening {}", p.display()))?;
        Ok(Arc::new(g))
    }

    /// The tokenizer of the model, opened as `g`.
    pub fn tokenizer(&self, g: &Gguf) -> Result<dgr_tokenizer::Tokenizer> {
        let p = self.path()?;
        dgr_tokenizer::Tokenizer::for_model(&p, g).with_context(|| format!("the tokenizer of {}", p.display()))
    }
}

/// `--threads N` on every command that computes.
#[derive(clap::Args, Clone, Copy, Debug)]
pub struct ThreadsArg {
    /// Compute threads [default: the number of CPUs]
    #[arg(long, short = 't')]
    pub threads: Option<usize>,
}

impl ThreadsArg {
    pub fn get(&self) -> usize {
        self.threads.unwrap_or_else(|| std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1)).max(1)
    }
}
