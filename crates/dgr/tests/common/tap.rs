//! A recording TCP proxy for one hop: every byte each way is kept, and one byte at a given
//! offset of one direction of each connection may be flipped in flight; its upstream can be
//! switched for new connections (an impostor taking over an address).

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::{Arc, Mutex};

/// Which way a byte is flipped.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Dir {
    /// From the dialler to the server.
    Up,
    /// From the server back to the dialler.
    Down,
}

/// Bytes kept, shared with the pipe threads.
type Kept = Arc<Mutex<Vec<u8>>>;

pub struct Tap {
    pub addr: String,
    upstream: Arc<Mutex<String>>,
    /// Where connections go after the next one.
    then: Arc<Mutex<Option<String>>>,
    /// Everything that passed, both directions, in arrival order per direction.
    pub up: Arc<Mutex<Vec<u8>>>,
    pub down: Arc<Mutex<Vec<u8>>>,
    /// Each connection's bytes from the dialler, one entry per connection.
    pub conns_up: Arc<Mutex<Vec<Kept>>>,
}

impl Tap {
    pub fn start(upstream: &str, flip: Option<(Dir, usize)>) -> Tap {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let tap = Tap {
            addr,
            upstream: Arc::new(Mutex::new(upstream.to_string())),
            then: Arc::default(),
            up: Arc::default(),
            down: Arc::default(),
            conns_up: Arc::default(),
        };
        let (target, then) = (tap.upstream.clone(), tap.then.clone());
        let (up, down, conns) = (tap.up.clone(), tap.down.clone(), tap.conns_up.clone());
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(client) = conn else { continue };
                let to = target.lock().unwrap().clone();
                if let Some(next) = then.lock().unwrap().take() {
                    *target.lock().unwrap() = next;
                }
                let Ok(server) = TcpStream::connect(&to) else { continue };
                let mine = Arc::new(Mutex::new(Vec::new()));
                conns.lock().unwrap().push(mine.clone());
                let at = |d: Dir| flip.filter(|(fd, _)| *fd == d).map(|(_, n)| n);
                pipe(client.try_clone().unwrap(), server.try_clone().unwrap(), up.clone(), Some(mine), at(Dir::Up));
                pipe(server, client, down.clone(), None, at(Dir::Down));
            }
        });
        tap
    }

    /// New connections go to `upstream` from now on.
    pub fn switch(&self, upstream: &str) {
        *self.upstream.lock().unwrap() = upstream.to_string();
    }

    /// The next connection still goes where they go now, the ones after it to `upstream`.
    pub fn switch_after_next(&self, upstream: &str) {
        *self.then.lock().unwrap() = Some(upstream.to_string());
    }

    /// Both directions' bytes.
    pub fn captured(&self) -> Vec<u8> {
        let mut all = self.up.lock().unwrap().clone();
        all.extend_from_slice(&self.down.lock().unwrap());
        all
    }
}

fn pipe(mut from: TcpStream, mut to: TcpStream, log: Arc<Mutex<Vec<u8>>>, conn: Option<Arc<Mutex<Vec<u8>>>>, flip: Option<usize>) {
    std::thread::spawn(move || {
        let mut buf = [0u8; 16384];
        let mut seen = 0usize;
        loop {
            let n = match from.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            if let Some(at) = flip.filter(|at| (seen..seen + n).contains(at)) {
                buf[at - seen] ^= 0x01;
            }
            seen += n;
            log.lock().unwrap().extend_from_slice(&buf[..n]);
            if let Some(c) = &conn {
                c.lock().unwrap().extend_from_slice(&buf[..n]);
            }
            if to.write_all(&buf[..n]).is_err() {
                break;
            }
        }
        let _ = to.shutdown(Shutdown::Write);
    });
}
