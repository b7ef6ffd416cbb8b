//! Clap value parsers for addresses: every flag that takes one takes the one form
//! `dgr_proto::parse_addr` defines, normalized to `host:port` before anything dials or binds.

use dgr_proto::{parse_addr, parse_addrs, AddrError};

/// One address.
pub fn one(s: &str) -> Result<String, AddrError> {
    parse_addr(s)
}

/// A comma-separated list of addresses, each normalized, joined again by commas.
pub fn list(s: &str) -> Result<String, AddrError> {
    Ok(parse_addrs(s)?.join(","))
}
