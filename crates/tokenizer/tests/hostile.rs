//! Arbitrary input never panics and stays fast.
#![cfg(feature = "real-model")]

mod common;

use std::time::{Duration, Instant};

fn check(text: &str, budget: Duration) {
    let tok = common::smollm();
    let start = Instant::now();
    let ids = tok.encode(text, true, true).unwrap();
    assert!(start.elapsed() < budget, "{} chars took {:?}", text.chars().count(), start.elapsed());
    // byte-level BPE loses nothing
    assert_eq!(tok.decode(&ids[1..]), text);
}

#[test]
fn long_runs_are_fast() {
    let second = Duration::from_secs(2);
    check(&"a".repeat(100_000), second);
    check(&" ".repeat(100_000), second);
    check(&"\n".repeat(100_000), second);
    check(&" \t".repeat(50_000), second);
    check(&"9".repeat(100_000), second);
    check(&"!?".repeat(50_000), second);
    check(&"日本".repeat(50_000), second);
    check(&"<|im_start|>".repeat(10_000), second);
    check(&"<|im_start".repeat(10_000), second);
    check(&"ab ".repeat(100_000), second);
}

#[test]
fn odd_unicode_round_trips() {
    let second = Duration::from_secs(1);
    for text in [
        "\u{301}",
        "\u{301}\u{302}\u{303}a\u{301}",
        "\0",
        "\0\0 \0x",
        "\u{FEFF}bom",
        "\u{10FFFF}\u{E000}\u{378}",
        "\u{200B}\u{200D}\u{2028}\u{2029}\u{3000}\u{85}",
        "🏳️‍🌈👨‍👩‍👧‍👦",
        "\r\r\n\n\r",
        "'s's'S''''",
        " ",
        "<|im_start|",
        "<|im_end|><|im_end|>",
    ] {
        check(text, second);
    }
}

#[test]
fn out_of_range_ids_decode_to_nothing() {
    let tok = common::smollm();
    assert_eq!(tok.decode(&[u32::MAX, 19556]), "Hello");
}
