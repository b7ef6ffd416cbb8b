//! Arbitrary bytes as an OpenAI completions / chat completions body: see harness::openai_body.
#![no_main]

libfuzzer_sys::fuzz_target!(init: dgr_fuzz::init("openai_body"), |data: &[u8]| {
    dgr_fuzz::harness::openai_body(data);
});
