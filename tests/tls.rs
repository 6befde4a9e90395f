//! TLS (spec §12.4, §12.5): `tls://` listeners beside plaintext ones, the
//! handshake deadline, client certificates, and what the CLI and the
//! library say when a certificate is not trusted or not accepted. A
//! private CA and its certificates are made here with rcgen.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::{Command, Output, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kunci::client::{Client, Config, Denied, Error, Unavailable};
use kunci::protocol::{self, ErrorCode};
use kunci::tls::ClientFiles;
use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair};

use crate::util::{TempDir, TestServer, kunci_bin};

/// A CA, a server certificate for `localhost` and client certificates,
/// as PEM files; and a second CA that signed nothing the server knows.
pub struct Pki {
    pub dir: TempDir,
}

fn new_ca(name: &str) -> (rcgen::Certificate, Issuer<'static, KeyPair>) {
    let mut params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params
        .distinguished_name
        .push(rcgen::DnType::CommonName, name);
    let key = KeyPair::generate().expect("CA key");
    let cert = params.self_signed(&key).expect("CA certificate");
    (cert, Issuer::new(params, key))
}

fn leaf(names: &[&str], issuer: &Issuer<'_, KeyPair>) -> (String, String) {
    let names: Vec<String> = names.iter().map(|n| (*n).to_owned()).collect();
    let params = CertificateParams::new(names).expect("leaf params");
    let key = KeyPair::generate().expect("leaf key");
    let cert = params.signed_by(&key, issuer).expect("leaf certificate");
    (cert.pem(), key.serialize_pem())
}

impl Pki {
    pub fn new() -> Pki {
        let dir = TempDir::new("tls");
        let (ca_cert, ca) = new_ca("kunci test CA");
        let (other_cert, other) = new_ca("some other CA");
        let write = |name: &str, text: &str| std::fs::write(dir.join(name), text).expect("write");
        write("ca.pem", &ca_cert.pem());
        write("other-ca.pem", &other_cert.pem());
        // The server's certificate names `localhost` only: `127.0.0.1`
        // does not match it.
        let (cert, key) = leaf(&["localhost"], &ca);
        write("server.pem", &cert);
        write("server.key", &key);
        let (cert, key) = leaf(&["client"], &ca);
        write("client.pem", &cert);
        write("client.key", &key);
        let (cert, key) = leaf(&["client"], &other);
        write("stranger.pem", &cert);
        write("stranger.key", &key);
        Pki { dir }
    }

    pub fn path(&self, name: &str) -> String {
        self.dir.join(name).to_string_lossy().into_owned()
    }

    /// rustls configurations for an in-process endpoint (`server.pem`, no
    /// client certificates asked for) and for a client that trusts `ca.pem`.
    pub fn in_process_configs(&self) -> (Arc<rustls::ServerConfig>, Arc<rustls::ClientConfig>) {
        let server = kunci::tls::server_config(&kunci::tls::ServerFiles {
            cert: self.dir.join("server.pem"),
            key: self.dir.join("server.key"),
            client_ca: None,
        })
        .unwrap();
        let client = kunci::tls::client_config(&ClientFiles {
            ca: Some(self.dir.join("ca.pem")),
            ..ClientFiles::default()
        })
        .unwrap();
        (server, client)
    }

    /// A server with a plaintext and a TLS listener; `extra` adds flags.
    pub fn server(&self, extra: &[&str]) -> TestServer {
        let cert = self.path("server.pem");
        let key = self.path("server.key");
        let mut args = vec![
            "--listen",
            "127.0.0.1:0",
            "--listen",
            "tls://127.0.0.1:0",
            "--tls-cert",
            &cert,
            "--tls-key",
            &key,
        ];
        args.extend_from_slice(extra);
        TestServer::start(&args)
    }
}

/// The server's TLS address by the name its certificate has.
fn tls_address(server: &TestServer) -> String {
    let tls = server
        .addresses
        .iter()
        .find(|a| a.starts_with("tls://"))
        .expect("a tls:// listener");
    tls.replace("127.0.0.1", "localhost")
}

fn tls_port(server: &TestServer) -> u16 {
    let address = tls_address(server);
    address.rsplit(':').next().unwrap().parse().unwrap()
}

/// The plaintext address of a server from [`Pki::server`].
fn plain_address(server: &TestServer) -> String {
    server
        .addresses
        .iter()
        .find(|a| !a.starts_with("tls://") && !a.starts_with("unix:"))
        .expect("a plaintext listener")
        .clone()
}

/// Asserts a `kunci` run's exit status and its whole stderr.
fn assert_exit(output: &Output, code: i32, stderr: &str) {
    assert_eq!(output.status.code(), Some(code), "{}", text(&output.stderr));
    assert_eq!(text(&output.stderr), stderr);
}

fn kunci(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut command = Command::new(kunci_bin());
    command
        .args(args)
        .env_remove("KUNCI_SERVER")
        .env_remove("KUNCI_TLS_CA")
        .env_remove("RUST_LOG")
        .stdin(Stdio::null());
    for (name, value) in env {
        command.env(name, value);
    }
    command.output().expect("run kunci")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

#[test]
fn acquire_and_release_over_tls_beside_plaintext() {
    let pki = Pki::new();
    let server = pki.server(&[]);
    let tls = tls_address(&server);
    let ca = pki.path("ca.pem");
    let acquired = kunci(
        &["acquire", "tls-key", "--server", &tls, "--tls-ca", &ca],
        &[],
    );
    assert_eq!(
        acquired.status.code(),
        Some(0),
        "{}",
        text(&acquired.stderr)
    );
    let token = text(&acquired.stdout).trim().to_owned();
    assert!(token.parse::<u64>().is_ok(), "{token:?}");
    // The plaintext listener serves the same table.
    let plain = plain_address(&server);
    let query = kunci(&["query", "tls-key", "--server", &plain], &[]);
    assert!(
        text(&query.stdout).starts_with(&format!("held token={token} ")),
        "{}",
        text(&query.stdout)
    );
    // KUNCI_TLS_CA stands for --tls-ca.
    let released = kunci(
        &["release", "tls-key", &token, "--server", &tls],
        &[("KUNCI_TLS_CA", &ca)],
    );
    assert_eq!(
        released.status.code(),
        Some(0),
        "{}",
        text(&released.stderr)
    );
    let query = kunci(&["query", "tls-key", "--server", &plain], &[]);
    assert_eq!(text(&query.stdout), "free\n");
}

/// Issue 25 defect 5: a TLS port addressed without tls:// ends at once,
/// saying to use it, even with --wait inf; tls:// to a plain port says
/// the server does not speak TLS, and gives no advice about a CA.
#[test]
fn the_wrong_side_of_tls_ends_at_once_naming_the_mix_up() {
    let pki = Pki::new();
    let server = pki.server(&[]);
    let tls_as_plain = tls_address(&server).replace("tls://", "");
    let started = Instant::now();
    let mut child = Command::new(kunci_bin())
        .args(["acquire", "k", "--wait", "inf", "--server", &tls_as_plain])
        .env_remove("KUNCI_SERVER")
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    while child.try_wait().unwrap().is_none() && started.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    let output = child.wait_with_output().unwrap();
    assert!(started.elapsed() < Duration::from_secs(3), "{output:?}");
    assert_exit(
        &output,
        4,
        &format!(
            "kunci acquire: unavailable: {tls_as_plain} answered: the server speaks TLS: \
             address it as tls://HOST:PORT; nothing was executed\n"
        ),
    );
    let plain_as_tls = format!(
        "tls://{}",
        plain_address(&server).replace("127.0.0.1", "localhost")
    );
    let ca = pki.path("ca.pem");
    let started = Instant::now();
    let output = kunci(&["ping", "--tls-ca", &ca, "--server", &plain_as_tls], &[]);
    assert!(started.elapsed() < Duration::from_secs(3), "{output:?}");
    assert_exit(
        &output,
        4,
        &format!(
            "kunci ping: unavailable: {plain_as_tls} answered: the server does not speak TLS \
             on that port (a plain kunci port?): address it without tls://; nothing was \
             executed\n"
        ),
    );
}

/// Issue 25: TLS option mistakes are usage errors (exit 2) before any
/// connection: a certificate without its key, a key of another
/// certificate.
#[test]
fn tls_option_mistakes_are_usage_errors() {
    let pki = Pki::new();
    let (ca, cert, key) = (
        pki.path("ca.pem"),
        pki.path("client.pem"),
        pki.path("stranger.key"),
    );
    let output = kunci(
        &["ping", "--tls-cert", &cert, "--server", "tls://localhost:1"],
        &[],
    );
    assert_exit(
        &output,
        2,
        "kunci ping: --tls-cert and --tls-key go together\n(see kunci ping --help)\n",
    );
    let output = kunci(
        &[
            "ping",
            "--tls-ca",
            &ca,
            "--tls-cert",
            &cert,
            "--tls-key",
            &key,
            "--server",
            "tls://localhost:1",
        ],
        &[],
    );
    assert_eq!(output.status.code(), Some(2), "{}", text(&output.stderr));
    assert!(
        text(&output.stderr).starts_with("kunci ping: TLS: "),
        "{}",
        text(&output.stderr)
    );
}

#[test]
fn library_client_over_tls() {
    let pki = Pki::new();
    let server = pki.server(&[]);
    let config = Config {
        tls: ClientFiles {
            ca: Some(pki.dir.join("ca.pem")),
            ..ClientFiles::default()
        },
        ..Config::default()
    };
    let client = Client::new([tls_address(&server).parse().unwrap()], config).unwrap();
    let ticket = client
        .acquire("lib-key", Duration::ZERO, Duration::from_secs(30))
        .expect("acquire over TLS");
    assert!(ticket.token() > 0);
    client
        .release("lib-key", ticket.token())
        .expect("release over TLS");
}

#[test]
fn an_untrusted_server_is_unavailable_with_the_problem_named() {
    let pki = Pki::new();
    let server = pki.server(&[]);
    let started = Instant::now();
    let wrong_ca = kunci(
        &[
            "acquire",
            "k",
            "--server",
            &tls_address(&server),
            "--tls-ca",
            &pki.path("other-ca.pem"),
        ],
        &[],
    );
    assert_exit(
        &wrong_ca,
        4,
        "kunci acquire: unavailable: TLS: the server's certificate is not signed by a \
         trusted CA; nothing was sent. Give the CA that signed the server's certificate \
         with --tls-ca (or KUNCI_TLS_CA), and use the host name the certificate names\n",
    );
    // Not trusting the server does not change within a call: no waiting
    // for the transport deadline.
    assert!(started.elapsed() < Duration::from_secs(3));
    // The certificate names localhost, not 127.0.0.1.
    let by_ip = format!("tls://127.0.0.1:{}", tls_port(&server));
    let wrong_name = kunci(
        &[
            "acquire",
            "k",
            "--server",
            &by_ip,
            "--tls-ca",
            &pki.path("ca.pem"),
        ],
        &[],
    );
    assert_eq!(wrong_name.status.code(), Some(4));
    assert!(
        text(&wrong_name.stderr)
            .contains("the server's certificate does not name the address's host"),
        "{}",
        text(&wrong_name.stderr)
    );
    // The library says the same.
    let config = Config {
        tls: ClientFiles {
            ca: Some(pki.dir.join("other-ca.pem")),
            ..ClientFiles::default()
        },
        ..Config::default()
    };
    let client = Client::new([tls_address(&server).parse().unwrap()], config).unwrap();
    assert_eq!(
        client.query("k"),
        Err(Error::Unavailable(Unavailable::Untrusted(
            "the server's certificate is not signed by a trusted CA"
        )))
    );
    // A CA file that is not there stops the command before anything: a
    // usage error, as every TLS option mistake.
    let missing = kunci(
        &[
            "ping",
            "--server",
            &tls_address(&server),
            "--tls-ca",
            "/nonexistent/ca.pem",
        ],
        &[],
    );
    assert_eq!(missing.status.code(), Some(2));
    assert!(
        text(&missing.stderr).contains("CA file /nonexistent/ca.pem: No such file or directory"),
        "{}",
        text(&missing.stderr)
    );
}

#[test]
fn client_certificates_when_the_listener_requires_them() {
    let pki = Pki::new();
    let server = pki.server(&["--tls-client-ca", &pki.path("ca.pem")]);
    let tls = tls_address(&server);
    let ca = pki.path("ca.pem");
    let started = Instant::now();
    let without = kunci(&["acquire", "m", "--server", &tls, "--tls-ca", &ca], &[]);
    assert_eq!(without.status.code(), Some(7), "{}", text(&without.stderr));
    assert_eq!(
        text(&without.stderr),
        "kunci acquire: permission denied: the server requires a client certificate \
         (--tls-cert); nothing was executed\n"
    );
    assert!(started.elapsed() < Duration::from_secs(3));
    // `acquire m` with the certificate and key `{identity}.pem`/`.key`.
    let acquire_as = |identity: &str| {
        let cert = pki.path(&format!("{identity}.pem"));
        let key = pki.path(&format!("{identity}.key"));
        let args = ["acquire", "m", "--server", &tls, "--tls-ca", &ca];
        kunci(
            &[&args[..], &["--tls-cert", &cert, "--tls-key", &key]].concat(),
            &[],
        )
    };
    let stranger = acquire_as("stranger");
    assert_exit(
        &stranger,
        7,
        "kunci acquire: permission denied: the server refused this client's certificate; \
         nothing was executed\n",
    );
    let with = acquire_as("client");
    assert_eq!(with.status.code(), Some(0), "{}", text(&with.stderr));
    // Nothing the refused clients sent was executed: one grant, ours.
    let query = kunci(&["query", "m", "--server", &plain_address(&server)], &[]);
    let token = text(&with.stdout).trim().to_owned();
    assert!(
        text(&query.stdout).starts_with(&format!("held token={token} ")),
        "{}",
        text(&query.stdout)
    );
    // The plaintext listener asks for no certificate.
    let plain = kunci(&["ping", "--server", &plain_address(&server)], &[]);
    assert_eq!(plain.status.code(), Some(0));
    // The library: PermissionDenied.
    let config = Config {
        tls: ClientFiles {
            ca: Some(pki.dir.join("ca.pem")),
            ..ClientFiles::default()
        },
        ..Config::default()
    };
    let client = Client::new([tls.parse().unwrap()], config).unwrap();
    assert_eq!(
        client.query("m"),
        Err(Error::PermissionDenied(Denied::Certificate(
            "the server requires a client certificate (--tls-cert)"
        )))
    );
}

/// Reads until the server closes; how long that took from `since`.
fn closed_after(mut stream: TcpStream, since: Instant) -> Duration {
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let mut buf = [0u8; 4096];
    loop {
        match stream.read(&mut buf) {
            Ok(0) | Err(_) => return since.elapsed(),
            Ok(_) => {}
        }
    }
}

#[test]
fn a_stalled_handshake_is_closed_at_ten_seconds() {
    let pki = Pki::new();
    let server = pki.server(&[]);
    let address = format!("127.0.0.1:{}", tls_port(&server));
    // A ClientHello record header promising 512 bytes, and 5 of them.
    let half_hello: &[u8] = &[0x16, 0x03, 0x01, 0x02, 0x00, 0x01, 0x00, 0x01, 0xfc, 0x03];
    let peers: Vec<std::thread::JoinHandle<(String, Duration)>> = ["silent", "half", "dribble"]
        .into_iter()
        .map(|kind| {
            let address = address.clone();
            std::thread::spawn(move || {
                let since = Instant::now();
                let mut stream = TcpStream::connect(&address).unwrap();
                match kind {
                    "half" => stream.write_all(half_hello).unwrap(),
                    "dribble" => {
                        // A byte every 400 ms: each one is progress, but
                        // the handshake's deadline runs from the accept.
                        let writer = stream.try_clone().unwrap();
                        std::thread::spawn(move || {
                            let mut writer = writer;
                            for byte in half_hello.iter().cycle().take(60) {
                                if writer.write_all(&[*byte]).is_err() {
                                    return;
                                }
                                std::thread::sleep(Duration::from_millis(400));
                            }
                        });
                    }
                    _ => {}
                }
                (kind.to_owned(), closed_after(stream, since))
            })
        })
        .collect();
    for peer in peers {
        let (kind, after) = peer.join().unwrap();
        assert!(
            after >= Duration::from_secs(10),
            "{kind}: closed after {after:?}"
        );
        assert!(
            after < Duration::from_secs(13),
            "{kind}: closed after {after:?}"
        );
    }
    // The server is still there for others.
    let ping = kunci(
        &[
            "ping",
            "--server",
            &tls_address(&server),
            "--tls-ca",
            &pki.path("ca.pem"),
        ],
        &[],
    );
    assert_eq!(ping.status.code(), Some(0), "{}", text(&ping.stderr));
}

/// A blocking TLS session with the server, trusting the test CA.
fn tls_session(
    pki: &Pki,
    server: &TestServer,
) -> rustls::StreamOwned<rustls::ClientConnection, TcpStream> {
    let files = ClientFiles {
        ca: Some(pki.dir.join("ca.pem")),
        ..ClientFiles::default()
    };
    let config: Arc<rustls::ClientConfig> = kunci::tls::client_config(&files).unwrap();
    let name = kunci::tls::server_name("localhost:1").unwrap();
    let session = rustls::ClientConnection::new(config, name).unwrap();
    let tcp = TcpStream::connect(("127.0.0.1", tls_port(server))).unwrap();
    tcp.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    rustls::StreamOwned::new(session, tcp)
}

/// A handshake offering only `suites` of `version`, then a `P`: the
/// negotiated suite, or the handshake's error.
fn session_with(
    pki: &Pki,
    server: &TestServer,
    version: &'static rustls::SupportedProtocolVersion,
    suites: &[rustls::SupportedCipherSuite],
) -> Result<rustls::CipherSuite, String> {
    use rustls::pki_types::CertificateDer;
    use rustls::pki_types::pem::PemObject;
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_file_iter(pki.dir.join("ca.pem")).unwrap() {
        roots.add(cert.unwrap()).unwrap();
    }
    let provider = rustls::crypto::CryptoProvider {
        cipher_suites: suites.to_vec(),
        ..rustls::crypto::ring::default_provider()
    };
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(provider))
        .with_protocol_versions(&[version])
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
    let mut session = rustls::ClientConnection::new(Arc::new(config), name).unwrap();
    let mut tcp = TcpStream::connect(("127.0.0.1", tls_port(server))).unwrap();
    tcp.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    while session.is_handshaking() {
        session.complete_io(&mut tcp).map_err(|e| e.to_string())?;
    }
    let suite = session.negotiated_cipher_suite().unwrap().suite();
    let mut stream = rustls::Stream::new(&mut session, &mut tcp);
    stream.write_all(&crate::util::ping(9)).unwrap();
    let mut pong = [0u8; 64];
    let n = stream.read(&mut pong).unwrap();
    let mut expected = Vec::new();
    protocol::encode_response(&protocol::Response::Pong { nonce: 9 }, &mut expected);
    assert_eq!(&pong[..n], &expected[..]);
    Ok(suite)
}

/// Spec §12.4: TLS 1.3 and 1.2, with the AES-GCM suites; ChaCha20-Poly1305
/// is not offered (docs/BENCHMARKS.md, "Binary size"), so a peer that
/// offers nothing else fails its handshake.
#[test]
fn tls_1_3_and_1_2_with_aes_gcm_and_no_chacha20() {
    use rustls::crypto::ring::cipher_suite as suite;
    use rustls::version::{TLS12, TLS13};
    let pki = Pki::new();
    let server = pki.server(&[]);
    for (version, offered) in [
        (&TLS13, suite::TLS13_AES_128_GCM_SHA256),
        (&TLS13, suite::TLS13_AES_256_GCM_SHA384),
        (&TLS12, suite::TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256),
        (&TLS12, suite::TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384),
    ] {
        assert_eq!(
            session_with(&pki, &server, version, &[offered]),
            Ok(offered.suite()),
            "{:?}",
            offered.suite()
        );
    }
    for (version, offered) in [
        (&TLS13, suite::TLS13_CHACHA20_POLY1305_SHA256),
        (&TLS12, suite::TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256),
    ] {
        let refused = session_with(&pki, &server, version, &[offered]);
        assert!(
            refused
                .as_ref()
                .is_err_and(|e| e.contains("HandshakeFailure") || e.contains("handshake")),
            "{:?}: {refused:?}",
            offered.suite()
        );
    }
}

#[test]
fn graceful_shutdown_sends_x8_and_close_notify_over_tls() {
    let pki = Pki::new();
    let server = pki.server(&[]);
    let mut session = tls_session(&pki, &server);
    session.write_all(&crate::util::ping(7)).unwrap();
    let mut pong = [0u8; 64];
    let n = session.read(&mut pong).unwrap();
    let mut expected = Vec::new();
    protocol::encode_response(&protocol::Response::Pong { nonce: 7 }, &mut expected);
    assert_eq!(&pong[..n], &expected[..]);
    server.signal(libc::SIGTERM);
    let mut rest = Vec::new();
    // A clean end: close_notify, not a truncation (which is an error).
    session.read_to_end(&mut rest).expect("close_notify");
    let mut x8 = Vec::new();
    protocol::encode_response(&ErrorCode::ShuttingDown.response(0), &mut x8);
    assert_eq!(text(&rest), text(&x8));
}

#[test]
fn refused_tls_peers_are_closed_with_nothing_sent() {
    let pki = Pki::new();
    let server = pki.server(&["--allow", "10.0.0.0/8"]);
    let mut session = tls_session(&pki, &server);
    let mut buf = Vec::new();
    let result = session.read_to_end(&mut buf);
    assert!(buf.is_empty(), "{buf:?}");
    assert!(result.is_err(), "the handshake cannot succeed");
    // The plaintext listener still says `X 9`.
    let mut peer = crate::util::Peer::connect(&plain_address(&server));
    assert_eq!(
        peer.recv(),
        protocol::Response::Error {
            code: 9,
            id: 0,
            text: ErrorCode::NotAllowed.text().into()
        }
    );
}

#[test]
fn bad_tls_files_stop_the_start() {
    let pki = Pki::new();
    let serve = |args: &[&str]| {
        let output = kunci(&[&["serve", "--no-state-dir"], args].concat(), &[]);
        (output.status.code(), text(&output.stderr))
    };
    let (code, log) = serve(&[
        "--listen",
        "tls://127.0.0.1:0",
        "--tls-cert",
        "/nonexistent/server.pem",
        "--tls-key",
        &pki.path("server.key"),
    ]);
    assert_eq!(code, Some(1));
    assert!(
        log.contains(
            "cannot start: TLS: certificate /nonexistent/server.pem: No such file or directory"
        ),
        "{log}"
    );
    // A key that is not the certificate's.
    let (code, log) = serve(&[
        "--listen",
        "tls://127.0.0.1:0",
        "--tls-cert",
        &pki.path("server.pem"),
        "--tls-key",
        &pki.path("client.key"),
    ]);
    assert_eq!(code, Some(1));
    assert!(log.contains("cannot start: TLS: certificate "), "{log}");
    // A certificate file that holds none.
    let (code, log) = serve(&[
        "--listen",
        "tls://127.0.0.1:0",
        "--tls-cert",
        &pki.path("server.key"),
        "--tls-key",
        &pki.path("server.key"),
    ]);
    assert_eq!(code, Some(1));
    assert!(log.contains("no PEM"), "{log}");
    let (code, log) = serve(&["--listen", "tls://127.0.0.1:0"]);
    assert_eq!(code, Some(1));
    assert!(
        log.contains("cannot start: TLS: a tls:// listener needs --tls-cert and --tls-key"),
        "{log}"
    );
}

/// One etcd member serving clients over TLS only, with the test CA's
/// server certificate; `extra` adds flags (client certificates).
#[cfg(feature = "etcd")]
struct EtcdTls {
    child: std::process::Child,
    port: u16,
    _dir: TempDir,
}

#[cfg(feature = "etcd")]
impl EtcdTls {
    fn start(pki: &Pki, extra: &[&str]) -> EtcdTls {
        let free = || {
            std::net::TcpListener::bind("127.0.0.1:0")
                .unwrap()
                .local_addr()
                .unwrap()
                .port()
        };
        let (port, peer) = (free(), free());
        let dir = TempDir::new("etcds");
        let log = std::fs::File::create(dir.join("etcd.log")).unwrap();
        let child = Command::new("etcd")
            .args(["--name", "m0"])
            .arg("--data-dir")
            .arg(dir.join("data"))
            .args(["--listen-client-urls", &format!("https://127.0.0.1:{port}")])
            .args([
                "--advertise-client-urls",
                &format!("https://localhost:{port}"),
            ])
            .args(["--listen-peer-urls", &format!("http://127.0.0.1:{peer}")])
            .args([
                "--initial-advertise-peer-urls",
                &format!("http://127.0.0.1:{peer}"),
            ])
            .args(["--initial-cluster", &format!("m0=http://127.0.0.1:{peer}")])
            .args(["--cert-file", &pki.path("server.pem")])
            .args(["--key-file", &pki.path("server.key")])
            .args(extra)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("spawn etcd");
        EtcdTls {
            child,
            port,
            _dir: dir,
        }
    }

    fn address(&self) -> String {
        format!("etcds://localhost:{}", self.port)
    }
}

#[cfg(feature = "etcd")]
impl Drop for EtcdTls {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `kunci ARGS --server ADDRESS`, retried while etcd starts (exit 4).
#[cfg(feature = "etcd")]
fn kunci_when_up(address: &str, args: &[&str]) -> Output {
    let give_up = Instant::now() + Duration::from_secs(30);
    loop {
        let output = kunci(&[args, &["--server", address]].concat(), &[]);
        if output.status.code() != Some(4) || Instant::now() > give_up {
            return output;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[cfg(feature = "etcd")]
#[test]
fn etcds_with_a_private_ca_and_client_certificates() {
    if !crate::util::require_tool("etcd", "etcd-server") {
        return;
    }
    let pki = Pki::new();
    let ca = pki.path("ca.pem");
    let etcd = EtcdTls::start(&pki, &[]);
    let address = etcd.address();
    let acquired = kunci_when_up(&address, &["acquire", "e", "--tls-ca", &ca]);
    assert_eq!(
        acquired.status.code(),
        Some(0),
        "{}",
        text(&acquired.stderr)
    );
    let token = text(&acquired.stdout).trim().to_owned();
    let released = kunci(
        &[
            "release", "e", &token, "--server", &address, "--tls-ca", &ca,
        ],
        &[],
    );
    assert_eq!(
        released.status.code(),
        Some(0),
        "{}",
        text(&released.stderr)
    );
    // A CA that did not sign etcd's certificate: nothing is sent.
    let untrusted = kunci(
        &[
            "acquire",
            "e",
            "--server",
            &address,
            "--tls-ca",
            &pki.path("other-ca.pem"),
        ],
        &[],
    );
    assert_eq!(
        untrusted.status.code(),
        Some(4),
        "{}",
        text(&untrusted.stderr)
    );
    drop(etcd);

    // etcd that requires a client certificate from the test CA.
    let etcd = EtcdTls::start(&pki, &["--trusted-ca-file", &ca, "--client-cert-auth"]);
    let address = etcd.address();
    let with = kunci_when_up(
        &address,
        &[
            "acquire",
            "e",
            "--tls-ca",
            &ca,
            "--tls-cert",
            &pki.path("client.pem"),
            "--tls-key",
            &pki.path("client.key"),
        ],
    );
    assert_eq!(with.status.code(), Some(0), "{}", text(&with.stderr));
}

/// Drives one TLS connection of a sans-IO endpoint with an in-memory
/// rustls client: a pipelined flood that the server's socket never takes
/// stops reading at the high-water mark with every bound kept, and then
/// every answer arrives, in order, once the socket drains.
#[test]
fn endpoint_tls_backpressure_keeps_the_bounds() {
    use kunci::core::endpoint::Endpoint;
    use kunci::core::{Core, Limits};

    let pki = Pki::new();
    let (server_config, client_config) = pki.in_process_configs();
    let mut client = rustls::ClientConnection::new(
        client_config,
        kunci::tls::server_name("localhost:1").unwrap(),
    )
    .unwrap();
    client.set_buffer_limit(None);
    let mut endpoint = Endpoint::new(Core::new(Limits::default(), 1), Vec::new());
    let now = 1_000;
    endpoint.accept_tls(0, None, &server_config, now);
    let bound = endpoint.output_bound();
    let mut answers = Vec::new();

    // Server records into the client, as far as `budget` bytes.
    fn to_client(
        endpoint: &mut Endpoint,
        client: &mut rustls::ClientConnection,
        answers: &mut Vec<u8>,
        budget: usize,
    ) -> usize {
        let mut moved = 0;
        while moved < budget {
            let Some(records) = endpoint.transmit(0) else {
                break;
            };
            let n = records.len().min(budget - moved);
            let mut slice = &records[..n];
            while !slice.is_empty() {
                client.read_tls(&mut slice).unwrap();
                client.process_new_packets().unwrap();
                // Whatever is decrypted (the reader ends with WouldBlock).
                let _ = client.reader().read_to_end(answers);
            }
            endpoint.handle_written(0, n, 1_000);
            moved += n;
        }
        let _ = client.reader().read_to_end(answers);
        moved
    }
    // Client records into the server, in reads of at most 64 KiB, while
    // the endpoint wants to read.
    // Records the client wrote and the server has not read yet are kept
    // in `pending`, as a socket buffer would keep them.
    fn to_server(
        endpoint: &mut Endpoint,
        client: &mut rustls::ClientConnection,
        pending: &mut Vec<u8>,
    ) -> usize {
        while client.wants_write() && pending.len() < 64 * 1024 {
            client.write_tls(pending).unwrap();
        }
        let mut fed = 0;
        while !pending.is_empty() {
            // A connection that spent its turn goes on at the next one.
            while endpoint
                .connection(0)
                .is_some_and(|conn| conn.phase() == kunci::core::connection::Phase::Yielded)
            {
                endpoint.begin_turn(1_000);
            }
            if !endpoint.wants_read(0) {
                break;
            }
            let n = pending.len().min(64 * 1024);
            endpoint.handle_read(0, &pending[..n], 1_000);
            pending.drain(..n);
            fed += n;
        }
        fed
    }
    let mut pending = Vec::new();

    // The handshake.
    for _ in 0..4 {
        to_server(&mut endpoint, &mut client, &mut pending);
        to_client(&mut endpoint, &mut client, &mut answers, usize::MAX);
    }
    assert!(!client.is_handshaking());
    endpoint.check_invariants();

    // 200,000 pipelined pings, and a socket that takes nothing.
    let pings = 200_000u64;
    for nonce in 0..pings {
        client
            .writer()
            .write_all(&crate::util::ping(nonce))
            .unwrap();
    }
    let mut rounds = 0;
    while client.wants_write()
        && endpoint
            .connection(0)
            .is_some_and(|conn| conn.phase() != kunci::core::connection::Phase::Backpressured)
    {
        to_server(&mut endpoint, &mut client, &mut pending);
        endpoint.check_invariants();
        rounds += 1;
        assert!(rounds < 1_000);
    }
    assert!(!endpoint.wants_read(0), "the flood stops reading");
    let held = endpoint.connection(0).unwrap();
    assert!(held.output_len() <= bound);
    assert!(held.output_len() >= 64 * 1024);

    let mut expected = Vec::new();
    for nonce in 0..pings {
        protocol::encode_response(&protocol::Response::Pong { nonce }, &mut expected);
    }
    // The socket drains 16 KiB at a time; reading resumes in between.
    while answers.len() < expected.len() {
        // One turn of the loop: what spent the last turn's share goes on.
        endpoint.begin_turn(1_000);
        let moved = to_client(&mut endpoint, &mut client, &mut answers, 16 * 1024);
        endpoint.check_invariants();
        let fed = if endpoint.wants_read(0) {
            to_server(&mut endpoint, &mut client, &mut pending)
        } else {
            0
        };
        endpoint.check_invariants();
        assert!(
            moved + fed > 0,
            "stuck after {} bytes of answers",
            answers.len()
        );
        if let Some(conn) = endpoint.connection(0) {
            assert!(conn.output_len() <= bound);
        }
    }
    assert_eq!(answers.len(), expected.len());
    assert!(answers == expected, "answers out of order");
}

/// Issue 27, finding 6: a replayed ClientHello forced a full handshake
/// (a signature each) for every connection read in one turn of the loop,
/// so 512 of them delayed established sessions by hundreds of
/// milliseconds. Now one turn advances at most `HANDSHAKES_PER_TURN`
/// handshakes; the others wait for the next turn, and all finish.
#[test]
fn one_turn_advances_a_bounded_number_of_handshakes() {
    use kunci::core::connection::Phase;
    use kunci::core::endpoint::{Action, Endpoint, HANDSHAKES_PER_TURN};
    use kunci::core::{Core, Limits};

    let pki = Pki::new();
    let (server_config, client_config) = pki.in_process_configs();
    let mut endpoint = Endpoint::new(Core::new(Limits::default(), 1), Vec::new());
    let connections = 3 * HANDSHAKES_PER_TURN;
    let mut clients = Vec::new();
    for id in 0..connections {
        endpoint.accept_tls(id, None, &server_config, 1_000);
        let mut client = rustls::ClientConnection::new(
            client_config.clone(),
            kunci::tls::server_name("localhost:1").unwrap(),
        )
        .unwrap();
        let mut hello = Vec::new();
        client.write_tls(&mut hello).unwrap();
        clients.push((client, hello));
    }
    // One turn: every ClientHello is read, as a wake-up with all of them
    // ready would.
    endpoint.begin_turn(1_000);
    for (id, (_, hello)) in clients.iter().enumerate() {
        endpoint.handle_read(id as u32, hello, 1_000);
        endpoint.check_invariants();
    }
    let answered: Vec<u32> = (0..connections)
        .filter(|&id| endpoint.transmit(id).is_some())
        .collect();
    assert_eq!(answered.len(), HANDSHAKES_PER_TURN as usize);
    let waiting = (0..connections)
        .filter(|&id| endpoint.connection(id).map(|conn| conn.phase()) == Some(Phase::Yielded))
        .count();
    assert_eq!(waiting, connections as usize - answered.len());
    assert!(endpoint.has_yielded());
    // The next turns answer the rest, a few at a time, and ask the shell
    // to read each again.
    for turn in 2..=3u32 {
        endpoint.begin_turn(1_000 * u64::from(turn));
        endpoint.check_invariants();
        let answered = (0..connections)
            .filter(|&id| endpoint.transmit(id).is_some())
            .count();
        assert_eq!(answered, turn as usize * HANDSHAKES_PER_TURN as usize);
    }
    assert!(!endpoint.has_yielded());
    let reads = std::iter::from_fn(|| endpoint.poll_action())
        .filter(|(_, action)| *action == Action::Read)
        .count();
    assert_eq!(reads, connections as usize - HANDSHAKES_PER_TURN as usize);
}
