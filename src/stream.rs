//! One non-blocking stream type for TCP and Unix sockets, and TLS over TCP
//! on the client side, shared by the server's shell, the client's I/O
//! thread and the bench.

use std::io::{self, Read, Write};
use std::net::Shutdown;

use mio::event::Source;
use mio::net::{TcpStream, UnixStream};
use mio::{Interest, Registry, Token};

/// A connected TCP or Unix stream, registrable with `mio`.
pub enum Stream {
    Tcp(TcpStream),
    Unix(UnixStream),
    /// A TLS client session over TCP. Records the socket did not take stay
    /// in the session: call [`flush`](Write::flush) when the socket turns
    /// writable.
    #[cfg(feature = "tls")]
    Tls(Box<TlsStream>),
}

/// A TLS client session and its socket.
#[cfg(feature = "tls")]
pub struct TlsStream {
    tcp: TcpStream,
    session: rustls::ClientConnection,
}

#[cfg(feature = "tls")]
impl Stream {
    /// Starts a TLS session on `tcp` (connected or connecting), checking
    /// the server's certificate against `server_name`.
    pub fn tls(
        tcp: TcpStream,
        config: std::sync::Arc<rustls::ClientConfig>,
        server_name: rustls::pki_types::ServerName<'static>,
    ) -> io::Result<Stream> {
        let session = rustls::ClientConnection::new(config, server_name)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
        Ok(Stream::Tls(Box::new(TlsStream { tcp, session })))
    }
}

#[cfg(feature = "tls")]
impl TlsStream {
    /// Writes the records the session has queued until the socket would
    /// block (they stay queued) or none is left.
    fn push_records(&mut self) -> io::Result<()> {
        while self.session.wants_write() {
            match self.session.write_tls(&mut self.tcp) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        loop {
            match self.session.reader().read(buf) {
                Ok(n) => return Ok(n),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                // The server closed without close_notify: the end of the
                // stream all the same (frames delimit themselves).
                Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(0),
                Err(e) => return Err(e),
            }
            let eof = match self.session.read_tls(&mut self.tcp) {
                Ok(0) => true,
                Ok(_) => false,
                Err(e) => return Err(e),
            };
            if let Err(error) = self.session.process_new_packets() {
                // Our alert, if the session made one, tells the server why.
                let _ = self.push_records();
                return Err(io::Error::new(io::ErrorKind::InvalidData, error));
            }
            self.push_records()?;
            if eof {
                return match self.session.reader().read(buf) {
                    Ok(n) => Ok(n),
                    Err(_) => Ok(0),
                };
            }
        }
    }

    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.push_records()?;
        if self.session.wants_write() {
            // The socket is full: take no more plaintext until it drains.
            return Err(io::ErrorKind::WouldBlock.into());
        }
        let n = self.session.writer().write(buf)?;
        self.push_records()?;
        Ok(n)
    }
}

impl Stream {
    /// Half-closes the write side, so the peer reads the end of our output
    /// and then end-of-file.
    pub fn shutdown_write(&self) {
        let _ = match self {
            Stream::Tcp(stream) => stream.shutdown(Shutdown::Write),
            Stream::Unix(stream) => stream.shutdown(Shutdown::Write),
            #[cfg(feature = "tls")]
            Stream::Tls(tls) => tls.tcp.shutdown(Shutdown::Write),
        };
    }

    /// `Ok(true)` once a non-blocking connect has completed, `Ok(false)`
    /// while it is still in progress.
    pub fn connect_done(&self) -> io::Result<bool> {
        let (error, peer) = match self {
            Stream::Tcp(stream) => (stream.take_error()?, stream.peer_addr().map(|_| ())),
            Stream::Unix(stream) => (stream.take_error()?, stream.peer_addr().map(|_| ())),
            #[cfg(feature = "tls")]
            Stream::Tls(tls) => (tls.tcp.take_error()?, tls.tcp.peer_addr().map(|_| ())),
        };
        if let Some(error) = error {
            return Err(error);
        }
        match peer {
            Ok(()) => Ok(true),
            Err(error) if error.kind() == io::ErrorKind::NotConnected => Ok(false),
            Err(error) => Err(error),
        }
    }
}

impl Read for Stream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Stream::Tcp(stream) => stream.read(buf),
            Stream::Unix(stream) => stream.read(buf),
            #[cfg(feature = "tls")]
            Stream::Tls(tls) => tls.read(buf),
        }
    }
}

impl Write for Stream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Stream::Tcp(stream) => stream.write(buf),
            Stream::Unix(stream) => stream.write(buf),
            #[cfg(feature = "tls")]
            Stream::Tls(tls) => tls.write(buf),
        }
    }

    /// Writes what a TLS session still holds; nothing to do otherwise.
    fn flush(&mut self) -> io::Result<()> {
        match self {
            #[cfg(feature = "tls")]
            Stream::Tls(tls) => tls.push_records(),
            _ => Ok(()),
        }
    }
}

impl Source for Stream {
    fn register(
        &mut self,
        registry: &Registry,
        token: Token,
        interests: Interest,
    ) -> io::Result<()> {
        match self {
            Stream::Tcp(stream) => stream.register(registry, token, interests),
            Stream::Unix(stream) => stream.register(registry, token, interests),
            #[cfg(feature = "tls")]
            Stream::Tls(tls) => tls.tcp.register(registry, token, interests),
        }
    }

    fn reregister(
        &mut self,
        registry: &Registry,
        token: Token,
        interests: Interest,
    ) -> io::Result<()> {
        match self {
            Stream::Tcp(stream) => stream.reregister(registry, token, interests),
            Stream::Unix(stream) => stream.reregister(registry, token, interests),
            #[cfg(feature = "tls")]
            Stream::Tls(tls) => tls.tcp.reregister(registry, token, interests),
        }
    }

    fn deregister(&mut self, registry: &Registry) -> io::Result<()> {
        match self {
            Stream::Tcp(stream) => stream.deregister(registry),
            Stream::Unix(stream) => stream.deregister(registry),
            #[cfg(feature = "tls")]
            Stream::Tls(tls) => tls.tcp.deregister(registry),
        }
    }
}
