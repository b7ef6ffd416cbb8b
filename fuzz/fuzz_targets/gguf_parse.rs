//! Arbitrary bytes as a GGUF file (dgr_gguf::Gguf::from_bytes): see harness::gguf_parse.
#![no_main]

libfuzzer_sys::fuzz_target!(init: dgr_fuzz::init("gguf_parse"), |data: &[u8]| {
    dgr_fuzz::harness::gguf_parse(data);
});
