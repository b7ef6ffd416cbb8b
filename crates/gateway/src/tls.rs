//! HTTPS for the API: a certificate chain and its private key (PEM files) loaded once at start
//! into a rustls server configuration (the `ring` provider, ALPN `http/1.1`: the connection loop
//! serves HTTP/1.1 only). Every way the files can be wrong is refused here, naming the file,
//! so a bad certificate stops the gateway at start rather than failing each handshake.

use rustls::pki_types::pem::{self, PemObject};
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::sign::{CertifiedKey, SingleCertAndKey};
use std::path::{Path, PathBuf};
use std::sync::Arc;

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("reading {path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("{path}: not PEM ({reason})")]
    Pem { path: PathBuf, reason: String },
    #[error("{path}: no certificate in it (expected PEM \"BEGIN CERTIFICATE\" blocks, the server's first)")]
    NoCertificate { path: PathBuf },
    #[error(
        "{path}: no private key in it (expected a PEM \"BEGIN PRIVATE KEY\", \"BEGIN RSA PRIVATE KEY\" or \"BEGIN EC PRIVATE KEY\" block)"
    )]
    NoPrivateKey { path: PathBuf },
    #[error("{path}: unusable private key: {source}")]
    Key { path: PathBuf, source: rustls::Error },
    #[error("{path}: unusable certificate: {source}")]
    Certificate { path: PathBuf, source: rustls::Error },
    #[error("the private key in {key} does not match the certificate in {cert}")]
    KeyMismatch { cert: PathBuf, key: PathBuf },
    #[error("TLS configuration: {0}")]
    Config(rustls::Error),
}

/// The server side of TLS, ready to accept connections.
#[derive(Clone)]
pub struct Tls {
    pub(crate) acceptor: tokio_rustls::TlsAcceptor,
}

impl Tls {
    /// Loads `cert` (the server's certificate, then any intermediates) and `key` (its private
    /// key, PKCS#8, PKCS#1 or SEC1), checking that the key is the certificate's.
    pub fn load(cert: &Path, key: &Path) -> Result<Tls, TlsError> {
        let chain = read_chain(cert)?;
        let key_der = read_key(key)?;
        // Named, not the process default: nothing else in the process picks the API's crypto.
        // rustls 0.23.48 deprecates ring's provider for lacking post-quantum key exchange; the
        // one that has it (aws-lc-rs) needs cmake to build, which a fresh machine may not have.
        #[allow(deprecated)]
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let signing = provider.key_provider.load_private_key(key_der).map_err(|source| TlsError::Key { path: key.into(), source })?;
        let pair = CertifiedKey::new(chain, signing);
        check_pair(&pair, cert, key)?;
        let mut config = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(TlsError::Config)?
            .with_no_client_auth()
            .with_cert_resolver(Arc::new(SingleCertAndKey::from(pair)));
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(Tls { acceptor: tokio_rustls::TlsAcceptor::from(Arc::new(config)) })
    }
}

/// Whether the key signs for the certificate's public key (where the provider can tell).
fn check_pair(pair: &CertifiedKey, cert: &Path, key: &Path) -> Result<(), TlsError> {
    use rustls::InconsistentKeys;
    match pair.keys_match() {
        // A key whose public half the provider cannot compute cannot be checked here.
        Ok(()) | Err(rustls::Error::InconsistentKeys(InconsistentKeys::Unknown)) => Ok(()),
        Err(rustls::Error::InconsistentKeys(InconsistentKeys::KeyMismatch)) => {
            Err(TlsError::KeyMismatch { cert: cert.into(), key: key.into() })
        }
        Err(source) => Err(TlsError::Certificate { path: cert.into(), source }),
    }
}

fn read(path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Read { path: path.into(), source })
}

fn pem_error(path: &Path, e: pem::Error) -> TlsError {
    TlsError::Pem { path: path.into(), reason: e.to_string() }
}

fn read_chain(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let bytes = read(path)?;
    let chain = CertificateDer::pem_slice_iter(&bytes).collect::<Result<Vec<_>, _>>().map_err(|e| pem_error(path, e))?;
    if chain.is_empty() {
        return Err(TlsError::NoCertificate { path: path.into() });
    }
    Ok(chain)
}

fn read_key(path: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    let bytes = read(path)?;
    PrivateKeyDer::from_pem_slice(&bytes).map_err(|e| match e {
        pem::Error::NoItemsFound => TlsError::NoPrivateKey { path: path.into() },
        e => pem_error(path, e),
    })
}
