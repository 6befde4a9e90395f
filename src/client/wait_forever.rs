//! Waiting as long as it takes (spec §9 `--wait inf`): a policy over
//! single acquires of at most 255 s each, which also waits through a
//! server's restart or an outage. `kunci run --wait inf`, `kunci elect`
//! and [`Client::campaign`](super::Client::campaign) use it.

use std::time::Duration;

use super::vocabulary::{Error, Unavailable, WAIT_MAX};
use super::{AcquireOptions, Client, Ticket};

impl Client {
    /// Takes the lock on `key` with a lease of `lease`, waiting as long as
    /// it takes (spec §9 `--wait inf`): each wire wait of 255 s that runs
    /// out queues again at the tail; a server that is shutting down or
    /// cannot be reached is asked again after a pause that doubles up to
    /// 2 s; after [`Error::Indeterminate`] the call's own grant, if the
    /// server has one, is released first (spec §8 rule 11). It ends only
    /// with a grant or an error that waiting cannot cure: an invalid
    /// argument, a capacity limit ([`Error::Busy`]), a refusal, a server
    /// that is not trusted.
    pub fn acquire_forever(
        &self,
        key: &str,
        lease: Duration,
        options: impl Into<AcquireOptions>,
    ) -> Result<Ticket, Error> {
        acquire_until_granted(self, key, lease, &options.into(), WAIT_MAX)
    }
}

/// The longest pause between two attempts of `--wait inf` after a restart
/// or an outage (spec §9).
const RETRY_PAUSE_MAX: Duration = Duration::from_secs(2);
/// The first such pause; it doubles up to [`RETRY_PAUSE_MAX`].
const RETRY_PAUSE_FIRST: Duration = Duration::from_millis(100);
/// How long after a `Busy` an `X 8` from the same server may still arrive:
/// a shutting-down server sends the two back to back.
const SHUTDOWN_NOTICE_WAIT: Duration = Duration::from_millis(200);

/// Acquires `key`, waiting `slice` at a time until it is granted (spec §9
/// `--wait inf`). Each attempt is a new request at the tail of the queue:
/// the place is not kept across attempts. `Timeout` queues again at once;
/// `Busy` from a server that is shutting down (its `X 8` follows the `B`)
/// and `Unavailable` are tried again after a pause that doubles up to 2 s;
/// after `Indeterminate` the call's own grant, if the server has one, is
/// released first (rule 11), then the key is asked for again. Every other
/// outcome, a `Busy` at a capacity limit included, ends the wait.
pub(crate) fn acquire_until_granted(
    client: &Client,
    key: &str,
    lease: Duration,
    acquire: &AcquireOptions,
    slice: Duration,
) -> Result<Ticket, Error> {
    let mut pause = RETRY_PAUSE_FIRST;
    loop {
        let owner = client.fresh_owner();
        let notices = client.shutdown_notices();
        match client.acquire_as(owner, key, slice, lease, acquire.clone()) {
            Err(Error::Timeout) => {
                log::debug!(
                    "{key}: still held after {} s; queueing again",
                    crate::decimal::seconds_shortest(slice)
                );
                pause = RETRY_PAUSE_FIRST;
                continue;
            }
            Err(Error::Busy) if !server_shut_down(client, notices) => return Err(Error::Busy),
            Err(Error::Busy) => log::debug!("{key}: the server is shutting down; asking again"),
            // A certificate problem does not go away by waiting, nor does a
            // peer that speaks another protocol.
            Err(Error::Unavailable(
                why @ (Unavailable::Untrusted(_) | Unavailable::WrongProtocol(_)),
            )) => {
                return Err(Error::Unavailable(why));
            }
            Err(Error::Unavailable(why)) => {
                log::debug!("{key}: unavailable ({why:?}); asking again")
            }
            Err(Error::Indeterminate) => {
                log::debug!("{key}: no answer in time; releasing this call's grant if any");
                release_own_grant(client, key, owner);
            }
            outcome => return outcome,
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(RETRY_PAUSE_MAX);
    }
}

/// Whether a server said it is shutting down since the count was
/// `notices`, waiting a moment for the `X 8` that follows a `B`.
fn server_shut_down(client: &Client, notices: u64) -> bool {
    let give_up = std::time::Instant::now() + SHUTDOWN_NOTICE_WAIT;
    loop {
        if client.shutdown_notices() != notices {
            return true;
        }
        if std::time::Instant::now() >= give_up {
            return false;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Spec §8 rule 11: after an `Indeterminate` acquire, makes sure the call
/// holds nothing: ask for the key's holders (`H`) and release every grant
/// of the call's `owner`. Asks until the server answers (quietly, with the
/// same capped pauses), so that the next attempt never queues behind its
/// own lost grant.
fn release_own_grant(client: &Client, key: &str, owner: u64) {
    let mut pause = RETRY_PAUSE_FIRST;
    loop {
        match client.holders(key) {
            Ok(holders) => {
                let mut released = true;
                for grant in holders
                    .grants
                    .iter()
                    .filter(|g| g.owner == owner && g.token != 0)
                {
                    match client.release(key, grant.token) {
                        Ok(()) | Err(Error::NotHeld) => {}
                        Err(error) => {
                            log::debug!("{key}: releasing our grant: {error}");
                            released = false;
                        }
                    }
                }
                if released {
                    return;
                }
            }
            Err(Error::InvalidArgument(_)) => return,
            Err(error) => log::debug!("{key}: asking who holds it: {error}"),
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(RETRY_PAUSE_MAX);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering as AtomicOrdering};
    use std::time::Instant;

    use super::*;
    use crate::addr::Address;
    use crate::client::Config;
    use crate::server::{Config as ServerConfig, Server};

    #[test]
    fn waiting_forever_queues_again_each_time_a_wait_runs_out() {
        let listen = vec!["127.0.0.1:0".parse().unwrap()];
        let server = Server::bind(ServerConfig {
            listen,
            ..Default::default()
        })
        .unwrap();
        let address = server.addresses()[0].clone();
        let stop = server.shutdown_handle();
        let running = std::thread::spawn(move || server.run());
        let client = Client::new([address], Config::default()).unwrap();
        let holder = client
            .acquire("forever", Duration::ZERO, Duration::from_secs(30))
            .unwrap();
        let started = Instant::now();
        let releaser = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(2500));
            holder.release().unwrap();
        });
        // A one-second slice stands in for 255 s: two waits run out (two
        // `T`), the third attempt is granted when the holder lets go.
        let ticket = acquire_until_granted(
            &client,
            "forever",
            Duration::from_secs(5),
            &AcquireOptions::new(),
            Duration::from_secs(1),
        )
        .unwrap();
        let waited = started.elapsed();
        releaser.join().unwrap();
        assert!(waited >= Duration::from_millis(2500), "{waited:?}");
        assert!(waited < Duration::from_secs(4), "{waited:?}");
        let info = client.info().unwrap();
        for counter in ["timeouts=2", "grants=2", "released=1"] {
            assert!(
                info.split(' ').any(|pair| pair == counter),
                "{counter}: {info}"
            );
        }
        ticket.release().unwrap();
        // Other outcomes end the wait at once.
        assert_eq!(
            acquire_until_granted(
                &client,
                "",
                Duration::from_secs(5),
                &AcquireOptions::new(),
                Duration::from_secs(1)
            )
            .unwrap_err(),
            Error::InvalidArgument("key is empty")
        );
        stop.shut_down();
        running.join().unwrap().unwrap();
    }

    /// A server on a free loopback port, running on its own thread.
    fn start_server(
        listen: &str,
    ) -> (
        Address,
        crate::server::ShutdownHandle,
        std::thread::JoinHandle<std::io::Result<()>>,
    ) {
        let server = Server::bind(ServerConfig {
            listen: vec![listen.parse().unwrap()],
            ..Default::default()
        })
        .unwrap();
        let address = server.addresses()[0].clone();
        let stop = server.shutdown_handle();
        (address, stop, std::thread::spawn(move || server.run()))
    }

    /// A TCP relay to `upstream`: requests pass, answers are dropped while
    /// `swallow` is set. Returns its address.
    fn relay(upstream: String, swallow: Arc<AtomicBool>) -> Address {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let address = listener.local_addr().unwrap().to_string();
        std::thread::spawn(move || {
            for client in listener.incoming() {
                let Ok(client) = client else { return };
                let Ok(server) = std::net::TcpStream::connect(&upstream) else {
                    continue;
                };
                let (mut from_client, mut to_server) =
                    (client.try_clone().unwrap(), server.try_clone().unwrap());
                std::thread::spawn(move || std::io::copy(&mut from_client, &mut to_server));
                let (mut from_server, mut to_client) = (server, client);
                let swallow = swallow.clone();
                std::thread::spawn(move || {
                    let mut buf = [0u8; 4096];
                    loop {
                        match std::io::Read::read(&mut from_server, &mut buf) {
                            Ok(0) | Err(_) => return,
                            Ok(_) if swallow.load(AtomicOrdering::SeqCst) => {}
                            Ok(n) => {
                                if std::io::Write::write_all(&mut to_client, &buf[..n]).is_err() {
                                    return;
                                }
                            }
                        }
                    }
                });
            }
        });
        address.parse().unwrap()
    }

    /// Spec §9 `--wait inf`, rule 11: after an `Indeterminate` acquire the
    /// call's own grant is found with `Q` and released, then the key is
    /// asked for again. Without the clean-up the next attempt would queue
    /// behind that grant for its whole 30 s lease.
    #[test]
    fn waiting_forever_releases_its_own_unseen_grant_after_indeterminate() {
        let (address, stop, running) = start_server("127.0.0.1:0");
        let swallow = Arc::new(AtomicBool::new(true));
        let relayed = relay(address.to_string(), swallow.clone());
        let client = Client::new([relayed], Config::default()).unwrap();
        let started = Instant::now();
        let unswallow = {
            let swallow = swallow.clone();
            std::thread::spawn(move || {
                // Before the first attempt's deadline (1 s wait + 5 s):
                // its answer is gone by then, later ones pass.
                std::thread::sleep(Duration::from_millis(5500));
                swallow.store(false, AtomicOrdering::SeqCst);
            })
        };
        let ticket = acquire_until_granted(
            &client,
            "unseen",
            Duration::from_secs(30),
            &AcquireOptions::new(),
            Duration::from_secs(1),
        )
        .unwrap();
        let waited = started.elapsed();
        unswallow.join().unwrap();
        assert!(waited >= Duration::from_secs(6), "{waited:?}");
        assert!(waited < Duration::from_secs(8), "{waited:?}");
        let info = client.info().unwrap();
        for counter in ["grants=2", "released=1", "timeouts=0"] {
            assert!(
                info.split(' ').any(|pair| pair == counter),
                "{counter}: {info}"
            );
        }
        ticket.release().unwrap();
        stop.shut_down();
        running.join().unwrap().unwrap();
    }

    /// Spec §9 `--wait inf`: `Unavailable` (no server at the address yet)
    /// is tried again after a pause, until the server is there.
    #[test]
    fn waiting_forever_waits_through_an_outage() {
        // A unix socket path that nothing listens on yet: unlike a TCP port
        // let go of for later, no other test can take it meanwhile.
        let dir = std::env::temp_dir().join(format!("kunci-outage-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("kunci.sock");
        let _ = std::fs::remove_file(&path);
        let listen = format!("unix:{}", path.display());
        let client = Client::new([listen.parse().unwrap()], Config::default()).unwrap();
        let started = Instant::now();
        let later = std::thread::spawn(move || {
            // Past the first attempt's deadline (wait 0 + 5 s).
            std::thread::sleep(Duration::from_millis(6000));
            start_server(&listen)
        });
        let ticket = acquire_until_granted(
            &client,
            "outage",
            Duration::from_secs(5),
            &AcquireOptions::new(),
            Duration::ZERO,
        )
        .unwrap();
        let waited = started.elapsed();
        let (_, stop, running) = later.join().unwrap();
        assert!(waited >= Duration::from_secs(6), "{waited:?}");
        assert!(waited < Duration::from_secs(9), "{waited:?}");
        ticket.release().unwrap();
        stop.shut_down();
        running.join().unwrap().unwrap();
        let _ = std::fs::remove_dir_all(&dir);
    }
}
