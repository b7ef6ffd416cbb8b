//! A one-request HTTP/1.1 responder for the plain-text GET endpoints that workers and trackers
//! answer on their protocol port (`/metrics`, `/health`). The peer is untrusted: the request
//! head is bounded, and every read and write has a deadline.

use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// The most of a request head read before answering.
const MAX_HEAD: usize = 8192;
/// How long the peer has to send its head, and to take the answer.
const WAIT: Duration = Duration::from_secs(5);

/// Reads the request head (`head` holds what was read of it already), answers with
/// `answer(path)`'s status and body, and closes. A peer that sends no complete head within
/// [`WAIT`] gets nothing; one past [`MAX_HEAD`] is answered on what arrived.
pub async fn serve_get(stream: TcpStream, head: Vec<u8>, answer: impl FnOnce(&[u8]) -> (&'static str, String)) {
    serve_within(stream, head, answer, WAIT).await
}

async fn serve_within(mut stream: TcpStream, mut head: Vec<u8>, answer: impl FnOnce(&[u8]) -> (&'static str, String), wait: Duration) {
    let mut buf = [0u8; 1024];
    let read = tokio::time::timeout(wait, async {
        while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < MAX_HEAD {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => return false,
                Ok(n) => head.extend_from_slice(&buf[..n]),
            }
        }
        true
    })
    .await;
    if read != Ok(true) {
        return;
    }
    let path = head.split(|b| *b == b' ').nth(1).unwrap_or_default();
    let (status, body) = answer(path);
    let resp = format!(
        "HTTP/1.1 {status}\r\ncontent-type: text/plain; version=0.0.4\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    let _ = tokio::time::timeout(wait, async {
        let _ = stream.write_all(resp.as_bytes()).await;
        let _ = stream.shutdown().await;
    })
    .await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::net::TcpListener;

    /// Serves one connection on a fresh port; returns what the client read back.
    async fn exchange(request: Vec<u8>, close_after: bool) -> String {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = tokio::spawn(async move {
            let (s, _) = listener.accept().await.unwrap();
            serve_get(s, Vec::new(), |path| match path {
                b"/health" => ("200 OK", "ok\n".into()),
                _ => ("404 Not Found", String::new()),
            })
            .await
        });
        let mut c = TcpStream::connect(addr).await.unwrap();
        c.write_all(&request).await.unwrap();
        if close_after {
            c.shutdown().await.unwrap();
        }
        let mut out = String::new();
        tokio::time::timeout(Duration::from_secs(10), c.read_to_string(&mut out)).await.expect("an answer in time").unwrap();
        tokio::time::timeout(Duration::from_secs(10), server).await.expect("the responder ends").unwrap();
        out
    }

    #[tokio::test]
    async fn answers_the_path_asked_for() {
        let ok = exchange(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n".to_vec(), false).await;
        assert!(ok.starts_with("HTTP/1.1 200 OK\r\n") && ok.ends_with("\r\n\r\nok\n"), "{ok:?}");
        assert!(ok.contains("content-length: 3\r\n"), "{ok:?}");
        let missing = exchange(b"GET /nope HTTP/1.1\r\n\r\n".to_vec(), false).await;
        assert!(missing.starts_with("HTTP/1.1 404 Not Found\r\n"), "{missing:?}");
    }

    #[tokio::test]
    async fn a_head_past_the_cap_is_answered_on_what_arrived_and_a_cut_one_not_at_all() {
        let mut huge = b"GET /health HTTP/1.1\r\nX: ".to_vec();
        huge.resize(MAX_HEAD, b'a');
        let capped = exchange(huge, false).await;
        assert!(capped.starts_with("HTTP/1.1 200 OK\r\n"), "{capped:?}");
        let cut = exchange(b"GET /health HT".to_vec(), true).await;
        assert_eq!(cut, "");
    }

    #[tokio::test]
    async fn a_silent_peer_is_dropped_at_the_deadline() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let _client = TcpStream::connect(addr).await.unwrap();
        let (s, _) = listener.accept().await.unwrap();
        let answered = std::sync::atomic::AtomicBool::new(false);
        // [`WAIT`] as a tenth of a second, so the test waits for it in real time.
        let wait = Duration::from_millis(100);
        let serve = serve_within(
            s,
            Vec::new(),
            |_| {
                answered.store(true, std::sync::atomic::Ordering::Relaxed);
                ("200 OK", String::new())
            },
            wait,
        );
        tokio::time::timeout(wait + Duration::from_secs(2), serve).await.expect("the responder gives up at its deadline");
        assert!(!answered.load(std::sync::atomic::Ordering::Relaxed));
    }
}
