//! The gateway over HTTPS (`--tls-cert`, `--tls-key`), on a synthetic model and a tracker with
//! no workers (nothing here needs a forward pass): a client trusting the test CA is served, one
//! that does not is refused by its own verification, plain HTTP to the TLS port gets no HTTP
//! answer, a client stalling its handshake neither delays another nor holds its connection past
//! the header deadline, and bad certificate files stop the gateway at start, naming the file.

mod common;

use common::dgr;
use common::swarm::{spawn_ready, Tracker};
use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair};
use rustls::pki_types::{CertificateDer, ServerName};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Child;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// The gateway's deadline on a handshake (and on a request's head), crates/gateway/src/serve.rs.
const HEADER_TIMEOUT: Duration = Duration::from_secs(10);

/// A test CA and a leaf certificate for localhost and 127.0.0.1 signed by it, as PEM files.
struct Certs {
    dir: PathBuf,
    ca: CertificateDer<'static>,
}

impl Certs {
    fn new(name: &str) -> Certs {
        let dir = std::env::temp_dir().join(format!("dgr-test-certs-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let (ca, issuer) = ca("dgr test CA");
        let (leaf, leaf_key) = leaf(&issuer);
        std::fs::write(dir.join("ca.pem"), ca.pem()).unwrap();
        std::fs::write(dir.join("cert.pem"), leaf.pem()).unwrap();
        std::fs::write(dir.join("key.pem"), leaf_key.serialize_pem()).unwrap();
        Certs { dir, ca: ca.der().clone() }
    }

    fn path(&self, file: &str) -> PathBuf {
        self.dir.join(file)
    }
}

impl Drop for Certs {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn ca(name: &str) -> (rcgen::Certificate, Issuer<'static, KeyPair>) {
    let key = KeyPair::generate().unwrap();
    let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.distinguished_name.push(DnType::CommonName, name);
    let cert = params.self_signed(&key).unwrap();
    (cert, Issuer::new(params, key))
}

fn leaf(issuer: &Issuer<'static, KeyPair>) -> (rcgen::Certificate, KeyPair) {
    let key = KeyPair::generate().unwrap();
    let mut params = CertificateParams::new(vec!["localhost".to_string(), "127.0.0.1".to_string()]).unwrap();
    params.distinguished_name.push(DnType::CommonName, "localhost");
    (params.signed_by(&key, issuer).unwrap(), key)
}

/// A synthetic model in `dir` (the gateway needs a tokenizer, not weights worth running).
fn synth_model(dir: &Path) -> PathBuf {
    let path = dir.join("synth.gguf");
    let out = dgr().args(["synth", "--out"]).arg(&path).output().unwrap();
    assert!(out.status.success(), "dgr synth: {}", String::from_utf8_lossy(&out.stderr));
    path
}

/// `dgr gateway` over HTTPS with `certs`, asking `tracker`; killed when dropped.
struct Gateway {
    child: Child,
    addr: String,
}

impl Gateway {
    fn start(tracker: &Tracker, certs: &Certs) -> Gateway {
        let mut cmd = dgr();
        cmd.args(["gateway", "--tracker", &tracker.addr, "--listen", "127.0.0.1:0", "--verify-fraction", "0", "--model"])
            .arg(synth_model(&certs.dir))
            .arg("--tls-cert")
            .arg(certs.path("cert.pem"))
            .arg("--tls-key")
            .arg(certs.path("key.pem"));
        let (child, v, _log) = spawn_ready(cmd, "gateway");
        let addr = v["listening"].as_str().unwrap().to_string();
        assert_eq!(v["url"].as_str(), Some(format!("https://{addr}").as_str()), "the ready line's url: {v}");
        Gateway { child, addr }
    }
}

impl Drop for Gateway {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn client_config(roots: &[&CertificateDer<'static>]) -> Arc<rustls::ClientConfig> {
    let mut store = rustls::RootCertStore::empty();
    for r in roots {
        store.add((*r).clone()).unwrap();
    }
    // The server's provider (see `dgr_gateway::tls`).
    #[allow(deprecated)]
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut c = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(store)
        .with_no_client_auth();
    c.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Arc::new(c)
}

/// GET `path` over TLS trusting `roots`, naming the server `host`: the ALPN protocol chosen and
/// the whole response, or the connection's error.
async fn https_get(addr: &str, host: &str, roots: &[&CertificateDer<'static>], path: &str) -> std::io::Result<(Vec<u8>, String)> {
    let tcp = tokio::net::TcpStream::connect(addr).await?;
    let name = ServerName::try_from(host.to_string()).unwrap();
    let connector = tokio_rustls::TlsConnector::from(client_config(roots));
    let mut tls = tokio::time::timeout(Duration::from_secs(5), connector.connect(name, tcp)).await??;
    let alpn = tls.get_ref().1.alpn_protocol().unwrap_or_default().to_vec();
    tls.write_all(format!("GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n").as_bytes()).await?;
    let mut resp = Vec::new();
    // The server may close without TLS's close_notify after `Connection: close`; what came is the answer.
    let _ = tokio::time::timeout(Duration::from_secs(10), tls.read_to_end(&mut resp)).await?;
    Ok((alpn, String::from_utf8_lossy(&resp).into_owned()))
}

fn status_of(resp: &str) -> &str {
    resp.split(' ').nth(1).unwrap_or_default()
}

/// The gateway's own count of `kind` in `dgr_gateway_errors_total` (fetched over HTTPS).
async fn errors_counted(addr: &str, ca: &CertificateDer<'static>, kind: &str) -> f64 {
    let (_, resp) = https_get(addr, "localhost", &[ca], "/metrics").await.unwrap();
    let needle = format!("dgr_gateway_errors_total{{kind=\"{kind}\"}} ");
    resp.lines().find_map(|l| l.strip_prefix(&needle)).map_or(0.0, |v| v.trim().parse().unwrap())
}

#[test]
fn https_serves_a_client_trusting_the_ca_and_nothing_else() {
    let certs = Certs::new("serve");
    let tracker = Tracker::start("tls-serve", &[]);
    let gw = Gateway::start(&tracker, &certs);
    let rt = common::runtime();
    rt.block_on(async {
        // By name and by address: the certificate names both.
        for host in ["localhost", "127.0.0.1"] {
            let (alpn, resp) = https_get(&gw.addr, host, &[&certs.ca], "/v1/models").await.unwrap();
            assert_eq!(status_of(&resp), "200", "GET /v1/models over HTTPS as {host}: {resp}");
            assert!(resp.contains("\"object\":\"list\""), "not the models list: {resp}");
            assert_eq!(alpn, b"http/1.1", "ALPN: the loop serves HTTP/1.1 only");
        }

        // A client that does not trust the test CA refuses the certificate itself.
        let (other_ca, _) = ca("another CA");
        let err = https_get(&gw.addr, "localhost", &[other_ca.der()], "/v1/models").await.unwrap_err();
        let inner = err.get_ref().and_then(|e| e.downcast_ref::<rustls::Error>());
        assert!(
            matches!(inner, Some(rustls::Error::InvalidCertificate(rustls::CertificateError::UnknownIssuer))),
            "an untrusting client should fail verification with UnknownIssuer: {err:?}"
        );
    });

    // Plain HTTP to the TLS port gets no HTTP answer, and the connection is closed.
    let mut s = std::net::TcpStream::connect(&gw.addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s.write_all(b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n").unwrap();
    let mut got = Vec::new();
    s.read_to_end(&mut got).expect("the gateway closes a plain-HTTP connection promptly");
    assert!(!got.windows(5).any(|w| w == b"HTTP/"), "plain HTTP got an HTTP answer: {:?}", String::from_utf8_lossy(&got));

    rt.block_on(async {
        // The refused certificate and the plaintext request: two failed handshakes, counted.
        assert_eq!(errors_counted(&gw.addr, &certs.ca, "tls_handshake").await, 2.0, "failed handshakes in /metrics");
    });
}

#[test]
fn a_stalled_handshake_delays_no_one_and_is_cut_at_the_deadline() {
    let certs = Certs::new("stall");
    let tracker = Tracker::start("tls-stall", &[]);
    let gw = Gateway::start(&tracker, &certs);
    // A TLS record header announcing a ClientHello, then nothing more.
    let mut stalled = std::net::TcpStream::connect(&gw.addr).unwrap();
    stalled.write_all(&[0x16, 0x03, 0x01, 0x02, 0x00]).unwrap();
    let stalled_at = Instant::now();
    std::thread::sleep(Duration::from_millis(200));

    let rt = common::runtime();
    rt.block_on(async {
        let t0 = Instant::now();
        let (_, resp) = https_get(&gw.addr, "localhost", &[&certs.ca], "/v1/models").await.unwrap();
        assert_eq!(status_of(&resp), "200", "another client while one stalls its handshake: {resp}");
        assert!(t0.elapsed() < Duration::from_secs(3), "served in {:?} while a handshake stalled", t0.elapsed());
    });

    stalled.set_read_timeout(Some(HEADER_TIMEOUT * 2)).unwrap();
    let mut buf = [0u8; 64];
    let n = stalled.read(&mut buf).unwrap_or(0);
    let held = stalled_at.elapsed();
    assert_eq!(n, 0, "the stalled connection got bytes instead of being closed");
    assert!(
        held >= HEADER_TIMEOUT - Duration::from_millis(500) && held < HEADER_TIMEOUT + Duration::from_secs(5),
        "a stalled handshake was held {held:?}; the deadline is {HEADER_TIMEOUT:?}"
    );
    rt.block_on(async {
        assert_eq!(errors_counted(&gw.addr, &certs.ca, "tls_handshake_timeout").await, 1.0, "timed-out handshakes in /metrics");
    });
}

/// `dgr gateway` with these TLS flags: it must exit non-zero at start; its stderr.
fn refused(args: &[&std::ffi::OsStr]) -> String {
    let out = dgr()
        .args(["gateway", "--tracker", "127.0.0.1:1", "--listen", "127.0.0.1:0"])
        .args(args)
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "dgr gateway {args:?} started: {}{err}", String::from_utf8_lossy(&out.stdout));
    assert!(!err.contains("panicked"), "{err}");
    err
}

#[test]
fn bad_certificate_files_are_refused_at_start_naming_the_file() {
    let certs = Certs::new("bad");
    let (cert, key) = (certs.path("cert.pem"), certs.path("key.pem"));
    let other_key = certs.path("other-key.pem");
    std::fs::write(&other_key, KeyPair::generate().unwrap().serialize_pem()).unwrap();
    let garbage = certs.path("garbage.pem");
    std::fs::write(&garbage, "this is not a certificate\n").unwrap();
    let bad_base64 = certs.path("bad-base64.pem");
    std::fs::write(&bad_base64, "-----BEGIN CERTIFICATE-----\n!!!!\n-----END CERTIFICATE-----\n").unwrap();
    let missing = certs.path("missing.pem");
    let flags = |c: &Path, k: &Path| -> Vec<std::ffi::OsString> { vec!["--tls-cert".into(), c.into(), "--tls-key".into(), k.into()] };
    let cases: [(&str, Vec<std::ffi::OsString>, &Path, &str); 6] = [
        ("a key of another certificate", flags(&cert, &other_key), &other_key, "does not match"),
        ("garbage for a certificate", flags(&garbage, &key), &garbage, "no certificate"),
        ("bad base64 in a certificate", flags(&bad_base64, &key), &bad_base64, "not PEM"),
        ("a certificate for a key", flags(&cert, &cert), &cert, "no private key"),
        ("a missing certificate", flags(&missing, &key), &missing, "No such file"),
        ("a missing key", flags(&cert, &missing), &missing, "No such file"),
    ];
    for (what, args, file, says) in &cases {
        let args: Vec<&std::ffi::OsStr> = args.iter().map(|a| a.as_os_str()).collect();
        let err = refused(&args);
        assert!(err.contains(&file.display().to_string()), "{what}: the error does not name {}: {err}", file.display());
        assert!(err.contains(says), "{what}: the error does not say {says:?}: {err}");
    }
    // One without the other is a usage error.
    let err = refused(&["--tls-cert".as_ref(), cert.as_os_str()]);
    assert!(err.contains("--tls-key"), "--tls-cert alone: {err}");
    let err = refused(&["--tls-key".as_ref(), key.as_os_str()]);
    assert!(err.contains("--tls-cert"), "--tls-key alone: {err}");
}
