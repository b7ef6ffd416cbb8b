//! A delaying TCP proxy, as `netem delay` would delay a link where the kernel has none: every
//! chunk read from either side is written to the other `delay` after it arrived, in order, with
//! no cap on bandwidth. `dgr bench wan` puts one in front of every hop.

use crate::error::{Context, Result};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::time::Instant;

/// Chunks in flight per direction: a full pipe stops its reader (at most 64 MiB held).
const IN_FLIGHT: usize = 1024;

/// Proxies on loopback, one per target, on a runtime of their own: dropping them stops them.
pub struct DelayProxies {
    _rt: tokio::runtime::Runtime,
    /// The address of each target's proxy, in the targets' order.
    pub addrs: Vec<String>,
}

impl DelayProxies {
    pub fn start(targets: &[String], delay: Duration) -> Result<DelayProxies> {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().context("starting a runtime")?;
        let mut addrs = Vec::new();
        for target in targets {
            let listener = rt.block_on(TcpListener::bind("127.0.0.1:0")).context("binding a proxy")?;
            addrs.push(listener.local_addr().context("a proxy's address")?.to_string());
            rt.spawn(serve(listener, target.clone(), delay));
        }
        Ok(DelayProxies { _rt: rt, addrs })
    }
}

async fn serve(listener: TcpListener, target: String, delay: Duration) {
    while let Ok((inbound, _)) = listener.accept().await {
        let target = target.clone();
        tokio::spawn(async move {
            let Ok(outbound) = TcpStream::connect(&target).await else { return };
            let _ = (inbound.set_nodelay(true), outbound.set_nodelay(true));
            let ((ri, wi), (ro, wo)) = (inbound.into_split(), outbound.into_split());
            tokio::join!(pipe(ri, wo, delay), pipe(ro, wi, delay));
        });
    }
}

/// Copies `from` to `to`, each chunk `delay` after it was read; ends (shutting `to` down) when
/// `from` ends and everything read has been written, or when either side fails.
async fn pipe(mut from: OwnedReadHalf, mut to: OwnedWriteHalf, delay: Duration) {
    let (tx, mut rx) = mpsc::channel::<(Instant, Vec<u8>)>(IN_FLIGHT);
    let read = async move {
        let mut buf = vec![0u8; 64 << 10];
        while let Ok(n @ 1..) = from.read(&mut buf).await {
            if tx.send((Instant::now() + delay, buf[..n].to_vec())).await.is_err() {
                break;
            }
        }
    };
    let write = async move {
        while let Some((at, chunk)) = rx.recv().await {
            tokio::time::sleep_until(at).await;
            if to.write_all(&chunk).await.is_err() {
                return;
            }
        }
        let _ = to.shutdown().await;
    };
    tokio::join!(read, write);
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};

    /// An echo server behind proxies of 0 and 30 ms: bytes come back intact and in order, a
    /// round trip taking at least two delays (and not far more).
    #[test]
    fn delays_each_direction_and_keeps_the_bytes() {
        let echo = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let target = echo.local_addr().unwrap().to_string();
        std::thread::spawn(move || {
            for s in echo.incoming() {
                let mut s = s.unwrap();
                std::thread::spawn(move || {
                    let mut buf = [0u8; 4096];
                    while let Ok(n @ 1..) = s.read(&mut buf) {
                        s.write_all(&buf[..n]).unwrap();
                    }
                });
            }
        });
        for ms in [0u64, 30] {
            let p = DelayProxies::start(std::slice::from_ref(&target), Duration::from_millis(ms)).unwrap();
            let mut c = std::net::TcpStream::connect(&p.addrs[0]).unwrap();
            c.set_nodelay(true).unwrap();
            let msg: Vec<u8> = (0..100_000u32).map(|i| (i * 31 % 251) as u8).collect();
            let t = std::time::Instant::now();
            c.write_all(&msg).unwrap();
            let mut back = vec![0u8; msg.len()];
            c.read_exact(&mut back).unwrap();
            let rtt = t.elapsed();
            assert_eq!(back, msg, "{ms} ms: the bytes changed");
            assert!(rtt >= Duration::from_millis(2 * ms), "{ms} ms each way, round trip {rtt:?}");
            assert!(rtt < Duration::from_millis(2 * ms + 500), "{ms} ms each way, round trip {rtt:?}");
        }
    }
}
