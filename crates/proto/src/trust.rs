//! Which keys a process accepts on links it dials, where no ticket names the key to expect.
//!
//! Trackers prove their ticket-signing key (trackers sharing a ledger share it). The keys pinned
//! with `--tracker-key` are accepted and no other; with none pinned, each address's first link
//! teaches its key (trust on first use) and a later link to that address proving another key is
//! refused for the life of the process.
//!
//! Workers on a ticketless route (`--route`, no tracker to name them) prove their identity keys:
//! a driver's route knows each stage by the key it proved when the route was found, and a worker
//! its next hop by the key first seen at that address. An address pinned with `--peer-key
//! ADDR=HEX` accepts that key only. (A worker restarted without `--key-file` has a new key, so a
//! route or a worker that saw the old one refuses it: restart that process, or give the worker
//! a key file.)

use crate::VerifyingKey;
use std::collections::HashMap;
use std::sync::{Mutex, RwLock};

static PINNED: RwLock<Vec<VerifyingKey>> = RwLock::new(Vec::new());
static LEARNED: Mutex<Option<HashMap<String, VerifyingKey>>> = Mutex::new(None);
static PEER_PINS: RwLock<Option<HashMap<String, VerifyingKey>>> = RwLock::new(None);
static PEERS_LEARNED: Mutex<Option<HashMap<String, VerifyingKey>>> = Mutex::new(None);

/// Accept only `keys` from trackers from now on (none: trust on first use).
pub fn pin_tracker_keys(keys: Vec<VerifyingKey>) {
    *PINNED.write().unwrap_or_else(|e| e.into_inner()) = keys;
}

/// Accept only the key pinned for each of these addresses from the worker there, on ticketless
/// routes (replacing any pins before).
pub fn pin_peer_keys(pins: Vec<(String, VerifyingKey)>) {
    *PEER_PINS.write().unwrap_or_else(|e| e.into_inner()) = Some(pins.into_iter().collect());
}

/// A tracker key in hex, as `--tracker-key` takes it and a tracker prints it.
pub fn parse_tracker_key(s: &str) -> Result<VerifyingKey, String> {
    let bytes = hex::decode(s.trim()).map_err(|_| format!("{s:?} is not hex"))?;
    crate::verifying_key(&bytes).ok_or_else(|| format!("{s:?} is not a 32-byte Ed25519 public key"))
}

/// A worker's address and key, `ADDR=HEX` as `--peer-key` takes it (the key is the worker's id).
pub fn parse_peer_key(s: &str) -> Result<(String, VerifyingKey), String> {
    let (addr, key) = s.rsplit_once('=').ok_or_else(|| format!("{s:?} is not ADDR=KEY"))?;
    if addr.is_empty() {
        return Err(format!("{s:?} names no address"));
    }
    Ok((addr.to_string(), parse_tracker_key(key)?))
}

/// Why a tracker's proven key was not accepted.
pub(crate) fn check(addr: &str, peer: &VerifyingKey) -> Result<(), String> {
    let pinned = PINNED.read().unwrap_or_else(|e| e.into_inner());
    if !pinned.is_empty() {
        if pinned.contains(peer) {
            return Ok(());
        }
        let want: Vec<String> = pinned.iter().map(|k| hex::encode(k.as_bytes())).collect();
        return Err(format!("the tracker proved the key {}, not a pinned one ({})", hex::encode(peer.as_bytes()), want.join(", ")));
    }
    first_use(&LEARNED, "tracker", "--tracker-key", addr, peer)
}

/// Why the worker at `addr` on a ticketless route, proving `id` (its key in hex), is not
/// accepted.
pub fn check_peer(addr: &str, id: &str) -> Result<(), String> {
    let peer = parse_tracker_key(id)?;
    match pinned(addr, id, &peer)? {
        true => Ok(()),
        false => first_use(&PEERS_LEARNED, "worker", "--peer-key", addr, &peer),
    }
}

/// Why the worker at `addr`, proving `id` as a ticketless route is found, is not accepted: a
/// key pinned there and not proved. Without a pin, the route knows the stage by this key from
/// now on (said, as a first use is).
pub fn check_route_peer(addr: &str, id: &str) -> Result<(), String> {
    let peer = parse_tracker_key(id)?;
    if !pinned(addr, id, &peer)? {
        eprintln!("dgr: trusting the worker at {addr} on first use: its key is {id} (pin it with --peer-key)");
    }
    Ok(())
}

/// Whether a key is pinned for `addr`, refusing `peer` (`id` in hex) where another is.
fn pinned(addr: &str, id: &str, peer: &VerifyingKey) -> Result<bool, String> {
    match PEER_PINS.read().unwrap_or_else(|e| e.into_inner()).as_ref().and_then(|p| p.get(addr)) {
        Some(pin) if pin == peer => Ok(true),
        Some(pin) => Err(format!("the worker at {addr} proved the key {id}, not the one pinned there ({})", hex::encode(pin.as_bytes()))),
        None => Ok(false),
    }
}

/// Trust on first use: `addr`'s first key is learned (and said), and any other refused later.
fn first_use(
    learned: &Mutex<Option<HashMap<String, VerifyingKey>>>,
    what: &str,
    flag: &str,
    addr: &str,
    peer: &VerifyingKey,
) -> Result<(), String> {
    let mut learned = learned.lock().unwrap_or_else(|e| e.into_inner());
    match learned.get_or_insert_with(HashMap::new).entry(addr.to_string()) {
        std::collections::hash_map::Entry::Occupied(k) if k.get() == peer => Ok(()),
        std::collections::hash_map::Entry::Occupied(k) => Err(format!(
            "the {what} proved the key {}, but {} on this process's first link to it; if its key changed on purpose, restart or pin it with {flag}",
            hex::encode(peer.as_bytes()),
            hex::encode(k.get().as_bytes())
        )),
        std::collections::hash_map::Entry::Vacant(v) => {
            eprintln!("dgr: trusting the {what} at {addr} on first use: its key is {} (pin it with {flag})", hex::encode(peer.as_bytes()));
            v.insert(*peer);
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::{new_signing_key, read_frame, respond_as, write_frame, Challenge, Identity, TrackerBody, TrackerClient, TrackerFrame};
    use std::time::Duration;
    use tokio::io::AsyncReadExt;
    use tokio::net::TcpListener;

    const T: Duration = Duration::from_secs(5);

    /// A tracker's opening on `l` as `id`, for `n` connections: the channel, Hello, Challenge.
    fn fake_tracker(l: TcpListener, id: Identity, n: usize) -> tokio::task::JoinHandle<()> {
        tokio::spawn(async move {
            for _ in 0..n {
                let Ok((mut s, _)) = l.accept().await else { return };
                let mut head = [0u8; 4];
                if s.read_exact(&mut head).await.is_err() {
                    continue;
                }
                let Ok(mut link) = respond_as(&id, head, s, T).await else { continue };
                if read_frame(&mut link, 4096).await.is_ok() {
                    let _ = write_frame(&mut link, &TrackerFrame::new(TrackerBody::Challenge(Challenge::default()))).await;
                }
            }
        })
    }

    /// One test body, since the pins are the process's: trust on first use per address, a
    /// changed key refused there, a pinned key accepted, another refused.
    #[tokio::test]
    async fn a_tracker_key_is_learned_on_first_use_and_pinned_keys_are_the_only_ones_taken() {
        let (a, b) = (new_signing_key().unwrap(), new_signing_key().unwrap());
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let first = fake_tracker(l, Identity::new(&a).unwrap(), 2);
        TrackerClient::connect(&addr, T).await.expect("first use teaches the key");
        TrackerClient::connect(&addr, T).await.expect("the same key again");
        first.await.unwrap();

        // Another tracker takes the address over.
        let l = TcpListener::bind(&addr).await.unwrap();
        let _second = fake_tracker(l, Identity::new(&b).unwrap(), 3);
        let e = TrackerClient::connect(&addr, T).await.err().expect("a changed key is refused");
        assert!(e.to_string().contains("first link"), "{e}");

        super::pin_tracker_keys(vec![b.verifying_key()]);
        TrackerClient::connect(&addr, T).await.expect("the pinned key");
        super::pin_tracker_keys(vec![a.verifying_key()]);
        let e = TrackerClient::connect(&addr, T).await.err().expect("a key not pinned");
        assert!(e.to_string().contains("not a pinned one"), "{e}");
        super::pin_tracker_keys(Vec::new());
    }

    #[test]
    fn tracker_and_peer_keys_parse_from_hex_and_nothing_else() {
        let k = new_signing_key().unwrap().verifying_key();
        assert_eq!(super::parse_tracker_key(&hex::encode(k.as_bytes())), Ok(k));
        assert!(super::parse_tracker_key("zz").is_err());
        assert!(super::parse_tracker_key(&hex::encode([1u8; 31])).is_err());
        let key = hex::encode(k.as_bytes());
        assert_eq!(super::parse_peer_key(&format!("127.0.0.1:7000={key}")), Ok(("127.0.0.1:7000".to_string(), k)));
        assert!(super::parse_peer_key(&key).is_err(), "no address");
        assert!(super::parse_peer_key(&format!("={key}")).is_err(), "an empty address");
    }
}
