//! Arbitrary bytes as a stage-protocol Frame and its checks: see harness::stage_frame.
#![no_main]

libfuzzer_sys::fuzz_target!(init: dgr_fuzz::init("stage_frame"), |data: &[u8]| {
    dgr_fuzz::harness::stage_frame(data);
});
