//! The channel over loopback TCP: bytes arrive whole and the peer is known by its key; a byte
//! flipped in flight is an integrity error; a recorded handshake replayed to a new responder fails.

use super::*;
use tokio::net::TcpListener;

const T: Duration = Duration::from_secs(5);

async fn pair() -> (SecureStream, SecureStream) {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let server = tokio::spawn(async move { respond(l.accept().await.unwrap().0, T).await.unwrap() });
    let client = initiate(TcpStream::connect(addr).await.unwrap(), T).await.unwrap();
    (client, server.await.unwrap())
}

#[tokio::test]
async fn bytes_arrive_whole_and_each_end_knows_the_other_by_its_key() {
    let (mut c, mut s) = pair().await;
    assert_eq!(c.peer(), Some(&local_key().unwrap()));
    assert_eq!(s.peer(), Some(&local_key().unwrap()));
    let big: Vec<u8> = (0..1_000_003u32).map(|i| (i % 251) as u8).collect();
    let sent = big.clone();
    let writer = tokio::spawn(async move {
        c.write_all(&sent).await.unwrap();
        c.flush().await.unwrap();
        c
    });
    let mut got = vec![0u8; big.len()];
    s.read_exact(&mut got).await.unwrap();
    assert_eq!(got, big);
    let mut c = writer.await.unwrap();
    s.write_all(b"back").await.unwrap();
    s.flush().await.unwrap();
    let mut back = [0u8; 4];
    c.read_exact(&mut back).await.unwrap();
    assert_eq!(&back, b"back");
}

/// Forwards a->b, flipping the byte at `flip` (counted from the first byte) if any; returns
/// everything that passed from a to b.
async fn relay(mut a: TcpStream, mut b: TcpStream, flip: Option<usize>) -> Vec<u8> {
    let (mut ar, mut aw) = a.split();
    let (mut br, mut bw) = b.split();
    let up = async {
        let mut seen = Vec::new();
        let mut buf = [0u8; 4096];
        loop {
            let n = match ar.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            for (i, byte) in buf[..n].iter_mut().enumerate() {
                if Some(seen.len() + i) == flip {
                    *byte ^= 1;
                }
            }
            seen.extend_from_slice(&buf[..n]);
            if bw.write_all(&buf[..n]).await.is_err() {
                break;
            }
        }
        let _ = bw.shutdown().await;
        seen
    };
    let down = async {
        let _ = tokio::io::copy(&mut br, &mut aw).await;
        let _ = aw.shutdown().await;
    };
    let (seen, _) = tokio::join!(up, down);
    seen
}

/// A client talking to a responder through `relay`: what the client sent, and what the
/// responder read of `msg` (or its error).
async fn through_relay(msg: &'static [u8], flip: Option<usize>) -> (Vec<u8>, std::io::Result<Vec<u8>>) {
    let server_l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let server_addr = server_l.local_addr().unwrap();
    let relay_l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let relay_addr = relay_l.local_addr().unwrap();
    let server = tokio::spawn(async move {
        let mut s = respond(server_l.accept().await.unwrap().0, T).await?;
        let mut got = vec![0u8; msg.len()];
        s.read_exact(&mut got).await?;
        Ok::<_, Error>(got)
    });
    let relayed = tokio::spawn(async move {
        let (a, _) = relay_l.accept().await.unwrap();
        relay(a, TcpStream::connect(server_addr).await.unwrap(), flip).await
    });
    let mut c = initiate(TcpStream::connect(relay_addr).await.unwrap(), T).await.unwrap();
    c.write_all(msg).await.unwrap();
    c.flush().await.unwrap();
    let got = server.await.unwrap();
    drop(c);
    (relayed.await.unwrap(), got)
}

#[tokio::test]
async fn a_byte_flipped_in_flight_is_an_integrity_error_and_the_bytes_are_not_in_clear() {
    const MSG: &[u8] = b"the prompt's token ids 101 2045 7 and a hidden row";
    let (clean, got) = through_relay(MSG, None).await;
    assert_eq!(got.unwrap(), MSG);
    assert!(!clean.windows(MSG.len()).any(|w| w == MSG), "the message is not in clear on the wire");
    // The handshake is 4 + (2 + 32) + (2 + 64 + 96 + 16 ...) bytes; the last byte sent is the
    // transport message's tag.
    let (_, got) = through_relay(MSG, Some(clean.len() - 1)).await;
    let e = got.unwrap_err();
    assert_eq!(SecureError::of(&e), Some(&SecureError::Integrity), "{e}");
}

#[tokio::test]
async fn a_recorded_handshake_replayed_to_a_new_responder_fails() {
    const MSG: &[u8] = b"recorded session";
    let (recorded, got) = through_relay(MSG, None).await;
    assert_eq!(got.unwrap(), MSG);
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let server = tokio::spawn(async move {
        let mut s = respond(l.accept().await.unwrap().0, T).await?;
        let mut got = vec![0u8; MSG.len()];
        s.read_exact(&mut got).await?;
        Ok::<_, Error>(got)
    });
    let mut replayer = TcpStream::connect(addr).await.unwrap();
    // The replayer sends every recorded byte without reading: the responder's fresh ephemeral
    // key makes the recorded third message undecryptable.
    let _ = replayer.write_all(&recorded).await;
    let e = server.await.unwrap().unwrap_err();
    assert!(matches!(SecureError::of(&e), Some(SecureError::Handshake(_))), "{e}");
}
