//! TLS configuration (rustls with ring): the server's certificate and its
//! optional client CA, the client's trust roots and optional certificate,
//! and what a failed handshake means to the client (spec §12.4, §12.5).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::{ClientConfig, RootCertStore, ServerConfig};

/// Files a TLS listener is configured with.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ServerFiles {
    /// The certificate chain (PEM), leaf first.
    pub cert: PathBuf,
    /// The private key (PEM: PKCS#8, PKCS#1 or SEC1).
    pub key: PathBuf,
    /// When set, a client certificate signed by this CA (PEM) is required.
    pub client_ca: Option<PathBuf>,
}

/// Files a TLS client is configured with.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ClientFiles {
    /// Trust only this CA (PEM) instead of the system's store.
    pub ca: Option<PathBuf>,
    /// A client certificate chain and its key (PEM).
    pub cert: Option<PathBuf>,
    pub key: Option<PathBuf>,
}

/// ring's provider with the AES-GCM suites only (TLS 1.3 and 1.2, ECDSA
/// and RSA): every TLS 1.3 peer has `TLS_AES_128_GCM_SHA256`, and leaving
/// ChaCha20-Poly1305 out keeps its code out of the binary
/// (docs/BENCHMARKS.md, "Binary size").
fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    use rustls::crypto::ring::cipher_suite as suite;
    Arc::new(rustls::crypto::CryptoProvider {
        cipher_suites: vec![
            suite::TLS13_AES_256_GCM_SHA384,
            suite::TLS13_AES_128_GCM_SHA256,
            suite::TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384,
            suite::TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256,
            suite::TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384,
            suite::TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256,
        ],
        ..rustls::crypto::ring::default_provider()
    })
}

const VERSIONS: &[&rustls::SupportedProtocolVersion] =
    &[&rustls::version::TLS13, &rustls::version::TLS12];

fn certificates(path: &Path, what: &str) -> Result<Vec<CertificateDer<'static>>, String> {
    let certs = CertificateDer::pem_file_iter(path)
        .and_then(|iter| iter.collect::<Result<Vec<_>, _>>())
        .map_err(|e| format!("{what} {}: {}", path.display(), pem_problem(e)))?;
    if certs.is_empty() {
        return Err(format!(
            "{what} {}: no PEM certificate in the file",
            path.display()
        ));
    }
    Ok(certs)
}

fn private_key(path: &Path) -> Result<PrivateKeyDer<'static>, String> {
    PrivateKeyDer::from_pem_file(path)
        .map_err(|e| format!("private key {}: {}", path.display(), pem_problem(e)))
}

fn pem_problem(error: rustls::pki_types::pem::Error) -> String {
    use rustls::pki_types::pem::Error;
    match error {
        Error::Io(e) => e.to_string(),
        Error::NoItemsFound => "no PEM item of the expected kind in the file".to_owned(),
        other => format!("not valid PEM ({other})"),
    }
}

fn roots(path: &Path) -> Result<RootCertStore, String> {
    let mut roots = RootCertStore::empty();
    for cert in certificates(path, "CA file")? {
        roots
            .add(cert)
            .map_err(|e| format!("CA file {}: {e}", path.display()))?;
    }
    Ok(roots)
}

/// The configuration of TLS listeners; an error names the file and what is
/// wrong with it.
pub fn server_config(files: &ServerFiles) -> Result<Arc<ServerConfig>, String> {
    let certs = certificates(&files.cert, "certificate")?;
    let key = private_key(&files.key)?;
    let builder = ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(VERSIONS)
        .map_err(|e| e.to_string())?;
    let builder = match &files.client_ca {
        Some(ca) => {
            let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
                Arc::new(roots(ca)?),
                provider(),
            )
            .build()
            .map_err(|e| format!("client CA {}: {e}", ca.display()))?;
            builder.with_client_cert_verifier(verifier)
        }
        None => builder.with_no_client_auth(),
    };
    let mut config = builder.with_single_cert(certs, key).map_err(|e| {
        format!(
            "certificate {} and key {}: {e}",
            files.cert.display(),
            files.key.display()
        )
    })?;
    // A lock client opens few, long sessions: no resumption cache to grow.
    config.session_storage = Arc::new(rustls::server::NoServerSessionStorage {});
    config.send_tls13_tickets = 0;
    Ok(Arc::new(config))
}

/// The configuration of TLS client sessions: the CA file's roots, or else
/// the system's trust store.
pub fn client_config(files: &ClientFiles) -> Result<Arc<ClientConfig>, String> {
    let roots = match &files.ca {
        Some(ca) => roots(ca)?,
        None => {
            let found = rustls_native_certs::load_native_certs();
            let mut roots = RootCertStore::empty();
            let (added, _) = roots.add_parsable_certificates(found.certs);
            if added == 0 {
                return Err(
                    "no CA certificate in the system's trust store (give one with --tls-ca)"
                        .to_owned(),
                );
            }
            roots
        }
    };
    let builder = ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(VERSIONS)
        .map_err(|e| e.to_string())?
        .with_root_certificates(roots);
    let config = match (&files.cert, &files.key) {
        (Some(cert), Some(key)) => builder
            .with_client_auth_cert(certificates(cert, "certificate")?, private_key(key)?)
            .map_err(|e| {
                format!(
                    "certificate {} and key {}: {e}",
                    cert.display(),
                    key.display()
                )
            })?,
        (None, None) => builder.with_no_client_auth(),
        _ => return Err("--tls-cert and --tls-key go together".to_owned()),
    };
    Ok(Arc::new(config))
}

/// What a TLS failure on a client session means (spec §12.5).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Failure {
    /// We do not trust the server: its certificate failed verification.
    Untrusted(&'static str),
    /// The server refused our certificate, or its absence.
    Refused(&'static str),
    /// The peer answered with bytes that are no TLS record: it does not
    /// speak TLS on that port (a plain kunci port addressed as `tls://`).
    NotTls(&'static str),
    /// Anything else (no common protocol, a corrupt record).
    Other(&'static str),
}

/// What a client session's TLS error means, if `error` carries one.
pub fn failure(error: &std::io::Error) -> Option<Failure> {
    let tls = error.get_ref()?.downcast_ref::<rustls::Error>()?;
    Some(classify(tls))
}

fn classify(error: &rustls::Error) -> Failure {
    use rustls::AlertDescription as Alert;
    use rustls::CertificateError as Cert;
    match error {
        rustls::Error::InvalidCertificate(problem) => Failure::Untrusted(match problem {
            Cert::UnknownIssuer => "the server's certificate is not signed by a trusted CA",
            Cert::NotValidForName | Cert::NotValidForNameContext { .. } => {
                "the server's certificate does not name the address's host"
            }
            Cert::Expired | Cert::ExpiredContext { .. } => "the server's certificate has expired",
            Cert::NotValidYet | Cert::NotValidYetContext { .. } => {
                "the server's certificate is not valid yet"
            }
            Cert::Revoked => "the server's certificate is revoked",
            Cert::BadSignature => "the server's certificate has a bad signature",
            Cert::BadEncoding => "the server's certificate does not parse",
            Cert::InvalidPurpose | Cert::InvalidPurposeContext { .. } => {
                "the server's certificate is not for server authentication"
            }
            _ => "the server's certificate failed verification",
        }),
        rustls::Error::AlertReceived(alert) => match alert {
            Alert::CertificateRequired => {
                Failure::Refused("the server requires a client certificate (--tls-cert)")
            }
            Alert::UnknownCA
            | Alert::BadCertificate
            | Alert::CertificateUnknown
            | Alert::UnsupportedCertificate
            | Alert::CertificateExpired
            | Alert::CertificateRevoked
            | Alert::AccessDenied
            | Alert::DecryptError => {
                Failure::Refused("the server refused this client's certificate")
            }
            _ => Failure::Other("the server ended the TLS handshake with an alert"),
        },
        rustls::Error::NoCertificatesPresented => {
            Failure::Untrusted("the server presented no certificate")
        }
        rustls::Error::InvalidMessage(_) => Failure::NotTls(
            "the server does not speak TLS on that port (a plain kunci port?): \
             address it without tls://",
        ),
        rustls::Error::PeerIncompatible(_) => {
            Failure::Other("the server and this client share no TLS version or cipher")
        }
        _ => Failure::Other("the TLS session failed"),
    }
}

/// The server name to check the certificate against: the host of
/// `HOST:PORT` (an IP address is checked as one).
pub fn server_name(host_port: &str) -> Result<rustls::pki_types::ServerName<'static>, String> {
    let host = host_port
        .rsplit_once(':')
        .map_or(host_port, |(host, _)| host);
    let host = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    rustls::pki_types::ServerName::try_from(host.to_owned())
        .map_err(|e| format!("{host:?} is not a server name for TLS: {e}"))
}
