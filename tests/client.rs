//! The official client against a real server, through fault proxies.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Barrier, Mutex};
use std::time::{Duration, Instant};

use kunci::client::{Client, Config, Error, Loss, TRANSPORT_DEADLINE};
use kunci::protocol::Response;

use crate::util::TestServer;
use crate::util::proxy::{Faults, Proxy};

const MS: Duration = Duration::from_millis(1);
const S: Duration = Duration::from_secs(1);
/// How late an outcome may come after the instant it is due; it may never
/// come early.
const LATE: Duration = Duration::from_millis(100);

fn connect(addresses: &[&str]) -> Client {
    let addresses = addresses.iter().map(|a| a.parse().unwrap());
    Client::new(addresses, Config::default()).unwrap()
}

/// A server, a proxy in front of it, and a client that reaches the server
/// through the proxy.
fn proxied() -> (TestServer, Proxy, Client) {
    let server = TestServer::start(&[]);
    let proxy = Proxy::start(&server.addr);
    let client = connect(&[&proxy.addr]);
    (server, proxy, client)
}

fn owners_of_acquires(proxy: &Proxy) -> Vec<u64> {
    proxy
        .frames()
        .iter()
        .filter(|f| f.op == b'A')
        .map(|f| f.id)
        .collect()
}

/// Waits (bounded) for a condition that becomes true soon.
fn eventually(what: &str, mut condition: impl FnMut() -> bool) {
    let deadline = Instant::now() + 10 * S;
    while !condition() {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        std::thread::sleep(5 * MS);
    }
}

#[test]
fn basic_operations() {
    let server = TestServer::start(&[]);
    let client = connect(&[&server.addr]);
    assert!(client.ping().unwrap() < S);
    assert!(client.info().unwrap().contains("next_token="));
    assert!(client.query("basic").unwrap().is_free());
    let mut ticket = client.acquire("basic", Duration::ZERO, 30 * S).unwrap();
    assert_eq!(ticket.key(), "basic");
    assert!(ticket.token() > 0);
    let status = client.query("basic").unwrap();
    assert_eq!(status.token, ticket.token());
    assert!(
        status.lease_ms > 29_000 && status.lease_ms <= 30_000,
        "{status:?}"
    );
    let before = ticket.valid_until();
    ticket.renew(60 * S).unwrap();
    assert!(ticket.valid_until() > before + 29 * S);
    assert!(client.query("basic").unwrap().lease_ms > 59_000);
    assert_eq!(
        client.acquire("basic", Duration::ZERO, S).unwrap_err(),
        Error::Timeout
    );
    let token = ticket.token();
    ticket.release().unwrap();
    assert_eq!(client.release("basic", token), Err(Error::NotHeld));
    assert_eq!(client.renew("basic", token, S), Err(Error::NotHeld));
    // Dropping a ticket releases it in the background.
    let ticket = client.acquire("basic", Duration::ZERO, 30 * S).unwrap();
    assert!(ticket.token() > token);
    drop(ticket);
    let again = client.acquire("basic", 5 * S, 30 * S).unwrap();
    let kept = again.into_token();
    assert_eq!(client.query("basic").unwrap().token, kept);
    client.release("basic", kept).unwrap();
}

#[test]
fn invalid_input_is_rejected_before_anything_is_sent() {
    let proxy = Proxy::start("127.0.0.1:1");
    let client = connect(&[&proxy.addr]);
    let long = "k".repeat(256);
    for (key, wait, lease) in [
        ("", Duration::ZERO, S),
        (long.as_str(), Duration::ZERO, S),
        ("a\nb", Duration::ZERO, S),
        ("k", 255 * S + Duration::from_nanos(1), S),
        ("k", Duration::ZERO, Duration::ZERO),
        ("k", Duration::ZERO, 256 * S),
        ("k", Duration::ZERO, 1500 * MS),
    ] {
        let started = Instant::now();
        let error = client.acquire(key, wait, lease).unwrap_err();
        assert!(matches!(error, Error::InvalidArgument(_)), "{error:?}");
        assert!(started.elapsed() < S);
    }
    assert!(matches!(client.query(""), Err(Error::InvalidArgument(_))));
    assert!(matches!(
        client.renew("k", 1, Duration::ZERO),
        Err(Error::InvalidArgument(_))
    ));
    assert_eq!(proxy.accepted(), 0, "nothing was even connected");
}

#[test]
fn an_acquire_reaches_the_server_at_most_once_whatever_the_faults() {
    let server = TestServer::start(&[]);
    let scenarios: Vec<(&str, Faults)> = vec![
        ("none", Faults::default()),
        (
            "close on accept",
            Faults {
                close_on_accept: true,
                ..Faults::default()
            },
        ),
        (
            "cut after 1 byte",
            Faults {
                cut_after_request_bytes: Some(1),
                ..Faults::default()
            },
        ),
        (
            "cut after 12 bytes",
            Faults {
                cut_after_request_bytes: Some(12),
                ..Faults::default()
            },
        ),
        (
            "cut after one frame",
            Faults {
                cut_after_request_bytes: Some(18),
                ..Faults::default()
            },
        ),
        (
            "swallow requests",
            Faults {
                swallow_requests: true,
                ..Faults::default()
            },
        ),
        (
            "swallow answers",
            Faults {
                swallow_answers: true,
                ..Faults::default()
            },
        ),
        (
            "drop one answer",
            Faults {
                drop_answers: 1,
                ..Faults::default()
            },
        ),
        (
            "delay answers past the deadline",
            Faults {
                answer_delay: TRANSPORT_DEADLINE + S,
                ..Faults::default()
            },
        ),
    ];
    let threads: Vec<_> = scenarios
        .into_iter()
        .enumerate()
        .map(|(n, (name, faults))| {
            let addr = server.addr.clone();
            std::thread::spawn(move || {
                let proxy = Proxy::start(&addr);
                proxy.set_faults(faults);
                let client = connect(&[&proxy.addr]);
                let key = format!("once-{n}");
                let outcomes: Vec<_> = (0..3)
                    .map(|_| {
                        client
                            .acquire(&key, Duration::ZERO, 2 * S)
                            .map(|t| t.into_token())
                    })
                    .collect();
                let owners = owners_of_acquires(&proxy);
                let mut unique = owners.clone();
                unique.sort_unstable();
                unique.dedup();
                assert_eq!(
                    unique.len(),
                    owners.len(),
                    "{name}: an owner was sent twice"
                );
                assert!(owners.len() <= 3, "{name}: {owners:?}");
                for outcome in &outcomes {
                    assert!(
                        matches!(
                            outcome,
                            Ok(_)
                                | Err(Error::Timeout
                                    | Error::Indeterminate
                                    | Error::Unavailable(_))
                        ),
                        "{name}: {outcome:?}"
                    );
                }
                (name, outcomes)
            })
        })
        .collect();
    for thread in threads {
        let (name, outcomes) = thread.join().unwrap();
        if name == "none" {
            assert!(outcomes[0].is_ok(), "{outcomes:?}");
            assert_eq!(outcomes[1], Err(Error::Timeout));
        }
        if name == "swallow answers" || name == "delay answers past the deadline" {
            assert!(
                outcomes.iter().all(|o| *o == Err(Error::Indeterminate)),
                "{name}: {outcomes:?}"
            );
        }
    }
}

#[test]
fn unavailable_only_when_nothing_was_sent() {
    let refusing = Proxy::start_refusing("127.0.0.1:1", None);
    let client = connect(&[&refusing.addr]);
    let started = Instant::now();
    let outcome = client.acquire("unavailable", 500 * MS, S);
    let elapsed = started.elapsed();
    assert_eq!(
        outcome.unwrap_err(),
        Error::Unavailable(kunci::client::Unavailable::Unreachable)
    );
    eprintln!("unavailable after {elapsed:?}");
    let deadline = 500 * MS + TRANSPORT_DEADLINE;
    assert!(elapsed >= deadline, "{elapsed:?}: early");
    assert!(elapsed < deadline + LATE, "{elapsed:?}: late");
    assert_eq!(refusing.accepted(), 0);
    assert_eq!(refusing.frames(), []);
}

#[test]
fn a_late_request_carries_the_recomputed_wire_wait() {
    let server = TestServer::start(&[]);
    let delayed = Proxy::start_refusing(&server.addr, Some(1200 * MS));
    let client = connect(&[&delayed.addr]);
    let started = Instant::now();
    let ticket = client.acquire("late", 3 * S, 5 * S).unwrap();
    let frames = delayed.forwarded();
    assert_eq!(frames.len(), 1, "{frames:?}");
    let sent_after = frames[0].at - started;
    assert!(sent_after >= 1200 * MS, "{sent_after:?}");
    // Between 1.2 s and 2 s of the 3 s wait were left when it was written.
    assert!(sent_after < 2 * S, "{sent_after:?}");
    assert_eq!(frames[0].wait_s, 2);
    drop(ticket);

    // An original zero wait stays zero, however late it goes out.
    let delayed = Proxy::start_refusing(&server.addr, Some(300 * MS));
    let client_zero = connect(&[&delayed.addr]);
    let ticket = client_zero
        .acquire("late-zero", Duration::ZERO, 5 * S)
        .unwrap();
    let frames = delayed.forwarded();
    assert_eq!(frames.len(), 1, "{frames:?}");
    assert_eq!(frames[0].wait_s, 0);
    drop(ticket);
}

#[test]
fn no_answer_by_the_deadline_is_indeterminate_and_the_orphan_is_reclaimed() {
    let server = TestServer::start(&[]);
    let proxy = Proxy::start(&server.addr);
    proxy.set_faults(Faults {
        swallow_answers: true,
        ..Faults::default()
    });
    let faulty = connect(&[&proxy.addr]);
    let direct = connect(&[&server.addr]);
    let started = Instant::now();
    let outcome = faulty.acquire("orphan", Duration::ZERO, 7 * S);
    let elapsed = started.elapsed();
    assert_eq!(outcome.unwrap_err(), Error::Indeterminate);
    eprintln!("indeterminate after {elapsed:?}");
    assert!(elapsed >= TRANSPORT_DEADLINE, "{elapsed:?}: early");
    assert!(elapsed < TRANSPORT_DEADLINE + LATE, "{elapsed:?}: late");
    // Exactly that session was closed.
    eventually("the client closed its session", || {
        proxy.client_closes() == 1
    });
    // The server granted it, and the grant is still there: the clean-up's
    // `H` (rule 11) gets no answer through this proxy either.
    let frames: Vec<_> = proxy
        .forwarded()
        .into_iter()
        .filter(|frame| frame.op == b'A')
        .collect();
    assert_eq!(frames.len(), 1);
    let status = direct.query("orphan").unwrap();
    assert_eq!(status.owner, frames[0].id);
    // The server reclaims it at the end of its lease, not before.
    let ticket = direct.acquire("orphan", 5 * S, 5 * S).unwrap();
    assert!(ticket.token() > status.token);
    let since_grant = Instant::now() - frames[0].at;
    assert!(since_grant >= 7 * S, "{since_grant:?}: reclaimed early");
    assert!(since_grant < 7 * S + 500 * MS, "{since_grant:?}");
}

/// Stops the calling thread in a signal handler for a while: the call it
/// is blocked in sees its answer only after the deadline, at the hand-over
/// gate.
fn pause_thread(thread: libc::pthread_t, pause: Duration) {
    static PAUSE_MS: AtomicU64 = AtomicU64::new(0);
    static INSTALLED: std::sync::Once = std::sync::Once::new();
    PAUSE_MS.store(pause.as_millis() as u64, Ordering::SeqCst);
    INSTALLED.call_once(|| {
        // SAFETY: the handler only calls nanosleep(2), which is
        // async-signal-safe.
        unsafe {
            signal_hook::low_level::register(libc::SIGUSR1, || {
                let ms = PAUSE_MS.load(Ordering::SeqCst);
                let time = libc::timespec {
                    tv_sec: (ms / 1000) as libc::time_t,
                    tv_nsec: ((ms % 1000) * 1_000_000) as libc::c_long,
                };
                libc::nanosleep(&time, std::ptr::null_mut());
            })
            .unwrap();
        }
    });
    // SAFETY: the thread is alive (it waits on a barrier we passed).
    unsafe {
        libc::pthread_kill(thread, libc::SIGUSR1);
    }
}

#[test]
fn a_grant_noticed_after_the_deadline_is_indeterminate_and_released() {
    let server = TestServer::start(&[]);
    let proxy = Proxy::start(&server.addr);
    proxy.set_faults(Faults {
        answer_delay: 300 * MS,
        ..Faults::default()
    });
    let client = connect(&[&proxy.addr]);
    let barrier = Arc::new(Barrier::new(2));
    let caller = {
        let (client, entered) = (client.clone(), barrier.clone());
        let me = Arc::new(Mutex::new(None));
        let id = me.clone();
        let handle = std::thread::spawn(move || {
            // SAFETY: pthread_self has no preconditions.
            *id.lock().unwrap() = Some(unsafe { libc::pthread_self() });
            entered.wait();
            let started = Instant::now();
            (
                client.acquire("late-grant", Duration::ZERO, 30 * S),
                started.elapsed(),
            )
        });
        barrier.wait();
        std::thread::sleep(100 * MS);
        pause_thread(me.lock().unwrap().unwrap(), TRANSPORT_DEADLINE + 500 * MS);
        handle
    };
    let (outcome, elapsed) = caller.join().unwrap();
    assert_eq!(outcome.unwrap_err(), Error::Indeterminate);
    assert!(elapsed >= TRANSPORT_DEADLINE, "{elapsed:?}");
    let token = proxy
        .answers()
        .iter()
        .find_map(|answer| match *answer {
            Response::Acquired { token, .. } => Some(token),
            _ => None,
        })
        .expect("the server granted it");
    eventually("the compensating release reached the server", || {
        proxy
            .forwarded()
            .iter()
            .any(|f| f.op == b'R' && f.id == token && f.key == "late-grant")
    });
    let releases = proxy
        .forwarded()
        .into_iter()
        .filter(|f| f.op == b'R')
        .count();
    assert_eq!(releases, 1);
    eventually("the key is free again", || {
        client
            .query("late-grant")
            .is_ok_and(|status| status.is_free())
    });
}

#[test]
fn timeout_and_busy_are_definitive() {
    let server = TestServer::start(&["--max-keys", "1"]);
    let proxy = Proxy::start(&server.addr);
    let client = connect(&[&proxy.addr]);
    let holder = client.acquire("full", Duration::ZERO, 30 * S).unwrap();
    assert_eq!(
        client.acquire("full", Duration::ZERO, S).unwrap_err(),
        Error::Timeout
    );
    // Answers that come late (but before the deadline) stay definitive.
    proxy.set_faults(Faults {
        answer_delay: 2 * S,
        ..Faults::default()
    });
    let started = Instant::now();
    assert_eq!(
        client.acquire("full", 500 * MS, S).unwrap_err(),
        Error::Timeout
    );
    // The wire wait was rounded up to 1 s; the answer was then held 2 s.
    assert!(started.elapsed() >= 3 * S, "{:?}", started.elapsed());
    assert_eq!(
        client.acquire("other", Duration::ZERO, S).unwrap_err(),
        Error::Busy
    );
    assert_eq!(client.acquire("other", 2 * S, S).unwrap_err(), Error::Busy);
    proxy.set_faults(Faults::default());
    holder.release().unwrap();
}

#[test]
fn wait_zero_moves_to_another_session_only_when_certainly_not_sent() {
    let server = TestServer::start(&[]);
    // A refused connect sends nothing: the same request goes elsewhere.
    let refusing = Proxy::start_refusing(&server.addr, None);
    let good = Proxy::start(&server.addr);
    let client_a = connect(&[&refusing.addr, &good.addr]);
    for n in 0..5 {
        let key = format!("move-{n}");
        let ticket = client_a.acquire(&key, Duration::ZERO, 5 * S).unwrap();
        drop(ticket);
    }
    assert_eq!(refusing.accepted(), 0);
    assert_eq!(owners_of_acquires(&good).len(), 5);

    // A request the socket took bytes of is never sent elsewhere.
    let cutting = Proxy::start(&server.addr);
    cutting.set_faults(Faults {
        cut_after_request_bytes: Some(3),
        ..Faults::default()
    });
    let later = Proxy::start_refusing(&server.addr, Some(500 * MS));
    let client_b = connect(&[&cutting.addr, &later.addr]);
    let started = Instant::now();
    assert_eq!(
        client_b.acquire("stay", Duration::ZERO, 5 * S).unwrap_err(),
        Error::Indeterminate
    );
    assert!(
        started.elapsed() < 500 * MS,
        "noticed when the session died"
    );
    assert_eq!(cutting.frames(), [], "no whole frame reached the server");
    std::thread::sleep(600 * MS);
    assert_eq!(later.frames(), []);
    let direct = connect(&[&server.addr]);
    assert!(direct.query("stay").unwrap().is_free());
}

#[test]
fn many_threads_share_one_client_and_never_overlap() {
    const THREADS: usize = 32;
    const ROUNDS: usize = 1000;
    const KEYS: usize = 8;
    let server = TestServer::start(&[]);
    let client = connect(&[&server.addr]);
    /// A resource behind the lock: refuses stale tokens, detects overlap.
    #[derive(Default)]
    struct Fenced {
        holder: bool,
        last_token: u64,
        count: u64,
    }
    let resources: Arc<Vec<Mutex<Fenced>>> =
        Arc::new((0..KEYS).map(|_| Mutex::default()).collect());
    let started = Instant::now();
    let threads: Vec<_> = (0..THREADS)
        .map(|t| {
            let (client, resources) = (client.clone(), resources.clone());
            std::thread::spawn(move || {
                for round in 0..ROUNDS {
                    let k = (t + round) % KEYS;
                    let key = format!("shared-{k}");
                    let ticket = client.acquire(&key, 30 * S, 30 * S).unwrap();
                    {
                        let mut resource = resources[k].lock().unwrap();
                        assert!(!resource.holder, "two holders of {key}");
                        assert!(ticket.token() > resource.last_token, "stale token");
                        resource.holder = true;
                        resource.last_token = ticket.token();
                        resource.count += 1;
                    }
                    resources[k].lock().unwrap().holder = false;
                    ticket.release().unwrap();
                }
            })
        })
        .collect();
    for thread in threads {
        thread.join().unwrap();
    }
    let elapsed = started.elapsed();
    let total: u64 = resources.iter().map(|r| r.lock().unwrap().count).sum();
    assert_eq!(total, (THREADS * ROUNDS) as u64);
    let info = server.info();
    assert_eq!(info["grants"], (THREADS * ROUNDS).to_string());
    assert_eq!(info["released"], (THREADS * ROUNDS).to_string());
    assert_eq!(info["not_held"], "0");
    assert_eq!(info["held"], "0");
    eprintln!(
        "{} acquire/release pairs in {elapsed:?} ({:.0} pairs/s)",
        THREADS * ROUNDS,
        (THREADS * ROUNDS) as f64 / elapsed.as_secs_f64()
    );
}

#[test]
fn unix_socket_addresses_work_alongside_tcp() {
    let dir = crate::util::TempDir::new("client-unix");
    let path = dir.join("kunci.sock");
    let unix = format!("unix:{}", path.display());
    let server = TestServer::start(&["--listen", "127.0.0.1:0", "--listen", &unix]);
    let over_unix = connect(&[&unix]);
    let ticket = over_unix.acquire("unix", Duration::ZERO, 5 * S).unwrap();
    let over_tcp = connect(&[&server.addr]);
    assert_eq!(over_tcp.query("unix").unwrap().token, ticket.token());
    ticket.release().unwrap();
    assert!(over_unix.ping().unwrap() < S);
}

#[test]
fn a_renewal_without_an_answer_keeps_the_earlier_bound() {
    let (_server, proxy, client) = proxied();
    let mut ticket = client
        .acquire("renew-lost", Duration::ZERO, 30 * S)
        .unwrap();
    let before = ticket.valid_until();
    proxy.set_faults(Faults {
        swallow_answers: true,
        ..Faults::default()
    });
    let started = Instant::now();
    // A shorter lease may or may not have been applied: assume it was.
    assert_eq!(ticket.renew(2 * S), Err(Error::Indeterminate));
    assert!(started.elapsed() >= TRANSPORT_DEADLINE);
    assert!(ticket.valid_until() < before);
    assert!(ticket.valid_until() <= started + 2 * S);
    assert!(!ticket.is_valid());
    // The server did apply it, and the lock is still the ticket's to release.
    proxy.set_faults(Faults::default());
    let frames = proxy.forwarded();
    assert!(
        frames
            .iter()
            .any(|f| f.op == b'E' && f.id == ticket.token() && f.lease_s == 2)
    );
    let token = ticket.into_token();
    assert!(matches!(
        client.release("renew-lost", token),
        Ok(()) | Err(Error::NotHeld)
    ));
}

#[test]
fn a_server_shutting_down_answers_waiters_busy() {
    let server = TestServer::start(&[]);
    let client = connect(&[&server.addr]);
    let holder = client.acquire("shutdown", Duration::ZERO, 30 * S).unwrap();
    let waiter = {
        let client = client.clone();
        std::thread::spawn(move || client.acquire("shutdown", 30 * S, S))
    };
    eventually("the waiter is queued", || {
        client
            .query("shutdown")
            .is_ok_and(|status| status.waiters == 1)
    });
    assert!(server.stop().success());
    assert_eq!(waiter.join().unwrap().unwrap_err(), Error::Busy);
    let _ = holder.into_token();
}

/// How late a keep-alive event may be seen, through the proxy or a
/// callback, on a machine busy with other tests: generous, as upper bounds
/// are here; the lower bounds are exact.
const SLACK: Duration = Duration::from_millis(500);

/// When the proxy saw each `E` for `token`.
fn renewals_of(proxy: &Proxy, token: u64) -> Vec<Instant> {
    proxy
        .frames()
        .iter()
        .filter(|f| f.op == b'E' && f.id == token)
        .map(|f| f.at)
        .collect()
}

#[test]
fn a_kept_lease_is_renewed_every_third_of_the_lease_and_outlives_it() {
    let (_server, proxy, client) = proxied();
    let started = Instant::now();
    let kept = client
        .acquire("kept", Duration::ZERO, S)
        .unwrap()
        .keep_alive();
    assert_eq!(kept.wait_lost_timeout(2500 * MS), None);
    assert_eq!(kept.lost(), None);
    assert!(kept.is_valid());
    assert!(kept.valid_until() > started + 2 * S);
    assert_eq!(client.query("kept").unwrap().token, kept.token());
    // Every lease/3 from the previous renewal's start, the first from the
    // acquire's send instant (after `started`): renewal k cannot be seen
    // before started + k × 333 ms, and none comes much later than due.
    let renewals = renewals_of(&proxy, kept.token());
    assert!((6..=7).contains(&renewals.len()), "{renewals:?}");
    let period = S / 3;
    for (k, &seen) in renewals.iter().enumerate() {
        assert!(
            seen >= started + period * (k as u32 + 1),
            "renewal {k} early"
        );
    }
    for pair in renewals.windows(2) {
        let gap = pair[1] - pair[0];
        assert!(gap < period + SLACK, "{gap:?}");
    }
    assert!(
        proxy
            .frames()
            .iter()
            .all(|f| f.op != b'E' || f.lease_s == 1)
    );
    let token = kept.token();
    kept.release().unwrap();
    assert!(client.query("kept").unwrap().is_free());
    // Released: renewal has stopped.
    let count = renewals_of(&proxy, token).len();
    std::thread::sleep(700 * MS);
    assert_eq!(renewals_of(&proxy, token).len(), count);
}

#[test]
fn a_kept_lease_is_lost_at_once_when_a_renewal_finds_it_not_held() {
    let (server, proxy, client) = proxied();
    let (told, news) = std::sync::mpsc::channel();
    let acquired = Instant::now();
    let kept = client
        .acquire("taken-away", Duration::ZERO, 3 * S)
        .unwrap()
        .keep_alive_with(move |loss| told.send((loss, Instant::now())).unwrap());
    // Someone else releases the grant; the next renewal (at lease/3) is
    // answered N.
    connect(&[&server.addr])
        .release("taken-away", kept.token())
        .unwrap();
    assert_eq!(kept.wait_lost(), Loss::NotHeld);
    let (loss, at) = news.recv_timeout(S).unwrap();
    assert_eq!(loss, Loss::NotHeld);
    let after = at - acquired;
    assert!(after >= S && after < S + SLACK, "{after:?}");
    assert!(!kept.is_valid());
    assert_eq!(renewals_of(&proxy, kept.token()).len(), 1);
    // Releasing after the loss sends nothing and says so; the callback ran
    // once.
    let frames = proxy.frames().len();
    assert_eq!(kept.release(), Err(Error::NotHeld));
    std::thread::sleep(1500 * MS);
    assert_eq!(proxy.frames().len(), frames, "nothing sent after the loss");
    assert!(news.try_recv().is_err());
}

#[test]
fn a_kept_lease_is_lost_when_valid_until_passes_without_a_renewal() {
    let (_server, proxy, client) = proxied();
    let kept = client
        .acquire("unanswered", Duration::ZERO, 2 * S)
        .unwrap()
        .keep_alive();
    let valid_until = kept.valid_until();
    proxy.set_faults(Faults {
        swallow_answers: true,
        ..Faults::default()
    });
    assert_eq!(kept.wait_lost(), Loss::Expired);
    let noticed = Instant::now();
    assert!(noticed >= valid_until, "lost before valid_until");
    assert!(noticed < valid_until + SLACK, "{:?}", noticed - valid_until);
    assert_eq!(kept.valid_until(), valid_until);
    // One renewal, possibly sent and never answered: never sent again.
    assert_eq!(renewals_of(&proxy, kept.token()).len(), 1);
    assert_eq!(kept.release(), Err(Error::NotHeld));
}

#[test]
fn a_renewal_whose_session_dies_is_retried_while_time_is_left() {
    let (_server, proxy, client) = proxied();
    let kept = client
        .acquire("retried", Duration::ZERO, 3 * S)
        .unwrap()
        .keep_alive();
    let first_bound = kept.valid_until();
    proxy.set_faults(Faults {
        swallow_answers: true,
        ..Faults::default()
    });
    // The first renewal (at 1 s) reaches the server, its answer does not.
    eventually("the first renewal is sent", || {
        renewals_of(&proxy, kept.token()).len() == 1
    });
    std::thread::sleep(200 * MS);
    proxy.set_faults(Faults::default());
    // Measured before the cut: the retry cannot be sent earlier than 100 ms
    // after it.
    let cut = Instant::now();
    proxy.cut_all();
    // Its session died: Indeterminate, retried 100 ms later, answered.
    eventually("the lease is renewed again", || {
        kept.valid_until() > first_bound
    });
    let renewals = renewals_of(&proxy, kept.token());
    assert_eq!(renewals.len(), 2, "{renewals:?}");
    let retry = renewals[1] - cut;
    assert!(retry >= 100 * MS && retry < 100 * MS + SLACK, "{retry:?}");
    assert_eq!(kept.lost(), None);
    assert_eq!(client.query("retried").unwrap().token, kept.token());
    drop(kept);
    eventually("the dropped lease is released", || {
        client.query("retried").unwrap().is_free()
    });
}

#[test]
fn a_renewal_answered_after_the_loss_is_given_back() {
    let (server, proxy, client) = proxied();
    let kept = client
        .acquire("late-renewal", Duration::ZERO, 2 * S)
        .unwrap()
        .keep_alive();
    let token = kept.token();
    let valid_until = kept.valid_until();
    // The first renewal (at 667 ms) is applied, but its answer arrives
    // after valid_until.
    proxy.set_faults(Faults {
        answer_delay: 1500 * MS,
        ..Faults::default()
    });
    assert_eq!(kept.wait_lost(), Loss::Expired);
    assert!(Instant::now() >= valid_until);
    // Nobody holds that grant now: the client releases it.
    eventually("the renewed grant is released", || {
        server.info()["released"] == "1"
    });
    let releases: Vec<u64> = proxy
        .forwarded()
        .iter()
        .filter(|f| f.op == b'R')
        .map(|f| f.id)
        .collect();
    assert_eq!(releases, [token]);
    assert_eq!(renewals_of(&proxy, token).len(), 1);
    assert_eq!(kept.release(), Err(Error::NotHeld));
}

/// Spec §8 rule 4: a session refused at accept (`X 7` at the connection
/// limit, `X 9` outside `--allow`) executed nothing, so the call ends
/// `Unavailable` with the reason at its deadline — never `Indeterminate`.
#[test]
fn a_refused_session_is_unavailable_with_the_reason() {
    let full = TestServer::start(&["--max-connections", "1"]);
    let mut occupant = full.peer();
    occupant.send(&crate::util::ping(1));
    assert_eq!(occupant.recv(), Response::Pong { nonce: 1 });
    let closed = TestServer::start(&["--allow", "10.0.0.0/8"]);
    let cases = [
        (
            full.addr.clone(),
            kunci::client::Unavailable::ConnectionLimit,
        ),
        (closed.addr.clone(), kunci::client::Unavailable::NotAllowed),
    ];
    let threads: Vec<_> = cases
        .into_iter()
        .map(|(addr, why)| {
            std::thread::spawn(move || {
                let client = connect(&[&addr]);
                let started = Instant::now();
                let outcome = client.acquire("refused", Duration::ZERO, S);
                (outcome, why, started.elapsed())
            })
        })
        .collect();
    for thread in threads {
        let (outcome, why, elapsed) = thread.join().unwrap();
        assert_eq!(outcome.unwrap_err(), Error::Unavailable(why));
        if why == kunci::client::Unavailable::NotAllowed {
            // Rule 4: `X 9` at every address (here the only one) cannot
            // change within the call: it ends at once.
            assert!(elapsed < LATE, "{elapsed:?}: late");
        } else {
            assert!(elapsed >= TRANSPORT_DEADLINE, "{elapsed:?}: early");
            assert!(elapsed < TRANSPORT_DEADLINE + LATE, "{elapsed:?}: late");
        }
    }
    occupant.send(b"I\n");
    let Response::Info(text) = occupant.recv() else {
        panic!("expected info");
    };
    assert_eq!(crate::util::parse_info(&text)["grants"], "0");
}

/// Issue 18 defect 6 (spec §8 rule 4): `X 9` from every address ends a call
/// `Unavailable(NotAllowed)` at once; while one address lets the client in,
/// the request goes there.
#[test]
fn not_allowed_at_every_address_is_unavailable_at_once() {
    let closed = TestServer::start(&["--allow", "10.0.0.0/8"]);
    let also_closed = TestServer::start(&["--allow", "192.168.0.0/16"]);
    let open = TestServer::start(&[]);
    let client = connect(&[&closed.addr, &also_closed.addr]);
    let started = Instant::now();
    let outcome = client.acquire("refused", 10 * S, S);
    let elapsed = started.elapsed();
    assert_eq!(
        outcome.unwrap_err(),
        Error::Unavailable(kunci::client::Unavailable::NotAllowed)
    );
    assert!(elapsed < LATE, "{elapsed:?}: waited for the deadline");
    let client = connect(&[&closed.addr, &open.addr]);
    let ticket = client.acquire("refused", Duration::ZERO, S).unwrap();
    ticket.release().unwrap();
}

/// Issue 18 rule 10 (spec §8): a managed lock whose grant arrived with less
/// than two thirds of its lease left is renewed once before it is handed
/// over, so the caller never gets a lock that is already (almost) lost.
#[test]
fn a_kept_lock_granted_late_is_renewed_before_it_is_handed_over() {
    let server = TestServer::start(&[]);
    let client = connect(&[&server.addr]);
    let holder = client.acquire("late", Duration::ZERO, 30 * S).unwrap();
    let waiter = {
        let client = client.clone();
        std::thread::spawn(move || client.acquire_kept("late", 10 * S, 3 * S))
    };
    eventually("the waiter queues", || {
        client.query("late").is_ok_and(|status| status.waiters == 1)
    });
    // Granted 1.5 s after it was sent: 1.5 s of its 3 s lease is left on
    // valid_until, less than two thirds.
    std::thread::sleep(1500 * MS);
    holder.release().unwrap();
    let kept = waiter.join().unwrap().unwrap();
    let handed_over = Instant::now();
    let left = kept.valid_until().saturating_duration_since(handed_over);
    assert!(left >= 2 * S, "handed over with {left:?} left");
    assert!(kept.is_valid());
    let info = crate::util::parse_info(&client.info().unwrap());
    assert_eq!(info["extended"], "1");
    kept.release().unwrap();
}

/// Rule 10: if that first renewal answers `N`, the acquire ends lock-lost
/// (`NotHeld`) and nothing is handed over.
#[test]
fn a_kept_lock_whose_first_renewal_finds_it_gone_is_not_handed_over() {
    let server = TestServer::start(&[]);
    let proxy = Proxy::start(&server.addr);
    // Every answer takes 1.5 s: the grant of a 1 s lease arrives after the
    // server has already taken it back.
    proxy.set_faults(Faults {
        answer_delay: 1500 * MS,
        ..Faults::default()
    });
    let client = connect(&[&proxy.addr]);
    let outcome = client.acquire_kept("gone", Duration::ZERO, S);
    assert_eq!(outcome.unwrap_err(), Error::NotHeld);
    let renewals: Vec<u8> = proxy.frames().iter().map(|frame| frame.op).collect();
    assert_eq!(
        renewals,
        [b'A', b'E'],
        "one acquire, one renewal, no release"
    );
    assert!(connect(&[&server.addr]).query("gone").unwrap().is_free());
}

/// Spec §8 rule 9: when the program ends holding a ticket (the end of
/// `main` drops the ticket, then the client), its release goes out before
/// the last drop returns, and that drop waits for it at most 0.5 s in all.
#[test]
fn the_last_drop_flushes_the_releases_of_dropped_tickets_within_half_a_second() {
    let server = TestServer::start(&[]);
    let proxy = Proxy::start(&server.addr);
    proxy.set_faults(Faults {
        answer_delay: 300 * MS,
        ..Faults::default()
    });
    let client = connect(&[&proxy.addr]);
    let ticket = client
        .acquire("exit-flush", Duration::ZERO, 30 * S)
        .unwrap();
    let token = ticket.token();
    drop(ticket);
    let started = Instant::now();
    drop(client);
    let took = started.elapsed();
    let released = |proxy: &Proxy| {
        proxy
            .forwarded()
            .iter()
            .any(|f| f.op == b'R' && f.id == token && f.key == "exit-flush")
    };
    assert!(
        released(&proxy),
        "the release was not sent by the drop's end"
    );
    // It waited for the release's answer (held 300 ms by the proxy).
    assert!(took >= 300 * MS, "{took:?}");
    assert!(took < 2 * S, "{took:?}");

    // A server that never answers holds the drop no longer than 0.5 s.
    let client = connect(&[&proxy.addr]);
    proxy.set_faults(Faults::default());
    let ticket = client
        .acquire("exit-flush", Duration::ZERO, 30 * S)
        .unwrap();
    proxy.set_faults(Faults {
        swallow_answers: true,
        ..Faults::default()
    });
    let token = ticket.token();
    drop(ticket);
    let started = Instant::now();
    drop(client);
    let took = started.elapsed();
    assert!(
        proxy
            .forwarded()
            .iter()
            .any(|f| f.op == b'R' && f.id == token),
        "the release was not sent by the drop's end"
    );
    assert!(took >= 500 * MS, "{took:?}");
    assert!(took < 2 * S, "{took:?}");
}
