//! One non-blocking stream type for TCP and Unix sockets, shared by the
//! server's shell, the client's I/O thread and the bench.

use std::io::{self, Read, Write};
use std::net::Shutdown;

use mio::event::Source;
use mio::net::{TcpStream, UnixStream};
use mio::{Interest, Registry, Token};

/// A connected TCP or Unix stream, registrable with `mio`.
pub enum Stream {
    Tcp(TcpStream),
    Unix(UnixStream),
}

impl Stream {
    /// Half-closes the write side, so the peer reads the end of our output
    /// and then end-of-file.
    pub fn shutdown_write(&self) {
        let _ = match self {
            Stream::Tcp(stream) => stream.shutdown(Shutdown::Write),
            Stream::Unix(stream) => stream.shutdown(Shutdown::Write),
        };
    }

    /// `Ok(true)` once a non-blocking connect has completed, `Ok(false)`
    /// while it is still in progress.
    pub fn connect_done(&self) -> io::Result<bool> {
        let (error, peer) = match self {
            Stream::Tcp(stream) => (stream.take_error()?, stream.peer_addr().map(|_| ())),
            Stream::Unix(stream) => (stream.take_error()?, stream.peer_addr().map(|_| ())),
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
        }
    }
}

impl Write for Stream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Stream::Tcp(stream) => stream.write(buf),
            Stream::Unix(stream) => stream.write(buf),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
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
        }
    }

    fn deregister(&mut self, registry: &Registry) -> io::Result<()> {
        match self {
            Stream::Tcp(stream) => stream.deregister(registry),
            Stream::Unix(stream) => stream.deregister(registry),
        }
    }
}
