use std::sync::OnceLock;

use dgr_tokenizer::Tokenizer;

/// The default model's tokenizer, loaded once per test binary. A missing model
/// fails the test: these tests are the only check against llama.cpp.
pub fn smollm() -> &'static Tokenizer {
    static TOKENIZER: OnceLock<Tokenizer> = OnceLock::new();
    TOKENIZER.get_or_init(|| {
        let path = dgr_gguf::default_model_path();
        assert!(path.exists(), "model not found at {}: run scripts/fetch-model.sh to download it", path.display());
        let gguf = dgr_gguf::Gguf::open(&path).expect("open model");
        Tokenizer::from_gguf(&gguf).expect("build tokenizer")
    })
}
