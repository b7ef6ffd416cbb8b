//! Route tickets (verify_ticket, check_ticket_open): see harness::ticket.
#![no_main]

libfuzzer_sys::fuzz_target!(init: dgr_fuzz::init("ticket"), |data: &[u8]| {
    dgr_fuzz::harness::ticket(data);
});
