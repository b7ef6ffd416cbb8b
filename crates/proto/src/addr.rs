//! The one address form every command takes (`--tracker`, `--route`, `--listen`, `--advertise`):
//! `host:port`, `[v6]:port`, or either behind `dgr://`, `tcp://` or `http://` (a trailing `/`
//! allowed). Every form means the same TCP endpoint speaking dgr's own protocol; the scheme is
//! only accepted because users copy addresses from URLs. Anything else is refused by name, so a
//! mistyped address fails at the command line instead of in a silent retry loop.

/// The schemes an address may carry; each names the same endpoint as the bare `host:port`.
pub const SCHEMES: [&str; 3] = ["dgr", "tcp", "http"];

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AddrError {
    #[error("{0:?}: an address is host:port, [v6]:port or dgr://, tcp://, http:// before either")]
    Malformed(String),
    #[error("{addr:?}: the scheme {scheme}:// is not one dgr speaks (use host:port, or dgr://, tcp://, http://)")]
    Scheme { addr: String, scheme: String },
    #[error("{0:?}: no port (an address is host:port)")]
    NoPort(String),
    #[error("{0:?}: the port is not a number from 0 to 65535")]
    BadPort(String),
    #[error("{0:?}: an address names a host and a port, no path")]
    Path(String),
}

/// `s` as the plain `host:port` (or `[v6]:port`) that sockets are dialled and bound with.
pub fn parse_addr(s: &str) -> Result<String, AddrError> {
    let t = s.trim();
    let rest = match t.split_once("://") {
        Some((scheme, rest)) => {
            let lower = scheme.to_ascii_lowercase();
            if !SCHEMES.contains(&lower.as_str()) {
                return Err(AddrError::Scheme { addr: s.into(), scheme: scheme.into() });
            }
            let rest = rest.strip_suffix('/').unwrap_or(rest);
            if rest.contains('/') {
                return Err(AddrError::Path(s.into()));
            }
            rest
        }
        None if t.contains('/') => return Err(AddrError::Path(s.into())),
        None => t,
    };
    let (host, port) = if let Some(v6) = rest.strip_prefix('[') {
        let (host, after) = v6.split_once(']').ok_or_else(|| AddrError::Malformed(s.into()))?;
        let port = after.strip_prefix(':').ok_or_else(|| AddrError::NoPort(s.into()))?;
        if host.parse::<std::net::Ipv6Addr>().is_err() {
            return Err(AddrError::Malformed(s.into()));
        }
        (format!("[{host}]"), port)
    } else {
        let (host, port) = rest.rsplit_once(':').ok_or_else(|| AddrError::NoPort(s.into()))?;
        // A bare v6 address without brackets: its port cannot be told from its last group.
        if host.contains(':') {
            return Err(AddrError::Malformed(s.into()));
        }
        (host.to_string(), port)
    };
    if host.is_empty() || host.chars().any(|c| c.is_whitespace() || c == '@' || c == ',') {
        return Err(AddrError::Malformed(s.into()));
    }
    let port: u16 = port.parse().map_err(|_| AddrError::BadPort(s.into()))?;
    Ok(format!("{host}:{port}"))
}

/// A comma-separated list of addresses (the trackers of a swarm, the stages of a route), each
/// in the one form; an empty list is refused.
pub fn parse_addrs(s: &str) -> Result<Vec<String>, AddrError> {
    s.split(',').map(parse_addr).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_form_names_the_same_endpoint() {
        for s in ["127.0.0.1:7400", "dgr://127.0.0.1:7400", "tcp://127.0.0.1:7400", "http://127.0.0.1:7400/", "HTTP://127.0.0.1:7400"] {
            assert_eq!(parse_addr(s).unwrap(), "127.0.0.1:7400", "{s}");
        }
        assert_eq!(parse_addr("[::1]:80").unwrap(), "[::1]:80");
        assert_eq!(parse_addr("http://[::1]:80").unwrap(), "[::1]:80");
        assert_eq!(parse_addr("localhost:0").unwrap(), "localhost:0");
        assert_eq!(parse_addrs("a:1,http://b:2").unwrap(), vec!["a:1".to_string(), "b:2".to_string()]);
    }

    #[test]
    fn other_forms_are_refused_by_name() {
        assert!(matches!(parse_addr("https://h:1"), Err(AddrError::Scheme { .. })));
        assert!(matches!(parse_addr("ftp://h:1"), Err(AddrError::Scheme { .. })));
        assert!(matches!(parse_addr("h"), Err(AddrError::NoPort(_))));
        assert!(matches!(parse_addr("http://h"), Err(AddrError::NoPort(_))));
        assert!(matches!(parse_addr("h:99999"), Err(AddrError::BadPort(_))));
        assert!(matches!(parse_addr("h:x"), Err(AddrError::BadPort(_))));
        assert!(matches!(parse_addr("http://h:1/v1"), Err(AddrError::Path(_))));
        assert!(matches!(parse_addr("::1:80"), Err(AddrError::Malformed(_))));
        assert!(matches!(parse_addr("[::1]"), Err(AddrError::NoPort(_))));
        assert!(matches!(parse_addr("[zz]:1"), Err(AddrError::Malformed(_))));
        assert!(matches!(parse_addr(":80"), Err(AddrError::Malformed(_))));
        assert!(parse_addrs("a:1,").is_err());
    }
}
