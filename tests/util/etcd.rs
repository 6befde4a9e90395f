//! A real etcd cluster on loopback for the `etcd://` tests: members with
//! temporary data directories and free ports, killed when dropped; and a
//! TCP proxy that passes a number of HTTP requests, then blackholes.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kunci::client::{Client, Config};

use super::TempDir;

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .map(|address| address.port())
        .expect("a free port")
}

pub struct Member {
    pub name: String,
    /// `127.0.0.1:PORT` of its client (gateway) listener.
    pub client: String,
    child: Option<Child>,
    /// How it was started, to start it again ([`Cluster::restart`]).
    command: Vec<std::ffi::OsString>,
    log: std::path::PathBuf,
}

impl Member {
    fn spawn(&mut self) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .expect("log");
        let child = Command::new("etcd")
            .args(&self.command)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("spawn etcd");
        self.child = Some(child);
    }
}

/// An etcd cluster of loopback members; every member is killed and the
/// data removed when dropped.
pub struct Cluster {
    pub members: Vec<Member>,
    _dir: TempDir,
}

impl Cluster {
    /// Starts `size` members with a short heartbeat (50 ms) and election
    /// timeout (500 ms), so that a leader change takes well under a second,
    /// and waits until the cluster takes writes.
    pub fn start(size: usize) -> Cluster {
        Cluster::start_with(size, &[])
    }

    /// As [`start`](Self::start), each member with `extra` flags too.
    pub fn start_with(size: usize, extra: &[&str]) -> Cluster {
        let dir = TempDir::new("etcd");
        let peers: Vec<(String, u16, u16)> = (0..size)
            .map(|i| (format!("m{i}"), free_port(), free_port()))
            .collect();
        let initial: Vec<String> = peers
            .iter()
            .map(|(name, _, peer)| format!("{name}=http://127.0.0.1:{peer}"))
            .collect();
        let initial = initial.join(",");
        let token = format!("kunci-{}", peers[0].2);
        let members = peers
            .iter()
            .map(|(name, client, peer)| {
                let client_url = format!("http://127.0.0.1:{client}");
                let peer_url = format!("http://127.0.0.1:{peer}");
                let mut command: Vec<std::ffi::OsString> =
                    ["--name", name, "--data-dir"].map(Into::into).into();
                command.push(dir.join(name).into());
                command.extend(
                    [
                        "--listen-client-urls",
                        &client_url,
                        "--advertise-client-urls",
                        &client_url,
                        "--listen-peer-urls",
                        &peer_url,
                        "--initial-advertise-peer-urls",
                        &peer_url,
                        "--initial-cluster",
                        &initial,
                        "--initial-cluster-state",
                        "new",
                        "--initial-cluster-token",
                        &token,
                        "--heartbeat-interval",
                        "50",
                        "--election-timeout",
                        "500",
                    ]
                    .iter()
                    .chain(extra)
                    .map(Into::into),
                );
                let mut member = Member {
                    name: name.clone(),
                    client: format!("127.0.0.1:{client}"),
                    child: None,
                    command,
                    log: dir.join(&format!("{name}.log")),
                };
                member.spawn();
                member
            })
            .collect();
        let cluster = Cluster { members, _dir: dir };
        cluster.wait_ready();
        cluster
    }

    /// `etcd://` with every member.
    pub fn address(&self) -> String {
        let endpoints: Vec<&str> = self.members.iter().map(|m| m.client.as_str()).collect();
        format!("etcd://{}", endpoints.join(","))
    }

    pub fn client(&self) -> Client {
        Client::new([self.address().parse().unwrap()], Config::default()).unwrap()
    }

    fn wait_ready(&self) {
        let client = self.client();
        let give_up = Instant::now() + Duration::from_secs(30);
        loop {
            let ready = client
                .acquire("warm-up", Duration::ZERO, Duration::from_secs(1))
                .and_then(|ticket| ticket.release());
            if ready.is_ok() {
                return;
            }
            assert!(Instant::now() < give_up, "etcd did not start: {ready:?}");
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// The index of the member that leads, as the members report it.
    pub fn leader(&self) -> usize {
        let give_up = Instant::now() + Duration::from_secs(10);
        loop {
            for (index, member) in self.members.iter().enumerate() {
                if member.child.is_none() {
                    continue;
                }
                if let Some(status) = post(&member.client, "/v3/maintenance/status", "{}")
                    && let (Some(leader), Some(me)) =
                        (field(&status, "leader"), field(&status, "member_id"))
                    && leader == me
                {
                    return index;
                }
            }
            assert!(Instant::now() < give_up, "no leader");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// `kill -9` of one member.
    pub fn kill(&mut self, index: usize) {
        if let Some(mut child) = self.members[index].child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts a killed member again on its data (the same flags: etcd
    /// ignores the initial-cluster ones when its data directory has a
    /// member) and waits until the cluster takes writes.
    pub fn restart(&mut self, index: usize) {
        assert!(self.members[index].child.is_none(), "kill it first");
        self.members[index].spawn();
        self.wait_ready();
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for index in 0..self.members.len() {
            self.kill(index);
        }
    }
}

/// One JSON request to a member; the body, or `None`.
pub fn post(member: &str, path: &str, body: &str) -> Option<String> {
    let mut stream = TcpStream::connect(member).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    write!(
        stream,
        "POST {path} HTTP/1.1\r\nHost: etcd\r\nConnection: close\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .ok()?;
    let mut answer = String::new();
    stream.read_to_string(&mut answer).ok()?;
    answer
        .split_once("\r\n\r\n")
        .map(|(_, body)| body.to_owned())
}

/// The string value of `"name":"…"` in a JSON text.
fn field(json: &str, name: &str) -> Option<String> {
    let start = json.find(&format!("\"{name}\":\""))? + name.len() + 4;
    let end = json[start..].find('"')?;
    Some(json[start..start + end].to_owned())
}

/// A TCP proxy in front of one member that forwards the first `pass`
/// HTTP requests (counted across connections) and after that forwards
/// nothing and answers nothing: a member that went silent. With `pass`
/// `usize::MAX` it only counts the requests and the connections the
/// client closed.
pub struct Blackhole {
    pub addr: String,
    stopped: Arc<AtomicBool>,
    streams: Arc<Mutex<Vec<TcpStream>>>,
    requests: Arc<AtomicUsize>,
    client_closes: Arc<AtomicUsize>,
}

impl Blackhole {
    pub fn start(upstream: &str, pass: usize) -> Blackhole {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().unwrap().to_string();
        let stopped = Arc::new(AtomicBool::new(false));
        let streams = Arc::new(Mutex::new(Vec::new()));
        let requests = Arc::new(AtomicUsize::new(0));
        let client_closes = Arc::new(AtomicUsize::new(0));
        let counted = (requests.clone(), client_closes.clone());
        let (upstream, stop, open) = (upstream.to_owned(), stopped.clone(), streams.clone());
        std::thread::spawn(move || {
            for client in listener.incoming() {
                if stop.load(Ordering::SeqCst) {
                    return;
                }
                let Ok(client) = client else { continue };
                let Ok(server) = TcpStream::connect(&upstream) else {
                    continue;
                };
                open.lock()
                    .unwrap()
                    .extend([client.try_clone().unwrap(), server.try_clone().unwrap()]);
                let (from, to) = (client.try_clone().unwrap(), server.try_clone().unwrap());
                let requests = counted.0.clone();
                let closes = counted.1.clone();
                std::thread::spawn(move || {
                    pump(from, to, Some((requests, pass)));
                    closes.fetch_add(1, Ordering::SeqCst);
                });
                std::thread::spawn(move || pump(server, client, None));
            }
        });
        Blackhole {
            addr,
            stopped,
            streams,
            requests,
            client_closes,
        }
    }

    /// How many HTTP requests have started through it.
    pub fn requests(&self) -> usize {
        self.requests.load(Ordering::SeqCst)
    }

    /// How many connections ended from the client's side (it closed them,
    /// or the member did and the client's side followed).
    pub fn client_closes(&self) -> usize {
        self.client_closes.load(Ordering::SeqCst)
    }
}

/// Copies `from` to `to`. Requests (`counted`) stop being forwarded once
/// more than `pass` have started: the rest is read and dropped.
fn pump(mut from: TcpStream, mut to: TcpStream, counted: Option<(Arc<AtomicUsize>, usize)>) {
    let mut buf = [0u8; 16 * 1024];
    let mut silent = false;
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        if let Some((requests, pass)) = &counted {
            let starts = buf[..n].windows(6).filter(|w| w == b"POST /").count();
            if starts > 0 && requests.fetch_add(starts, Ordering::SeqCst) + starts > *pass {
                silent = true;
            }
        }
        if !silent && to.write_all(&buf[..n]).is_err() {
            break;
        }
    }
    if !silent {
        let _ = to.shutdown(Shutdown::Write);
    }
}

impl Drop for Blackhole {
    fn drop(&mut self) {
        self.stopped.store(true, Ordering::SeqCst);
        for stream in self.streams.lock().unwrap().drain(..) {
            let _ = stream.shutdown(Shutdown::Both);
        }
        let _ = TcpStream::connect(&self.addr);
    }
}
