//! TLS settings for the broker connection: trust anchors, a client certificate, ALPN, the name to verify,
//! and the rustls provider, parsed and checked when built. No process-wide state is read or changed.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::WebPkiServerVerifier;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::sign::CertifiedKey;
use rustls::{ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme};

/// TLS settings of an [`MqttConfig`](crate::MqttConfig), checked when built: every file is read, every
/// certificate and key parsed, and a client key must match its certificate, so a mistake is an error of
/// [`TlsConfigBuilder::build`] naming the file, not a failed connection later.
///
/// The rustls provider is the config's own ([`TlsConfigBuilder::provider`], by default rustls's *ring*
/// provider): the crate never reads nor installs a process-wide default
/// (`CryptoProvider::install_default`), so it works whatever the application installed, or did not.
///
/// ```no_run
/// use edge_inbox::{MqttConfig, TlsConfig};
/// let tls = TlsConfig::builder()
///     .ca_file("/etc/gateway/hub-ca.pem")
///     .client_cert_file("/etc/gateway/device.crt")
///     .client_key_file("/etc/gateway/device.key")
///     .alpn("x-amzn-mqtt-ca")
///     .build()?;
/// let mqtt = MqttConfig::new("example-ats.iot.eu-west-1.amazonaws.com", 443, "gw7").tls(tls);
/// # Ok::<(), edge_inbox::TlsConfigError>(())
/// ```
#[derive(Clone)]
#[non_exhaustive]
pub struct TlsConfig {
    client: Arc<ClientConfig>,
    shown: String,
}

impl fmt::Debug for TlsConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Paths and names only: key material never reaches a log.
        write!(f, "TlsConfig({})", self.shown)
    }
}

impl TlsConfig {
    /// A builder with nothing set (no trust anchor yet: add CA files or the system's roots).
    pub fn builder() -> TlsConfigBuilder {
        TlsConfigBuilder::default()
    }

    /// A ready rustls configuration, used as it is: for keys held in a TPM or a PKCS#11 token (a custom
    /// `ResolvesClientCert`), a verifier of your own, or a provider built elsewhere. Its provider, roots,
    /// ALPN and client certificate are yours; the broker host is the name verified and sent in SNI.
    pub fn from_rustls(config: Arc<ClientConfig>) -> TlsConfig {
        TlsConfig {
            client: config,
            shown: "rustls ClientConfig given".into(),
        }
    }

    /// The rustls configuration the connection uses (for a connection of your own to the same broker).
    pub fn client_config(&self) -> Arc<ClientConfig> {
        self.client.clone()
    }
}

/// PEM text and where it came from, for error messages.
#[derive(Clone)]
struct Pem {
    origin: String,
    source: PemSource,
}

#[derive(Clone)]
enum PemSource {
    File(PathBuf),
    Bytes(Vec<u8>),
}

impl Pem {
    fn file(what: &str, path: &Path) -> Pem {
        Pem {
            origin: format!("{what} file {}", path.display()),
            source: PemSource::File(path.to_owned()),
        }
    }

    fn bytes(what: &str, bytes: Vec<u8>) -> Pem {
        Pem {
            origin: format!("{what} given in memory"),
            source: PemSource::Bytes(bytes),
        }
    }

    fn read(&self) -> Result<Vec<u8>, TlsConfigError> {
        match &self.source {
            PemSource::Bytes(b) => Ok(b.clone()),
            PemSource::File(p) => std::fs::read(p).map_err(|source| TlsConfigError::Read {
                path: p.clone(),
                source,
            }),
        }
    }
}

/// Builds a [`TlsConfig`]. Certificates and keys are PEM; a private key may be PKCS#8 (`BEGIN PRIVATE
/// KEY`), SEC1 (`BEGIN EC PRIVATE KEY`) or PKCS#1 (`BEGIN RSA PRIVATE KEY`), unencrypted; with the default
/// *ring* provider RSA, ECDSA P-256 and P-384 and Ed25519 (PKCS#8) keys are supported.
#[derive(Clone, Default)]
pub struct TlsConfigBuilder {
    ca: Vec<Pem>,
    system_roots: bool,
    client_cert: Option<Pem>,
    client_key: Option<Pem>,
    alpn: Vec<Vec<u8>>,
    server_name: Option<String>,
    provider: Option<Arc<CryptoProvider>>,
}

impl fmt::Debug for TlsConfigBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "TlsConfigBuilder({})", self.shown())
    }
}

impl TlsConfigBuilder {
    /// Trusts the CA certificates in `path` (PEM, one or more); may be given more than once.
    pub fn ca_file(mut self, path: impl AsRef<Path>) -> Self {
        self.ca.push(Pem::file("CA", path.as_ref()));
        self
    }

    /// Trusts the CA certificates in `pem`; may be given more than once.
    pub fn ca_pem(mut self, pem: impl Into<Vec<u8>>) -> Self {
        self.ca.push(Pem::bytes("CA PEM", pem.into()));
        self
    }

    /// Also trusts the operating system's root certificates (a cloud hub whose certificate chains to a
    /// public root), read when the config is built by
    /// [rustls-native-certs](https://docs.rs/rustls-native-certs): on Linux the distribution's bundle, or
    /// the files `SSL_CERT_FILE` / `SSL_CERT_DIR` name. Feature `system-roots` (on by default).
    #[cfg(feature = "system-roots")]
    pub fn system_roots(mut self) -> Self {
        self.system_roots = true;
        self
    }

    /// The client certificate chain (PEM, the device's certificate first) in `path`, for a broker that
    /// requires client authentication. Needs [`TlsConfigBuilder::client_key_file`] (or `_pem`).
    pub fn client_cert_file(mut self, path: impl AsRef<Path>) -> Self {
        self.client_cert = Some(Pem::file("client certificate", path.as_ref()));
        self
    }

    /// The client certificate chain as PEM.
    pub fn client_cert_pem(mut self, pem: impl Into<Vec<u8>>) -> Self {
        self.client_cert = Some(Pem::bytes("client certificate PEM", pem.into()));
        self
    }

    /// The private key of the client certificate (PEM: PKCS#8, SEC1 or PKCS#1) in `path`.
    pub fn client_key_file(mut self, path: impl AsRef<Path>) -> Self {
        self.client_key = Some(Pem::file("client key", path.as_ref()));
        self
    }

    /// The private key of the client certificate as PEM.
    pub fn client_key_pem(mut self, pem: impl Into<Vec<u8>>) -> Self {
        self.client_key = Some(Pem::bytes("client key PEM", pem.into()));
        self
    }

    /// Offers the ALPN protocol `protocol` (e.g. `x-amzn-mqtt-ca` for AWS IoT Core on port 443), in the
    /// order given; may be given more than once.
    pub fn alpn(mut self, protocol: impl Into<Vec<u8>>) -> Self {
        self.alpn.push(protocol.into());
        self
    }

    /// The name the broker's certificate must carry instead of the host connected to (a DNS name or an
    /// IP address): for a broker reached by an address its certificate does not name. SNI still carries
    /// the host (when it is a DNS name).
    pub fn server_name(mut self, name: impl Into<String>) -> Self {
        self.server_name = Some(name.into());
        self
    }

    /// The rustls provider for this connection. Default: rustls's *ring* provider (what the crate is built
    /// with; no cmake or C toolchain beyond `cc` for cross builds).
    pub fn provider(mut self, provider: Arc<CryptoProvider>) -> Self {
        self.provider = Some(provider);
        self
    }

    fn shown(&self) -> String {
        let mut parts: Vec<String> = self.ca.iter().map(|p| p.origin.clone()).collect();
        if self.system_roots {
            parts.push("system roots".into());
        }
        if let Some(c) = &self.client_cert {
            parts.push(c.origin.clone());
        }
        if let Some(k) = &self.client_key {
            parts.push(k.origin.clone());
        }
        if !self.alpn.is_empty() {
            let alpn: Vec<_> = self
                .alpn
                .iter()
                .map(|a| String::from_utf8_lossy(a).into_owned())
                .collect();
            parts.push(format!("ALPN {}", alpn.join(",")));
        }
        if let Some(n) = &self.server_name {
            parts.push(format!("server name {n}"));
        }
        parts.push(match self.provider {
            Some(_) => "provider given".into(),
            None => "provider ring".into(),
        });
        parts.join(", ")
    }

    /// Reads and checks everything, and builds the rustls configuration.
    pub fn build(self) -> Result<TlsConfig, TlsConfigError> {
        let provider = self
            .provider
            .clone()
            .unwrap_or_else(|| Arc::new(rustls::crypto::ring::default_provider()));
        let mut roots = RootCertStore::empty();
        for pem in &self.ca {
            let bytes = pem.read()?;
            let certs = certificates(pem, &bytes)?;
            for cert in certs {
                roots.add(cert).map_err(|e| TlsConfigError::Certificate {
                    origin: pem.origin.clone(),
                    why: format!("not a usable CA certificate: {e}"),
                })?;
            }
        }
        if self.system_roots {
            add_system_roots(&mut roots)?;
        }
        if roots.is_empty() {
            return Err(TlsConfigError::NoTrustAnchor);
        }
        let builder = ClientConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(TlsConfigError::Provider)?;
        let builder = match &self.server_name {
            None => builder.with_root_certificates(roots),
            Some(name) => {
                let name =
                    ServerName::try_from(name.clone()).map_err(|e| TlsConfigError::ServerName {
                        name: name.clone(),
                        why: e.to_string(),
                    })?;
                let inner =
                    WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider.clone())
                        .build()
                        .map_err(|e| {
                            TlsConfigError::Provider(rustls::Error::General(e.to_string()))
                        })?;
                builder
                    .dangerous()
                    .with_custom_certificate_verifier(Arc::new(NamedVerifier { inner, name }))
            }
        };
        let mut client = match (&self.client_cert, &self.client_key) {
            (None, None) => builder.with_no_client_auth(),
            (Some(_), None) => return Err(TlsConfigError::Incomplete("a client key")),
            (None, Some(_)) => return Err(TlsConfigError::Incomplete("a client certificate")),
            (Some(cert_pem), Some(key_pem)) => {
                let chain = certificates(cert_pem, &cert_pem.read()?)?;
                let key = private_key(key_pem, &key_pem.read()?)?;
                check_pair(&provider, cert_pem, key_pem, &chain, &key)?;
                builder
                    .with_client_auth_cert(chain, key)
                    .map_err(|e| TlsConfigError::Key {
                        origin: key_pem.origin.clone(),
                        why: e.to_string(),
                    })?
            }
        };
        client.alpn_protocols = self.alpn.clone();
        Ok(TlsConfig {
            client: Arc::new(client),
            shown: self.shown(),
        })
    }
}

/// Every certificate in `bytes`; none is an error (saying so when the file holds a key instead).
fn certificates(pem: &Pem, bytes: &[u8]) -> Result<Vec<CertificateDer<'static>>, TlsConfigError> {
    let certs = CertificateDer::pem_slice_iter(bytes)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| TlsConfigError::Certificate {
            origin: pem.origin.clone(),
            why: format!("PEM does not parse: {e}"),
        })?;
    if certs.is_empty() {
        let why = if PrivateKeyDer::from_pem_slice(bytes).is_ok() {
            "holds a private key, no certificate (certificate and key swapped?)"
        } else {
            "holds no PEM certificate (BEGIN CERTIFICATE)"
        };
        return Err(TlsConfigError::Certificate {
            origin: pem.origin.clone(),
            why: why.into(),
        });
    }
    Ok(certs)
}

/// The first private key in `bytes` (PKCS#8, SEC1 or PKCS#1).
fn private_key(pem: &Pem, bytes: &[u8]) -> Result<PrivateKeyDer<'static>, TlsConfigError> {
    let bad = |why: String| TlsConfigError::Key {
        origin: pem.origin.clone(),
        why,
    };
    match PrivateKeyDer::from_pem_slice(bytes) {
        Ok(key) => Ok(key),
        Err(rustls::pki_types::pem::Error::NoItemsFound) => {
            let text = String::from_utf8_lossy(bytes);
            Err(bad(if text.contains("ENCRYPTED PRIVATE KEY") {
                "is an encrypted key: give it unencrypted (PKCS#8, SEC1 or PKCS#1)".into()
            } else if text.contains("BEGIN CERTIFICATE") {
                "holds a certificate, no private key (certificate and key swapped?)".into()
            } else {
                "holds no PEM private key (PKCS#8, SEC1 or PKCS#1)".into()
            }))
        }
        Err(e) => Err(bad(format!("PEM does not parse: {e}"))),
    }
}

/// The provider can sign with the key, and the key is the certificate's.
fn check_pair(
    provider: &CryptoProvider,
    cert_pem: &Pem,
    key_pem: &Pem,
    chain: &[CertificateDer<'static>],
    key: &PrivateKeyDer<'static>,
) -> Result<(), TlsConfigError> {
    let signer = provider
        .key_provider
        .load_private_key(key.clone_key())
        .map_err(|e| TlsConfigError::Key {
            origin: key_pem.origin.clone(),
            why: format!("unsupported key: {e}"),
        })?;
    match CertifiedKey::new(chain.to_vec(), signer).keys_match() {
        Ok(()) => Ok(()),
        Err(rustls::Error::InconsistentKeys(rustls::InconsistentKeys::KeyMismatch)) => {
            Err(TlsConfigError::KeyMismatch {
                cert: cert_pem.origin.clone(),
                key: key_pem.origin.clone(),
            })
        }
        // A signer that cannot give its public key (rustls: Unknown): rustls leaves it unchecked too.
        Err(rustls::Error::InconsistentKeys(_)) => Ok(()),
        Err(e) => Err(TlsConfigError::Certificate {
            origin: cert_pem.origin.clone(),
            why: format!("does not parse: {e}"),
        }),
    }
}

#[cfg(feature = "system-roots")]
fn add_system_roots(roots: &mut RootCertStore) -> Result<(), TlsConfigError> {
    let found = rustls_native_certs::load_native_certs();
    for e in &found.errors {
        log::warn!("reading the system's root certificates: {e}");
    }
    let (added, ignored) = roots.add_parsable_certificates(found.certs);
    if ignored > 0 {
        log::debug!("{ignored} system root certificate(s) could not be used");
    }
    if added == 0 {
        let errors: Vec<String> = found.errors.iter().map(|e| e.to_string()).collect();
        return Err(TlsConfigError::SystemRoots(if errors.is_empty() {
            "none found".into()
        } else {
            errors.join("; ")
        }));
    }
    Ok(())
}

#[cfg(not(feature = "system-roots"))]
fn add_system_roots(_roots: &mut RootCertStore) -> Result<(), TlsConfigError> {
    unreachable!("system_roots() needs the system-roots feature")
}

/// Verifies the broker's certificate for `name` instead of the host connected to.
#[derive(Debug)]
struct NamedVerifier {
    inner: Arc<WebPkiServerVerifier>,
    name: ServerName<'static>,
}

impl ServerCertVerifier for NamedVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        self.inner
            .verify_server_cert(end_entity, intermediates, &self.name, ocsp_response, now)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.inner.supported_verify_schemes()
    }
}

/// Why a [`TlsConfig`] cannot be built. Each names the file (or the in-memory PEM) at fault.
#[derive(Debug)]
#[non_exhaustive]
pub enum TlsConfigError {
    /// A file cannot be read.
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// A certificate (CA or client) is missing, does not parse or cannot be used.
    Certificate {
        /// Which file (or in-memory PEM).
        origin: String,
        /// What is wrong.
        why: String,
    },
    /// The client key is missing, does not parse or is not supported by the provider.
    Key {
        /// Which file (or in-memory PEM).
        origin: String,
        /// What is wrong.
        why: String,
    },
    /// The client key is not the key of the client certificate.
    KeyMismatch {
        /// The certificate's file.
        cert: String,
        /// The key's file.
        key: String,
    },
    /// A client certificate without a key, or a key without a certificate: names what is missing.
    Incomplete(&'static str),
    /// Neither a CA nor the system's roots: nothing to verify the broker against.
    NoTrustAnchor,
    /// The system's root certificates could not be read.
    SystemRoots(String),
    /// The server name override is neither a DNS name nor an IP address.
    ServerName {
        /// The name given.
        name: String,
        /// Why it is refused.
        why: String,
    },
    /// The provider cannot make a configuration (no TLS 1.2 or 1.3 cipher suite, say).
    Provider(rustls::Error),
}

impl fmt::Display for TlsConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TlsConfigError::Read { path, source } => {
                write!(f, "cannot read {}: {source}", path.display())
            }
            TlsConfigError::Certificate { origin, why } | TlsConfigError::Key { origin, why } => {
                write!(f, "{origin}: {why}")
            }
            TlsConfigError::KeyMismatch { cert, key } => {
                write!(f, "the {key} does not match the certificate in the {cert}")
            }
            TlsConfigError::Incomplete(missing) => {
                write!(f, "client authentication needs {missing} too")
            }
            TlsConfigError::NoTrustAnchor => f.write_str(
                "no CA certificate and no system roots: nothing to verify the broker with",
            ),
            TlsConfigError::SystemRoots(why) => {
                write!(f, "no usable system root certificate: {why}")
            }
            TlsConfigError::ServerName { name, why } => {
                write!(f, "server name {name:?}: {why}")
            }
            TlsConfigError::Provider(e) => write!(f, "the TLS provider cannot be used: {e}"),
        }
    }
}

impl std::error::Error for TlsConfigError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            TlsConfigError::Read { source, .. } => Some(source),
            TlsConfigError::Provider(e) => Some(e),
            _ => None,
        }
    }
}
