//! A TCP proxy in front of a database that can drop every connection and refuse new ones
//! (`cut`), then let them through again (`restore`): a database that goes away and comes back.

use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
use std::sync::{Arc, Mutex};

#[derive(Default)]
struct State {
    down: AtomicBool,
    stopped: AtomicBool,
    /// Both ends of every connection passed through, to be shut down by `cut`.
    conns: Mutex<Vec<TcpStream>>,
}

pub struct Proxy {
    /// `url` with the proxy's address in place of the server's.
    pub url: String,
    addr: String,
    state: Arc<State>,
}

impl Proxy {
    /// A proxy for the server of `url` (`scheme://user@host:port/...`).
    pub fn start(url: &str) -> Proxy {
        let (scheme_user, rest) = url.split_once('@').expect("a URL with user@host:port");
        let end = rest.find(['/', '?']).unwrap_or(rest.len());
        let upstream = rest[..end].to_string();
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let state = Arc::new(State::default());
        let st = state.clone();
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                if st.stopped.load(SeqCst) {
                    return;
                }
                let Ok(client) = conn else { continue };
                if st.down.load(SeqCst) {
                    continue; // dropped: the connection is closed at once
                }
                let Ok(server) = TcpStream::connect(&upstream) else { continue };
                let mut conns = st.conns.lock().unwrap();
                conns.extend([client.try_clone().unwrap(), server.try_clone().unwrap()]);
                pipe(client.try_clone().unwrap(), server.try_clone().unwrap());
                pipe(server, client);
            }
        });
        Proxy { url: format!("{scheme_user}@{addr}{}", &rest[end..]), addr, state }
    }

    pub fn cut(&self) {
        self.state.down.store(true, SeqCst);
        for c in self.state.conns.lock().unwrap().drain(..) {
            let _ = c.shutdown(Shutdown::Both);
        }
    }

    pub fn restore(&self) {
        self.state.down.store(false, SeqCst);
    }
}

fn pipe(mut from: TcpStream, mut to: TcpStream) {
    std::thread::spawn(move || {
        let _ = std::io::copy(&mut from, &mut to);
        let _ = to.shutdown(Shutdown::Write);
    });
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.cut();
        self.state.stopped.store(true, SeqCst);
        // Wakes the accept loop so it sees `stopped`.
        let _ = TcpStream::connect(&self.addr);
    }
}
