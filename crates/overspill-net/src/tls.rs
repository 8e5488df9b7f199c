//! TLS for a server's connections (NBD upgrades to it with NBD_OPT_STARTTLS): the server's
//! credentials, the client's identity, and the upgraded stream.
//!
//! Two kinds of credentials, as qemu's `tls-creds-x509` and `tls-creds-psk` objects have them:
//! - x509 with rustls: a certificate chain and key, and optionally a CA whose certificates every
//!   client must present (the client's identity is then its certificate's common name);
//! - pre-shared keys with OpenSSL, since rustls has no external-PSK support: a `keys.psk` file of
//!   `identity:hexkey` lines (the format qemu and libnbd read), the identity being the key's name.
//!
//! The upgrade completes the TLS handshake before returning, so that a client whose certificate
//! or key is refused is gone before it can send a single option over TLS.

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::path::Path;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use openssl::ex_data::Index;
use openssl::ssl::{Ssl, SslContext, SslMethod, SslStream, SslVersion};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::{RootCertStore, ServerConnection, StreamOwned};

use crate::transport::{ReadStopper, Transport};

/// Whether clients may, must or cannot upgrade to TLS (the NBD spec's NOTLS, SELECTIVETLS with
/// no TLS-only export, and FORCEDTLS modes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TlsMode {
    #[default]
    Off,
    /// STARTTLS is offered; a client may also go on in plain text.
    On,
    /// Every option but STARTTLS and ABORT is refused until TLS is up.
    Require,
}

impl FromStr for TlsMode {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "off" => Ok(Self::Off),
            "on" => Ok(Self::On),
            "require" => Ok(Self::Require),
            other => Err(format!("{other:?}: use off, on or require")),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("{path}: {source}")]
    File { path: String, source: io::Error },
    #[error("{path}: {message}")]
    Invalid { path: String, message: String },
    #[error("TLS configuration: {0}")]
    Config(String),
}

pub(crate) fn invalid(path: &Path, message: impl std::fmt::Display) -> TlsError {
    TlsError::Invalid { path: path.display().to_string(), message: message.to_string() }
}

/// How a server upgrades a connection, and whether it insists.
pub struct ServerTls {
    mode: TlsMode,
    credentials: Credentials,
}

enum Credentials {
    X509(Arc<rustls::ServerConfig>),
    /// The index holds the identity the client named, set by the key callback: OpenSSL does
    /// not report it afterwards for a TLS 1.3 external PSK.
    Psk(SslContext, Index<Ssl, String>),
}

impl std::fmt::Debug for ServerTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match self.credentials {
            Credentials::X509(_) => "x509",
            Credentials::Psk(..) => "psk",
        };
        f.debug_struct("ServerTls").field("mode", &self.mode).field("credentials", &kind).finish()
    }
}

/// The pre-shared keys of a `keys.psk` file: `identity:hexkey` per line.
fn read_psk_file(path: &Path) -> Result<HashMap<String, Vec<u8>>, TlsError> {
    let text =
        std::fs::read_to_string(path).map_err(|source| TlsError::File { path: path.display().to_string(), source })?;
    let mut keys = HashMap::new();
    for (n, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let (identity, hex) =
            line.split_once(':').ok_or_else(|| invalid(path, format!("line {}: want identity:hexkey", n + 1)))?;
        let key = decode_hex(hex.trim()).ok_or_else(|| invalid(path, format!("line {}: the key is not hex", n + 1)))?;
        if identity.is_empty() || key.is_empty() {
            return Err(invalid(path, format!("line {}: empty identity or key", n + 1)));
        }
        keys.insert(identity.to_owned(), key);
    }
    if keys.is_empty() {
        return Err(invalid(path, "no keys"));
    }
    Ok(keys)
}

fn decode_hex(hex: &str) -> Option<Vec<u8>> {
    if !hex.len().is_multiple_of(2) {
        return None;
    }
    (0..hex.len()).step_by(2).map(|i| u8::from_str_radix(hex.get(i..i + 2)?, 16).ok()).collect()
}

fn read_pem(path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::File { path: path.display().to_string(), source })
}

/// A certificate chain (PEM), the holder's own certificate first.
pub(crate) fn read_chain(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let chain: Vec<CertificateDer<'static>> =
        CertificateDer::pem_slice_iter(&read_pem(path)?).collect::<Result<_, _>>().map_err(|e| invalid(path, e))?;
    if chain.is_empty() {
        return Err(invalid(path, "no certificate in the file"));
    }
    Ok(chain)
}

pub(crate) fn read_key(path: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    PrivateKeyDer::from_pem_slice(&read_pem(path)?).map_err(|e| invalid(path, e))
}

/// The CA certificates (PEM) a peer's certificate must chain to.
pub(crate) fn read_roots(path: &Path) -> Result<RootCertStore, TlsError> {
    let mut roots = RootCertStore::empty();
    for der in CertificateDer::pem_slice_iter(&read_pem(path)?) {
        roots.add(der.map_err(|e| invalid(path, e))?).map_err(|e| invalid(path, e))?;
    }
    if roots.is_empty() {
        return Err(invalid(path, "no CA certificate in the file"));
    }
    Ok(roots)
}

impl ServerTls {
    /// x509: the server's certificate chain and private key (PEM); with `client_ca`, every client
    /// must present a certificate that CA signed.
    pub fn x509(mode: TlsMode, cert: &Path, key: &Path, client_ca: Option<&Path>) -> Result<Self, TlsError> {
        let chain = read_chain(cert)?;
        let key_der = read_key(key)?;
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = rustls::ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(|e| TlsError::Config(e.to_string()))?;
        let builder = match client_ca {
            None => builder.with_no_client_auth(),
            Some(ca) => {
                let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(read_roots(ca)?), provider)
                    .build()
                    .map_err(|e| TlsError::Config(e.to_string()))?;
                builder.with_client_cert_verifier(verifier)
            }
        };
        let config = builder.with_single_cert(chain, key_der).map_err(|e| invalid(key, e))?;
        Ok(Self { mode, credentials: Credentials::X509(Arc::new(config)) })
    }

    /// Pre-shared keys from a `keys.psk` file; the identity a client names is its identity.
    pub fn psk(mode: TlsMode, keys_file: &Path) -> Result<Self, TlsError> {
        let keys = read_psk_file(keys_file)?;
        let config = |e: openssl::error::ErrorStack| TlsError::Config(e.to_string());
        let identity_slot = Ssl::new_ex_index::<String>().map_err(config)?;
        let mut builder = SslContext::builder(SslMethod::tls_server()).map_err(config)?;
        builder.set_min_proto_version(Some(SslVersion::TLS1_2)).map_err(config)?;
        // TLS 1.2 needs PSK suites named; TLS 1.3's defaults take an external PSK as they are.
        builder.set_cipher_list("ECDHE-PSK:DHE-PSK:PSK:!aNULL:!eNULL:!3DES:!RC4").map_err(config)?;
        builder.set_psk_server_callback(move |ssl, identity, out| {
            let identity = identity.and_then(|id| std::str::from_utf8(id).ok());
            match identity.and_then(|id| keys.get_key_value(id)) {
                Some((identity, key)) if key.len() <= out.len() => {
                    out[..key.len()].copy_from_slice(key);
                    ssl.set_ex_data(identity_slot, identity.clone());
                    Ok(key.len())
                }
                // An unknown identity: zero bytes of key fails the handshake.
                _ => Ok(0),
            }
        });
        Ok(Self { mode, credentials: Credentials::Psk(builder.build(), identity_slot) })
    }

    pub fn mode(&self) -> TlsMode {
        self.mode
    }

    /// Runs the TLS handshake on `stream` (the client has just been told to start it).
    pub fn accept<T: Transport>(&self, stream: T) -> io::Result<TlsStream<T>> {
        match &self.credentials {
            Credentials::X509(config) => {
                let connection = ServerConnection::new(config.clone()).map_err(io::Error::other)?;
                let mut tls = StreamOwned::new(connection, stream);
                while tls.conn.is_handshaking() {
                    tls.conn.complete_io(&mut tls.sock)?;
                }
                let identity = tls.conn.peer_certificates().and_then(|chain| chain.first()).and_then(common_name);
                Ok(TlsStream { inner: Inner::Rustls(Box::new(tls)), identity, closed: false })
            }
            Credentials::Psk(context, identity_slot) => {
                let ssl = Ssl::new(context).map_err(io::Error::other)?;
                let tls = ssl.accept(stream).map_err(|error| {
                    let (message, kind) = match error {
                        openssl::ssl::HandshakeError::SetupFailure(e) => {
                            (e.to_string(), io::ErrorKind::PermissionDenied)
                        }
                        openssl::ssl::HandshakeError::Failure(mid) | openssl::ssl::HandshakeError::WouldBlock(mid) => {
                            // The handshake's deadline (or a shut socket) shows through as the
                            // socket's own error.
                            let kind = mid.error().io_error().map_or(io::ErrorKind::PermissionDenied, io::Error::kind);
                            (mid.error().to_string(), kind)
                        }
                    };
                    io::Error::new(kind, format!("TLS handshake: {message}"))
                })?;
                let identity = tls.ssl().ex_data(*identity_slot).cloned();
                Ok(TlsStream { inner: Inner::OpenSsl(Box::new(tls)), identity, closed: false })
            }
        }
    }
}

pub(crate) fn common_name(der: &CertificateDer<'_>) -> Option<String> {
    let (_, cert) = x509_parser::parse_x509_certificate(der.as_ref()).ok()?;
    let name = cert.subject().iter_common_name().next()?.as_str().ok()?.to_owned();
    Some(name)
}

/// A connection after STARTTLS.
pub struct TlsStream<T: Transport> {
    inner: Inner<T>,
    identity: Option<String>,
    /// close_notify has been sent: once is enough.
    closed: bool,
}

enum Inner<T: Transport> {
    Rustls(Box<StreamOwned<ServerConnection, T>>),
    OpenSsl(Box<SslStream<T>>),
}

impl<T: Transport> TlsStream<T> {
    /// Who the client proved to be: its certificate's common name, or its PSK identity.
    pub fn identity(&self) -> Option<&str> {
        self.identity.as_deref()
    }
}

impl<T: Transport> Read for TlsStream<T> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match &mut self.inner {
            Inner::Rustls(s) => s.read(buf),
            Inner::OpenSsl(s) => s.read(buf),
        }
    }
}

impl<T: Transport> Write for TlsStream<T> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match &mut self.inner {
            Inner::Rustls(s) => s.write(buf),
            Inner::OpenSsl(s) => s.write(buf),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        match &mut self.inner {
            Inner::Rustls(s) => s.flush(),
            Inner::OpenSsl(s) => s.flush(),
        }
    }
}

impl<T: Transport> Transport for TlsStream<T> {
    fn set_read_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
        match &self.inner {
            Inner::Rustls(s) => s.sock.set_read_timeout(timeout),
            Inner::OpenSsl(s) => s.get_ref().set_read_timeout(timeout),
        }
    }

    fn set_write_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
        match &self.inner {
            Inner::Rustls(s) => s.sock.set_write_timeout(timeout),
            Inner::OpenSsl(s) => s.get_ref().set_write_timeout(timeout),
        }
    }

    fn set_write_deadline(&self, deadline: Option<std::time::Instant>) -> io::Result<()> {
        match &self.inner {
            Inner::Rustls(s) => s.sock.set_write_deadline(deadline),
            Inner::OpenSsl(s) => s.get_ref().set_write_deadline(deadline),
        }
    }

    fn read_stopper(&self) -> Option<ReadStopper> {
        // The server took the socket's stopper before the upgrade; it still works underneath.
        None
    }

    fn close(&mut self) -> io::Result<()> {
        if std::mem::replace(&mut self.closed, true) {
            return Ok(());
        }
        // Then the connection under it, as its own close ends it (TCP: without a reset).
        match &mut self.inner {
            Inner::Rustls(s) => {
                s.conn.send_close_notify();
                s.flush()?;
                s.sock.close()
            }
            Inner::OpenSsl(s) => {
                s.shutdown().map_err(io::Error::other)?;
                s.get_mut().close()
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn psk_files_parse_and_bad_ones_say_which_line() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("keys.psk");
        std::fs::write(&path, "alice:00ff10\n\nbob:abcd\n").expect("write");
        let keys = read_psk_file(&path).expect("valid file");
        assert_eq!(keys["alice"], vec![0x00, 0xff, 0x10]);
        assert_eq!(keys["bob"], vec![0xab, 0xcd]);
        std::fs::write(&path, "alice:00ff10\nbob:xyz\n").expect("write");
        let error = read_psk_file(&path).expect_err("not hex").to_string();
        assert!(error.contains("line 2"), "{error}");
        std::fs::write(&path, "no colon here\n").expect("write");
        assert!(read_psk_file(&path).is_err());
    }

    #[test]
    fn modes_parse() {
        assert_eq!("require".parse::<TlsMode>(), Ok(TlsMode::Require));
        assert!("maybe".parse::<TlsMode>().is_err());
    }
}
