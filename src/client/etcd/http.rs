//! A small blocking HTTP/1.1 client for etcd's JSON gateway: `POST` with
//! a JSON body, answers with `Content-Length` or chunked bodies, a pool of
//! idle keep-alive connections per member, and streaming reads for
//! watches.
//!
//! Its one job beyond moving bytes is to say, for every failure, whether
//! the request was **certainly not sent** (no byte of it reached a socket:
//! it may move to another member) or **possibly sent** (it must never be
//! sent again) — spec §8 rules 4 and 5.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use crate::client::vocabulary::Denied;

/// The largest response body accepted. etcd's answers to the requests the
/// client makes are a few hundred bytes (a range is limited to one key).
const BODY_MAX: usize = 1 << 20;

/// The largest response head accepted.
const HEAD_MAX: usize = 16 * 1024;

/// Idle connections kept per member.
const IDLE_PER_MEMBER: usize = 8;

/// The pause between rounds over all members when none took a request.
const ROUND_PAUSE: Duration = Duration::from_millis(50);

/// How a request failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Failure {
    /// No byte of it reached any member by the deadline: nothing changed.
    Unsent,
    /// It may have reached a member, but no complete answer came by the
    /// deadline (or the connection broke first).
    Unanswered,
    /// etcd has authentication on and refused this client: no or wrong
    /// user and password, or a role without permission for the key. etcd
    /// executed nothing.
    Denied(Denied),
}

/// An etcd user and password (etcd's own authentication): each request
/// carries a token from `/v3/auth/authenticate`.
#[derive(Clone, PartialEq, Eq)]
pub struct EtcdCredentials {
    pub user: String,
    pub password: String,
}

impl std::fmt::Debug for EtcdCredentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdCredentials")
            .field("user", &self.user)
            .finish_non_exhaustive()
    }
}

/// An answer: the instant just before the request's first byte was handed
/// to the socket, the HTTP status, and the body.
pub(crate) struct Answer {
    pub sent_at: Instant,
    pub status: u16,
    pub body: Vec<u8>,
}

/// How `etcds://` members are reached (`None`: plain HTTP).
#[cfg(feature = "tls")]
pub(crate) type Tls = Option<std::sync::Arc<rustls::ClientConfig>>;
#[cfg(not(feature = "tls"))]
pub(crate) type Tls = Option<std::convert::Infallible>;

/// A connection to a member: TCP, or TLS over it (`etcds://`).
pub(crate) enum Conn {
    Tcp(TcpStream),
    #[cfg(feature = "tls")]
    Tls(Box<rustls::StreamOwned<rustls::ClientConnection, TcpStream>>),
}

impl Conn {
    fn tcp(&self) -> &TcpStream {
        match self {
            Conn::Tcp(stream) => stream,
            #[cfg(feature = "tls")]
            Conn::Tls(stream) => &stream.sock,
        }
    }

    /// Bounds both directions: a TLS read may have to write, and a write
    /// read (the handshake runs within the first of them).
    fn set_timeout(&self, limit: Duration) -> io::Result<()> {
        self.tcp().set_read_timeout(Some(limit))?;
        self.tcp().set_write_timeout(Some(limit))
    }
}

impl Read for Conn {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Conn::Tcp(stream) => stream.read(buf),
            #[cfg(feature = "tls")]
            Conn::Tls(stream) => stream.read(buf),
        }
    }
}

impl Write for Conn {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Conn::Tcp(stream) => stream.write(buf),
            #[cfg(feature = "tls")]
            Conn::Tls(stream) => stream.write(buf),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        match self {
            Conn::Tcp(stream) => stream.flush(),
            #[cfg(feature = "tls")]
            Conn::Tls(stream) => stream.flush(),
        }
    }
}

/// The members of one etcd cluster and idle connections to them.
pub(crate) struct Members {
    endpoints: Vec<String>,
    idle: Vec<Mutex<Vec<Conn>>>,
    /// The member that answered last: tried first.
    preferred: AtomicUsize,
    connect_timeout: Duration,
    credentials: Option<EtcdCredentials>,
    /// The token the credentials got, while etcd takes it.
    token: Mutex<Option<String>>,
    #[cfg_attr(not(feature = "tls"), allow(dead_code))]
    tls: Tls,
}

fn remaining(deadline: Instant) -> Option<Duration> {
    let left = deadline.saturating_duration_since(Instant::now());
    (!left.is_zero()).then_some(left)
}

fn timed_out() -> io::Error {
    io::Error::new(io::ErrorKind::TimedOut, "deadline passed")
}

fn invalid(what: &'static str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what)
}

impl Members {
    pub(crate) fn new(endpoints: Vec<String>, connect_timeout: Duration, tls: Tls) -> Members {
        let idle = endpoints.iter().map(|_| Mutex::new(Vec::new())).collect();
        Members {
            endpoints,
            idle,
            preferred: AtomicUsize::new(0),
            connect_timeout,
            credentials: None,
            token: Mutex::new(None),
            tls,
        }
    }

    /// Authenticates every request with these credentials.
    pub(crate) fn with_credentials(mut self, credentials: Option<EtcdCredentials>) -> Members {
        self.credentials = credentials;
        self
    }

    /// The token to send, getting one first if there is none. etcd answers
    /// a request without a valid one before executing anything, so a
    /// failure here leaves the request certainly unsent.
    fn token(&self, deadline: Instant) -> Result<Option<String>, Failure> {
        let Some(credentials) = &self.credentials else {
            return Ok(None);
        };
        let mut token = self.token.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(token) = token.as_ref() {
            return Ok(Some(token.clone()));
        }
        let body = format!(
            r#"{{"name":{},"password":{}}}"#,
            json_text(&credentials.user),
            json_text(&credentials.password)
        );
        let answer = self
            .post_once("/v3/auth/authenticate", &body, None, deadline)
            .map_err(|failure| match failure {
                Failure::Unanswered => Failure::Unsent,
                other => other,
            })?;
        let value = super::json::parse(&answer.body);
        let fresh = value
            .as_ref()
            .map(|value| super::json::text(value, "token"))
            .filter(|text| !text.is_empty());
        match fresh {
            Some(fresh) if answer.status == 200 => {
                *token = Some(fresh.to_owned());
                Ok(Some(fresh.to_owned()))
            }
            _ => {
                log::debug!(
                    "etcd authenticate: status {}: {}",
                    answer.status,
                    String::from_utf8_lossy(&answer.body)
                );
                Err(Failure::Denied(Denied::NotAuthenticated))
            }
        }
    }

    fn forget_token(&self) {
        *self.token.lock().unwrap_or_else(PoisonError::into_inner) = None;
    }

    pub(crate) fn endpoints(&self) -> &[String] {
        &self.endpoints
    }

    /// Sends `body` to `path` and reads the answer, by `deadline`.
    ///
    /// A request that is certainly not sent moves on to the next member
    /// (rule 4) until the deadline, then fails [`Failure::Unsent`]. Once a
    /// byte of it is in a socket it is never sent again: no complete
    /// answer by the deadline is [`Failure::Unanswered`].
    ///
    /// With credentials, the request carries a token; a token etcd no
    /// longer takes (it expires when unused) is replaced and the request
    /// sent again once, since etcd executed nothing. A refusal for lack of
    /// authentication or permission is [`Failure::Denied`].
    pub(crate) fn post(
        &self,
        path: &str,
        body: &str,
        deadline: Instant,
    ) -> Result<Answer, Failure> {
        let token = self.token(deadline)?;
        let mut answer = self.post_once(path, body, token.as_deref(), deadline)?;
        if answer.status == 401 && self.credentials.is_some() {
            self.forget_token();
            let token = self.token(deadline)?;
            answer = self.post_once(path, body, token.as_deref(), deadline)?;
        }
        let message = || String::from_utf8_lossy(&answer.body).into_owned();
        match answer.status {
            401 => Err(Failure::Denied(Denied::NotAuthenticated)),
            403 => Err(Failure::Denied(Denied::NotPermitted)),
            400 if message().contains("user name is empty") => {
                Err(Failure::Denied(Denied::NotAuthenticated))
            }
            _ => Ok(answer),
        }
    }

    fn post_once(
        &self,
        path: &str,
        body: &str,
        token: Option<&str>,
        deadline: Instant,
    ) -> Result<Answer, Failure> {
        let request = request_bytes(path, body, token);
        let count = self.endpoints.len();
        loop {
            let first = self.preferred.load(Ordering::Relaxed);
            for step in 0..count {
                let member = (first + step) % count;
                let Some(mut stream) = self.connection(member, deadline) else {
                    continue;
                };
                let sent_at = Instant::now();
                match write_request(&mut stream, &request, deadline) {
                    Ok(()) => {}
                    Err(0) => continue,
                    Err(_) => {
                        self.avoid(member);
                        return Err(Failure::Unanswered);
                    }
                }
                let mut reader = Reader::new(stream);
                return match reader.read_answer(deadline) {
                    Ok((status, body, reusable)) => {
                        self.preferred.store(member, Ordering::Relaxed);
                        if reusable {
                            self.put_idle(member, reader.stream);
                        }
                        Ok(Answer {
                            sent_at,
                            status,
                            body,
                        })
                    }
                    Err(error) => {
                        log::debug!("etcd {}: no answer: {error}", self.endpoints[member]);
                        self.avoid(member);
                        Err(Failure::Unanswered)
                    }
                };
            }
            // No member took a byte this round: pause, then go round again.
            let Some(left) = remaining(deadline) else {
                return Err(Failure::Unsent);
            };
            std::thread::sleep(left.min(ROUND_PAUSE));
        }
    }

    /// After `member` left a request unanswered, the next request starts
    /// with the member after it: a member that accepts and then stays
    /// silent (partitioned, overloaded) must not keep every call.
    fn avoid(&self, member: usize) {
        let next = (member + 1) % self.endpoints.len();
        let _ = self
            .preferred
            .compare_exchange(member, next, Ordering::Relaxed, Ordering::Relaxed);
    }

    /// Opens a streaming request on a fresh connection (a watch): returns
    /// the reader positioned at the body, after the `200` head. Any failure
    /// is `None`: the caller retries (a watch changes nothing).
    pub(crate) fn open_stream(&self, path: &str, body: &str, deadline: Instant) -> Option<Stream> {
        let token = self.token(deadline).ok()?;
        let request = request_bytes(path, body, token.as_deref());
        let count = self.endpoints.len();
        let first = self.preferred.load(Ordering::Relaxed);
        for step in 0..count {
            let member = (first + step) % count;
            let Some(mut stream) = self.connect(member, deadline) else {
                continue;
            };
            if write_request(&mut stream, &request, deadline).is_err() {
                continue;
            }
            let mut reader = Reader::new(stream);
            match reader.read_head(deadline) {
                Ok(head) if head.status == 200 && head.chunked => {
                    return Some(Stream {
                        reader,
                        chunk_left: 0,
                        need_crlf: false,
                        done: false,
                        lines: Vec::new(),
                    });
                }
                Ok(head) => log::debug!("etcd watch: status {}", head.status),
                Err(error) => {
                    log::debug!("etcd watch: {error}");
                    self.avoid(member);
                }
            }
        }
        None
    }

    /// An idle connection to `member` that the peer has not closed, or a
    /// new one.
    fn connection(&self, member: usize, deadline: Instant) -> Option<Conn> {
        loop {
            let idle = self.idle[member]
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .pop();
            match idle {
                Some(stream) if still_open(&stream) => return Some(stream),
                Some(_) => continue,
                None => return self.connect(member, deadline),
            }
        }
    }

    fn connect(&self, member: usize, deadline: Instant) -> Option<Conn> {
        let endpoint = &self.endpoints[member];
        let addresses: Vec<SocketAddr> = match endpoint.to_socket_addrs() {
            Ok(addresses) => addresses.collect(),
            Err(error) => {
                log::debug!("etcd {endpoint}: {error}");
                return None;
            }
        };
        for address in addresses {
            let limit = remaining(deadline)?.min(self.connect_timeout);
            match TcpStream::connect_timeout(&address, limit) {
                Ok(stream) => {
                    let _ = stream.set_nodelay(true);
                    return self.start_session(endpoint, stream);
                }
                Err(error) => log::debug!("etcd {endpoint} ({address}): {error}"),
            }
        }
        None
    }

    /// The connection over `stream`: with TLS, a session whose handshake
    /// runs within the first write.
    fn start_session(&self, endpoint: &str, stream: TcpStream) -> Option<Conn> {
        #[cfg(feature = "tls")]
        if let Some(config) = &self.tls {
            let name = match crate::tls::server_name(endpoint) {
                Ok(name) => name,
                Err(error) => {
                    log::warn!("etcd {endpoint}: {error}");
                    return None;
                }
            };
            return match rustls::ClientConnection::new(config.clone(), name) {
                Ok(session) => Some(Conn::Tls(Box::new(rustls::StreamOwned::new(
                    session, stream,
                )))),
                Err(error) => {
                    log::warn!("etcd {endpoint}: TLS: {error}");
                    None
                }
            };
        }
        let _ = endpoint;
        Some(Conn::Tcp(stream))
    }

    fn put_idle(&self, member: usize, stream: Conn) {
        let mut idle = self.idle[member]
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if idle.len() < IDLE_PER_MEMBER {
            idle.push(stream);
        }
    }
}

fn request_bytes(path: &str, body: &str, token: Option<&str>) -> Vec<u8> {
    let authorization = match token {
        // etcd's tokens are printable ASCII; anything else is not sent.
        Some(token) if token.bytes().all(|b| b.is_ascii_graphic()) => {
            format!("Authorization: {token}\r\n")
        }
        _ => String::new(),
    };
    format!(
        "POST {path} HTTP/1.1\r\nHost: etcd\r\nContent-Type: application/json\r\n\
         {authorization}Content-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// `text` as a JSON string.
fn json_text(text: &str) -> String {
    super::json::JsonValue::String(text.to_owned())
        .stringify()
        .unwrap_or_else(|_| "\"\"".to_owned())
}

/// Whether an idle connection is still usable: nothing to read and not
/// closed by the peer.
fn still_open(stream: &Conn) -> bool {
    let stream = stream.tcp();
    if stream.set_nonblocking(true).is_err() {
        return false;
    }
    let mut probe = [0u8; 1];
    let open =
        matches!(stream.peek(&mut probe), Err(error) if error.kind() == io::ErrorKind::WouldBlock);
    open && stream.set_nonblocking(false).is_ok()
}

/// Writes the whole request by `deadline`; on failure, how many bytes the
/// socket had taken (0: certainly not sent).
fn write_request(stream: &mut Conn, request: &[u8], deadline: Instant) -> Result<(), usize> {
    let mut written = 0;
    while written < request.len() {
        let Some(left) = remaining(deadline) else {
            return Err(written);
        };
        if stream.set_timeout(left).is_err() {
            return Err(written);
        }
        match stream.write(&request[written..]) {
            Ok(0) => return Err(written),
            Ok(n) => written += n,
            Err(error) if error.kind() == io::ErrorKind::Interrupted => {}
            Err(error) => {
                if written == 0 {
                    log_tls_failure(&error);
                }
                return Err(written);
            }
        }
    }
    // With TLS, records the socket did not take yet.
    stream.flush().map_err(|_| written)
}

/// A TLS failure says what is wrong with the member's certificate or
/// ours: worth a warning, since retrying will not change it.
fn log_tls_failure(error: &io::Error) {
    #[cfg(feature = "tls")]
    if let Some(failure) = crate::tls::failure(error) {
        log::warn!("etcd: TLS: {failure:?}");
    }
    let _ = error;
}

struct Head {
    status: u16,
    chunked: bool,
    content_length: Option<usize>,
    keep_alive: bool,
}

/// A connection and the bytes read from it but not yet used.
pub(crate) struct Reader {
    stream: Conn,
    buf: Vec<u8>,
}

impl Reader {
    fn new(stream: Conn) -> Reader {
        Reader {
            stream,
            buf: Vec::new(),
        }
    }

    /// Reads more bytes into `buf` by `deadline`; end of stream is an error.
    fn fill(&mut self, deadline: Instant) -> io::Result<()> {
        let left = remaining(deadline).ok_or_else(timed_out)?;
        self.stream.set_timeout(left)?;
        let mut chunk = [0u8; 8192];
        loop {
            match self.stream.read(&mut chunk) {
                Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
                Ok(n) => {
                    self.buf.extend_from_slice(&chunk[..n]);
                    return Ok(());
                }
                Err(error) if error.kind() == io::ErrorKind::Interrupted => {}
                Err(error) => return Err(error),
            }
        }
    }

    fn read_head(&mut self, deadline: Instant) -> io::Result<Head> {
        loop {
            let mut headers = [httparse::EMPTY_HEADER; 32];
            let mut response = httparse::Response::new(&mut headers);
            match response.parse(&self.buf) {
                Ok(httparse::Status::Complete(length)) => {
                    let status = response.code.ok_or_else(|| invalid("no status"))?;
                    let mut head = Head {
                        status,
                        chunked: false,
                        content_length: None,
                        keep_alive: response.version == Some(1),
                    };
                    for header in response.headers.iter() {
                        let value = std::str::from_utf8(header.value).unwrap_or("").trim();
                        if header.name.eq_ignore_ascii_case("transfer-encoding") {
                            head.chunked = value.eq_ignore_ascii_case("chunked");
                        } else if header.name.eq_ignore_ascii_case("content-length") {
                            let length = value.parse().map_err(|_| invalid("content-length"))?;
                            head.content_length = Some(length);
                        } else if header.name.eq_ignore_ascii_case("connection")
                            && value.eq_ignore_ascii_case("close")
                        {
                            head.keep_alive = false;
                        }
                    }
                    self.buf.drain(..length);
                    return Ok(head);
                }
                Ok(httparse::Status::Partial) if self.buf.len() < HEAD_MAX => {
                    self.fill(deadline)?
                }
                Ok(httparse::Status::Partial) => return Err(invalid("response head too long")),
                Err(_) => return Err(invalid("malformed response head")),
            }
        }
    }

    /// A whole answer: status, body, and whether the connection may be
    /// used again.
    fn read_answer(&mut self, deadline: Instant) -> io::Result<(u16, Vec<u8>, bool)> {
        let head = self.read_head(deadline)?;
        let body = if head.chunked {
            let mut body = Vec::new();
            loop {
                let size = self.chunk_size(deadline)?;
                if size == 0 {
                    // The last chunk: its (empty) trailer ends with a blank line.
                    self.line(deadline)?;
                    break;
                }
                if size > BODY_MAX.saturating_sub(body.len()) {
                    return Err(invalid("response body too long"));
                }
                self.take(size, &mut body, deadline)?;
                self.expect_crlf(deadline)?;
            }
            body
        } else if let Some(length) = head.content_length {
            if length > BODY_MAX {
                return Err(invalid("response body too long"));
            }
            let mut body = Vec::with_capacity(length);
            self.take(length, &mut body, deadline)?;
            body
        } else {
            return Err(invalid("response without length"));
        };
        let reusable = head.keep_alive && self.buf.is_empty();
        Ok((head.status, body, reusable))
    }

    /// Moves `count` bytes of the stream into `out`.
    fn take(&mut self, count: usize, out: &mut Vec<u8>, deadline: Instant) -> io::Result<()> {
        let mut left = count;
        while left > 0 {
            if self.buf.is_empty() {
                self.fill(deadline)?;
            }
            let n = left.min(self.buf.len());
            out.extend(self.buf.drain(..n));
            left -= n;
        }
        Ok(())
    }

    /// One line without its CRLF.
    fn line(&mut self, deadline: Instant) -> io::Result<Vec<u8>> {
        loop {
            if let Some(end) = self.buf.windows(2).position(|pair| pair == b"\r\n") {
                let line = self.buf[..end].to_vec();
                self.buf.drain(..end + 2);
                return Ok(line);
            }
            if self.buf.len() > HEAD_MAX {
                return Err(invalid("line too long"));
            }
            self.fill(deadline)?;
        }
    }

    fn chunk_size(&mut self, deadline: Instant) -> io::Result<usize> {
        let line = self.line(deadline)?;
        let text = std::str::from_utf8(&line).map_err(|_| invalid("chunk size"))?;
        let digits = text.split(';').next().unwrap_or("").trim();
        usize::from_str_radix(digits, 16).map_err(|_| invalid("chunk size"))
    }

    fn expect_crlf(&mut self, deadline: Instant) -> io::Result<()> {
        if self.line(deadline)?.is_empty() {
            Ok(())
        } else {
            Err(invalid("chunk not followed by CRLF"))
        }
    }
}

/// The body of a streaming answer, one newline-delimited JSON message at a
/// time.
pub(crate) struct Stream {
    reader: Reader,
    /// Bytes left in the current chunk.
    chunk_left: usize,
    /// A chunk's data was read but not the CRLF after it.
    need_crlf: bool,
    done: bool,
    /// Body bytes not yet returned as a message.
    lines: Vec<u8>,
}

impl Stream {
    /// The next message, or `Ok(None)` when `until` passes first. Errors:
    /// the stream ended or broke.
    pub(crate) fn next_message(&mut self, until: Instant) -> io::Result<Option<Vec<u8>>> {
        loop {
            if let Some(end) = self.lines.iter().position(|&byte| byte == b'\n') {
                let message: Vec<u8> = self.lines.drain(..=end).collect();
                return Ok(Some(message));
            }
            if self.lines.len() > BODY_MAX {
                return Err(invalid("stream message too long"));
            }
            if self.done {
                return Err(io::ErrorKind::UnexpectedEof.into());
            }
            match self.read_body(until) {
                Ok(()) => {}
                Err(error)
                    if matches!(
                        error.kind(),
                        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                    ) && Instant::now() >= until =>
                {
                    return Ok(None);
                }
                Err(error) => return Err(error),
            }
        }
    }

    /// Moves some body bytes into `lines`.
    fn read_body(&mut self, until: Instant) -> io::Result<()> {
        if self.need_crlf {
            self.reader.expect_crlf(until)?;
            self.need_crlf = false;
        }
        if self.chunk_left == 0 {
            let size = self.reader.chunk_size(until)?;
            if size == 0 {
                self.done = true;
                return Ok(());
            }
            self.chunk_left = size;
        }
        if self.reader.buf.is_empty() {
            self.reader.fill(until)?;
        }
        let n = self.chunk_left.min(self.reader.buf.len());
        self.lines.extend(self.reader.buf.drain(..n));
        self.chunk_left -= n;
        self.need_crlf = self.chunk_left == 0;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;
    use std::sync::Arc;
    use std::sync::atomic::AtomicUsize;

    /// A one-trick member: reads one request per connection and writes
    /// `answer` (or closes when it is empty); counts the requests.
    fn member(answer: &'static [u8]) -> (String, Arc<AtomicUsize>) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let address = listener.local_addr().unwrap().to_string();
        let requests = Arc::new(AtomicUsize::new(0));
        let counted = requests.clone();
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(mut stream) = stream else { return };
                let mut buf = [0u8; 4096];
                if stream.read(&mut buf).unwrap_or(0) > 0 {
                    counted.fetch_add(1, Ordering::SeqCst);
                    // Split the answer to exercise incremental parsing.
                    for piece in answer.chunks(7) {
                        let _ = stream.write_all(piece);
                        std::thread::sleep(Duration::from_millis(1));
                    }
                }
            }
        });
        (address, requests)
    }

    fn refused() -> String {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        listener.local_addr().unwrap().to_string()
    }

    #[test]
    fn an_unsent_request_moves_on_and_a_sent_one_is_never_resent() {
        let chunked: &[u8] = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n\
            5\r\n{\"a\":\r\n4\r\n\"b\"}\r\n0\r\n\r\n";
        let (good, good_requests) = member(chunked);
        let members = Members::new(vec![refused(), good], Duration::from_secs(1), None);
        let deadline = Instant::now() + Duration::from_secs(5);
        let answer = members.post("/v3/x", "{}", deadline).ok().unwrap();
        assert_eq!(
            (answer.status, &answer.body[..]),
            (200, &b"{\"a\":\"b\"}"[..])
        );
        assert_eq!(good_requests.load(Ordering::SeqCst), 1);

        // A member that takes the request and closes: possibly sent, so
        // the good member behind it never sees it.
        let (closing, closing_requests) = member(b"");
        let (good, good_requests) = member(chunked);
        let members = Members::new(vec![closing, good], Duration::from_secs(1), None);
        let failure = members.post("/v3/x", "{}", deadline).err();
        assert_eq!(failure, Some(Failure::Unanswered));
        assert_eq!(closing_requests.load(Ordering::SeqCst), 1);
        assert_eq!(good_requests.load(Ordering::SeqCst), 0);

        // Nobody reachable: unsent at the deadline.
        let members = Members::new(vec![refused()], Duration::from_secs(1), None);
        let started = Instant::now();
        let soon = started + Duration::from_millis(200);
        assert_eq!(
            members.post("/v3/x", "{}", soon).err(),
            Some(Failure::Unsent)
        );
        assert!(started.elapsed() < Duration::from_secs(1));
    }

    #[test]
    fn malformed_answers_are_unanswered_never_a_panic() {
        let deadline = Instant::now() + Duration::from_secs(5);
        for garbage in [
            &b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n"[..],
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nffffffffffffffff\r\n",
            b"HTTP/1.1 200 OK\r\nContent-Length: 99999999999\r\n\r\n",
            b"HTTP/1.1 200 OK\r\n\r\n{}",
            b"\x00\x01 not http\r\n\r\n",
        ] {
            let (address, _) = member(garbage);
            let members = Members::new(vec![address], Duration::from_secs(1), None);
            let failure = members.post("/v3/x", "{}", deadline).err();
            assert_eq!(failure, Some(Failure::Unanswered), "{garbage:?}");
        }
    }
}
