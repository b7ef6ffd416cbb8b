//! Arbitrary bytes as a TrackerFrame: see harness::tracker_frame.
#![no_main]

libfuzzer_sys::fuzz_target!(init: dgr_fuzz::init("tracker_frame"), |data: &[u8]| {
    dgr_fuzz::harness::tracker_frame(data);
});
