//! One bounded HTTP/1.x exchange on the metrics listener, sans IO.
//!
//! A scraper connects, sends one small `GET /metrics`, reads the answer,
//! and the connection closes. Everything a peer can send is bounded: the
//! request head may be at most [`REQUEST_MAX`] bytes with at most
//! [`HEADERS_MAX`] headers, and the whole exchange must finish within
//! [`EXCHANGE_TIMEOUT`]; the shell closes the connection at
//! [`Exchange::deadline`]. Parsing is `httparse`'s; nothing here panics on
//! any input.

use std::time::Duration;

use crate::core::Micros;

/// The largest request head accepted (a Prometheus scrape sends ~250 B).
pub const REQUEST_MAX: usize = 4096;
/// The most headers a request may carry.
pub const HEADERS_MAX: usize = 32;
/// How long one exchange may take, from accept to the last byte written:
/// a scrape on loopback or a LAN takes milliseconds, and a peer that
/// half-sends its request holds a slot no longer than this (issue 38).
pub const EXCHANGE_TIMEOUT: Duration = Duration::from_secs(2);
/// The path the metrics are served on.
pub const METRICS_PATH: &str = "/metrics";

/// One connection's request and response.
#[derive(Debug)]
pub struct Exchange {
    input: Vec<u8>,
    output: Vec<u8>,
    sent: usize,
    deadline: Micros,
    answered: bool,
    /// The peer went away before a whole request arrived.
    abandoned: bool,
}

/// What the request asked for, once its head is complete.
#[derive(Debug, PartialEq, Eq)]
enum Answer {
    /// `GET /metrics` (`head`: `HEAD`, no body).
    Metrics {
        head: bool,
    },
    Error(Status),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Status {
    BadRequest,
    NotFound,
    MethodNotAllowed,
    HeadersTooLarge,
}

impl Status {
    fn line(self) -> &'static str {
        match self {
            Status::BadRequest => "400 Bad Request",
            Status::NotFound => "404 Not Found",
            Status::MethodNotAllowed => "405 Method Not Allowed",
            Status::HeadersTooLarge => "431 Request Header Fields Too Large",
        }
    }

    fn body(self) -> &'static str {
        match self {
            Status::BadRequest => "kunci: not an HTTP request\n",
            Status::NotFound => "kunci: the metrics are at /metrics\n",
            Status::MethodNotAllowed => "kunci: only GET /metrics is served here\n",
            Status::HeadersTooLarge => "kunci: request head too large\n",
        }
    }
}

impl Exchange {
    /// An exchange on a connection accepted at `now`.
    pub fn new(now: Micros) -> Exchange {
        Exchange {
            input: Vec::new(),
            output: Vec::new(),
            sent: 0,
            deadline: now + EXCHANGE_TIMEOUT.as_micros() as Micros,
            answered: false,
            abandoned: false,
        }
    }

    /// When the shell must close the connection, finished or not.
    pub fn deadline(&self) -> Micros {
        self.deadline
    }

    /// Whether more request bytes are wanted.
    pub fn wants_input(&self) -> bool {
        !self.answered && !self.abandoned
    }

    /// Takes bytes the peer sent. Once the request head is complete (or
    /// broken, or too large) the response is ready in [`output`]
    /// (Self::output); `render` writes the metrics body when the request
    /// is a scrape. Bytes after the head are ignored.
    pub fn receive(&mut self, bytes: &[u8], render: impl FnOnce(&mut String)) {
        if !self.wants_input() {
            return;
        }
        let room = REQUEST_MAX.saturating_sub(self.input.len());
        self.input
            .extend_from_slice(&bytes[..bytes.len().min(room)]);
        let answer = match parse(&self.input) {
            Some(answer) => answer,
            None if self.input.len() >= REQUEST_MAX => Answer::Error(Status::HeadersTooLarge),
            None => return,
        };
        self.answered = true;
        self.input = Vec::new();
        match answer {
            Answer::Metrics { head } => {
                let mut body = String::new();
                render(&mut body);
                self.respond("200 OK", super::CONTENT_TYPE, &body, head);
            }
            Answer::Error(status) => self.respond(
                status.line(),
                "text/plain; charset=utf-8",
                status.body(),
                false,
            ),
        }
    }

    /// The peer closed its side. Before a whole request that ends the
    /// exchange; after one the response is still written.
    pub fn peer_closed(&mut self) {
        if !self.answered {
            self.abandoned = true;
        }
    }

    /// Response bytes not yet handed to the socket.
    pub fn output(&self) -> &[u8] {
        self.output.get(self.sent..).unwrap_or(&[])
    }

    /// The socket took `written` bytes of [`output`](Self::output).
    pub fn advance(&mut self, written: usize) {
        self.sent = (self.sent + written).min(self.output.len());
    }

    /// Whether nothing is left to do: the response is written, or the peer
    /// left without asking.
    pub fn is_finished(&self) -> bool {
        self.abandoned || (self.answered && self.output().is_empty())
    }

    fn respond(&mut self, status: &str, content_type: &str, body: &str, head_only: bool) {
        use std::fmt::Write as _;
        let mut text = String::with_capacity(160 + body.len());
        let _ = write!(
            text,
            "HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\n\
             Connection: close\r\n",
            body.len()
        );
        if status.starts_with("405") {
            text.push_str("Allow: GET, HEAD\r\n");
        }
        text.push_str("\r\n");
        if !head_only {
            text.push_str(body);
        }
        self.output = text.into_bytes();
        self.sent = 0;
    }
}

/// The answer to a complete request head, or `None` while it is partial.
fn parse(input: &[u8]) -> Option<Answer> {
    let mut headers = [httparse::EMPTY_HEADER; HEADERS_MAX];
    let mut request = httparse::Request::new(&mut headers);
    match request.parse(input) {
        Ok(httparse::Status::Partial) => None,
        Ok(httparse::Status::Complete(_)) => Some(route(request.method, request.path)),
        Err(httparse::Error::TooManyHeaders) => Some(Answer::Error(Status::HeadersTooLarge)),
        Err(_) => Some(Answer::Error(Status::BadRequest)),
    }
}

fn route(method: Option<&str>, path: Option<&str>) -> Answer {
    let path = path.unwrap_or("");
    let path = path.split_once('?').map_or(path, |(path, _query)| path);
    let head = match method {
        Some("GET") => false,
        Some("HEAD") => true,
        _ => return Answer::Error(Status::MethodNotAllowed),
    };
    if path == METRICS_PATH {
        Answer::Metrics { head }
    } else {
        Answer::Error(Status::NotFound)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SCRAPE: &[u8] = b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1:9100\r\n\
        User-Agent: Prometheus/2.42.0\r\nAccept: text/plain;version=0.0.4;q=0.5,*/*;q=0.1\r\n\
        X-Prometheus-Scrape-Timeout-Seconds: 10\r\n\r\n";

    fn body(out: &mut String) {
        out.push_str("kunci_locks_held 0\n");
    }

    fn response(exchange: &Exchange) -> String {
        String::from_utf8(exchange.output().to_vec()).expect("ASCII")
    }

    #[test]
    fn a_scrape_split_anywhere_gets_the_metrics_once() {
        for split in 0..=SCRAPE.len() {
            let mut exchange = Exchange::new(7);
            let mut renders = 0;
            exchange.receive(&SCRAPE[..split], |out| {
                renders += 1;
                body(out)
            });
            exchange.receive(&SCRAPE[split..], |out| {
                renders += 1;
                body(out)
            });
            assert_eq!(renders, 1, "split at {split}");
            assert_eq!(
                response(&exchange),
                "HTTP/1.1 200 OK\r\n\
                 Content-Type: text/plain; version=0.0.4; charset=utf-8\r\n\
                 Content-Length: 19\r\nConnection: close\r\n\r\n\
                 kunci_locks_held 0\n"
            );
            assert!(!exchange.wants_input());
        }
    }

    #[test]
    fn output_is_consumed_as_the_socket_takes_it() {
        let mut exchange = Exchange::new(0);
        exchange.receive(b"GET /metrics?x=1 HTTP/1.0\r\n\r\n", body);
        let total = exchange.output().len();
        exchange.advance(10);
        assert_eq!(exchange.output().len(), total - 10);
        assert!(!exchange.is_finished());
        exchange.peer_closed();
        assert!(!exchange.is_finished(), "a half-closed scraper still reads");
        exchange.advance(total);
        assert!(exchange.output().is_empty());
        assert!(exchange.is_finished());
    }

    #[test]
    fn head_gets_the_headers_only() {
        let mut exchange = Exchange::new(0);
        exchange.receive(b"HEAD /metrics HTTP/1.1\r\n\r\n", body);
        assert_eq!(
            response(&exchange),
            "HTTP/1.1 200 OK\r\n\
             Content-Type: text/plain; version=0.0.4; charset=utf-8\r\n\
             Content-Length: 19\r\nConnection: close\r\n\r\n"
        );
    }

    #[test]
    fn anything_else_gets_a_short_error_and_no_render() {
        let cases: [(&[u8], &str); 5] = [
            (b"GET / HTTP/1.1\r\n\r\n", "404 Not Found"),
            (b"POST /metrics HTTP/1.1\r\n\r\n", "405 Method Not Allowed"),
            (b"\x00\x01garbage\r\n\r\n", "400 Bad Request"),
            (
                b"A\x00\x00\x00\x00\x00\x00\x00\x01\x00key\n",
                "400 Bad Request",
            ),
            (b"GET /metrics HTTP/9.9\r\n\r\n", "400 Bad Request"),
        ];
        for (request, status) in cases {
            let mut exchange = Exchange::new(0);
            exchange.receive(request, |_| panic!("rendered for {request:?}"));
            let text = response(&exchange);
            assert!(
                text.starts_with(&format!("HTTP/1.1 {status}\r\n")),
                "{request:?}: {text}"
            );
            assert!(text.contains("Connection: close\r\n"));
            assert!(text.ends_with("\n"));
        }
    }

    #[test]
    fn a_head_too_large_or_with_too_many_headers_is_refused() {
        let mut exchange = Exchange::new(0);
        let mut endless = b"GET /metrics HTTP/1.1\r\nX: ".to_vec();
        endless.resize(REQUEST_MAX + 1000, b'a');
        for chunk in endless.chunks(700) {
            exchange.receive(chunk, |_| panic!("rendered"));
        }
        assert!(response(&exchange).starts_with("HTTP/1.1 431 "));

        let mut many = b"GET /metrics HTTP/1.1\r\n".to_vec();
        for i in 0..=HEADERS_MAX {
            many.extend_from_slice(format!("X-{i}: y\r\n").as_bytes());
        }
        many.extend_from_slice(b"\r\n");
        let mut exchange = Exchange::new(0);
        exchange.receive(&many, |_| panic!("rendered"));
        assert!(response(&exchange).starts_with("HTTP/1.1 431 "));
    }

    #[test]
    fn a_peer_that_leaves_before_asking_finishes_the_exchange() {
        let mut exchange = Exchange::new(0);
        exchange.receive(b"GET /met", body);
        assert!(exchange.wants_input());
        exchange.peer_closed();
        assert!(exchange.is_finished());
        assert!(exchange.output().is_empty());
    }

    #[test]
    fn the_deadline_is_two_seconds_after_accept() {
        assert_eq!(Exchange::new(1_000).deadline(), 2_001_000);
    }
}
