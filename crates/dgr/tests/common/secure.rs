//! A blocking connection to a worker over its secure channel, for the tests that speak the
//! stage protocol by hand (raw frames, hostile bytes, silences): std-style reads with a read
//! timeout and writes, over `dgr_proto::dial` on a runtime of its own.

use std::io::{Error, ErrorKind, Read, Write};
use std::net::TcpStream;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

pub struct SecureConn {
    rt: tokio::runtime::Runtime,
    s: dgr_proto::SecureStream,
    read_timeout: Option<Duration>,
}

impl SecureConn {
    pub fn connect(addr: &str) -> SecureConn {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let s = rt.block_on(dgr_proto::dial(addr, Duration::from_secs(5))).unwrap_or_else(|e| panic!("connecting to {addr}: {e}"));
        SecureConn { rt, s, read_timeout: Some(Duration::from_secs(5)) }
    }
}

/// What the hand-speaking tests need of a connection: reads that give up after a timeout.
pub trait ReadTimeout: Read {
    fn set_read_timeout(&mut self, t: Option<Duration>) -> std::io::Result<()>;
}

impl ReadTimeout for TcpStream {
    fn set_read_timeout(&mut self, t: Option<Duration>) -> std::io::Result<()> {
        TcpStream::set_read_timeout(self, t)
    }
}

impl ReadTimeout for SecureConn {
    fn set_read_timeout(&mut self, t: Option<Duration>) -> std::io::Result<()> {
        self.read_timeout = t;
        Ok(())
    }
}

impl Read for SecureConn {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let (s, t) = (&mut self.s, self.read_timeout);
        self.rt.block_on(async {
            match t {
                Some(t) => tokio::time::timeout(t, s.read(buf)).await.map_err(|_| Error::new(ErrorKind::WouldBlock, "read timed out"))?,
                None => s.read(buf).await,
            }
        })
    }
}

impl Write for SecureConn {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let s = &mut self.s;
        self.rt.block_on(async {
            s.write_all(buf).await?;
            s.flush().await?;
            Ok(buf.len())
        })
    }

    fn flush(&mut self) -> std::io::Result<()> {
        let s = &mut self.s;
        self.rt.block_on(s.flush())
    }
}
