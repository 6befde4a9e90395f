//! Listening sockets (TCP and Unix) and the streams they accept.

use std::io;
use std::net::{SocketAddr, ToSocketAddrs};
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::{Path, PathBuf};

use mio::event::Source;
use mio::net::{TcpListener, UnixListener};
use mio::{Interest, Registry, Token};

use crate::addr::Address;
use crate::stream::Stream;

/// Idle time before the kernel probes a silent peer, and the probe
/// cadence: a peer that vanished without a FIN or RST is gone after about
/// `KEEPALIVE_IDLE + KEEPALIVE_RETRIES × KEEPALIVE_INTERVAL` (~90 s).
const KEEPALIVE_IDLE: std::time::Duration = std::time::Duration::from_secs(60);
const KEEPALIVE_INTERVAL: std::time::Duration = std::time::Duration::from_secs(10);
const KEEPALIVE_RETRIES: u32 = 3;

/// Implements mio's `Source` for an enum of sockets by handing each call
/// to the socket inside.
macro_rules! delegate_source {
    ($type:ty, $($variant:pat => $inner:ident),+) => {
        impl Source for $type {
            fn register(&mut self, registry: &Registry, token: Token, interests: Interest) -> io::Result<()> {
                match self {
                    $($variant => $inner.register(registry, token, interests),)+
                }
            }

            fn reregister(&mut self, registry: &Registry, token: Token, interests: Interest) -> io::Result<()> {
                match self {
                    $($variant => $inner.reregister(registry, token, interests),)+
                }
            }

            fn deregister(&mut self, registry: &Registry) -> io::Result<()> {
                match self {
                    $($variant => $inner.deregister(registry),)+
                }
            }
        }
    };
}

/// A bound listening socket.
pub enum Listener {
    Tcp(TcpListener),
    Unix {
        listener: UnixListener,
        path: PathBuf,
    },
}

/// What an accepted peer is.
#[derive(Clone, Copy, Debug)]
pub enum Peer {
    Tcp(SocketAddr),
    Unix,
}

impl Listener {
    /// Binds `address`. A TCP host name is resolved and the first address
    /// that binds is used. A `unix:` path left behind by a dead server is
    /// replaced; one a live server answers on is an error. The socket file
    /// gets `unix_mode` permissions.
    pub fn bind(address: &Address, unix_mode: u32) -> io::Result<Listener> {
        match address {
            Address::Tcp(host_port) | Address::Tls(host_port) => {
                let mut last_error = None;
                for socket_address in host_port.to_socket_addrs()? {
                    match bind_tcp(socket_address) {
                        Ok(listener) => return Ok(Listener::Tcp(listener)),
                        Err(error) => last_error = Some(error),
                    }
                }
                Err(last_error.unwrap_or_else(|| {
                    io::Error::new(
                        io::ErrorKind::InvalidInput,
                        format!("{host_port}: no address"),
                    )
                }))
            }
            Address::Unix(path) => {
                remove_stale_socket(path)?;
                let listener = UnixListener::bind(path)?;
                std::fs::set_permissions(path, std::fs::Permissions::from_mode(unix_mode))?;
                Ok(Listener::Unix {
                    listener,
                    path: path.clone(),
                })
            }
            Address::Etcd { .. } => Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "etcd:// is a client address; a server cannot listen on it",
            )),
        }
    }

    /// The address actually bound (with the real port when 0 was asked).
    pub fn local_address(&self) -> io::Result<Address> {
        match self {
            Listener::Tcp(listener) => Ok(Address::Tcp(listener.local_addr()?.to_string())),
            Listener::Unix { path, .. } => Ok(Address::Unix(path.clone())),
        }
    }

    /// Accepts one connection, configured for low latency and dead-peer
    /// detection.
    pub fn accept(&self) -> io::Result<(Stream, Peer)> {
        match self {
            Listener::Tcp(listener) => {
                let (stream, peer) = listener.accept()?;
                // Best effort: a socket that refuses an option still works.
                let _ = stream.set_nodelay(true);
                let keepalive = socket2::TcpKeepalive::new()
                    .with_time(KEEPALIVE_IDLE)
                    .with_interval(KEEPALIVE_INTERVAL)
                    .with_retries(KEEPALIVE_RETRIES);
                let _ = socket2::SockRef::from(&stream).set_tcp_keepalive(&keepalive);
                Ok((Stream::Tcp(stream), Peer::Tcp(peer)))
            }
            Listener::Unix { listener, .. } => {
                let (stream, _) = listener.accept()?;
                Ok((Stream::Unix(stream), Peer::Unix))
            }
        }
    }

    /// Removes the socket file of a Unix listener.
    pub fn remove_file(&self) {
        if let Listener::Unix { path, .. } = self {
            let _ = std::fs::remove_file(path);
        }
    }
}

/// How many connections the kernel may hold ready for `accept` (capped by
/// `net.core.somaxconn`). std's and mio's 128 drops SYNs when thousands of
/// clients connect at once — a fleet reconnecting after a restart — and
/// each drop costs that client a 1 s retransmission.
const LISTEN_BACKLOG: i32 = 4096;

/// Binds a TCP listener as mio does (`SO_REUSEADDR`, non-blocking), with
/// [`LISTEN_BACKLOG`].
fn bind_tcp(address: SocketAddr) -> io::Result<TcpListener> {
    let socket = socket2::Socket::new(
        socket2::Domain::for_address(address),
        socket2::Type::STREAM,
        Some(socket2::Protocol::TCP),
    )?;
    socket.set_reuse_address(true)?;
    socket.set_nonblocking(true)?;
    socket.bind(&address.into())?;
    socket.listen(LISTEN_BACKLOG)?;
    Ok(TcpListener::from_std(socket.into()))
}

/// Removes `path` if it is a socket nobody listens on.
fn remove_stale_socket(path: &Path) -> io::Result<()> {
    let Ok(metadata) = std::fs::symlink_metadata(path) else {
        return Ok(());
    };
    if !metadata.file_type().is_socket() {
        return Err(io::Error::new(
            io::ErrorKind::AlreadyExists,
            format!("{} exists and is not a socket", path.display()),
        ));
    }
    match std::os::unix::net::UnixStream::connect(path) {
        Ok(_) => Err(io::Error::new(
            io::ErrorKind::AddrInUse,
            format!("{}: a server is already listening", path.display()),
        )),
        Err(_) => std::fs::remove_file(path),
    }
}

delegate_source!(Listener, Listener::Tcp(listener) => listener, Listener::Unix { listener, .. } => listener);
