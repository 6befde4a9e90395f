//! The client on an etcd v3 cluster (`etcd://HOST:PORT[,HOST:PORT…]`):
//! the same calls and outcomes as on a kunci server, through etcd's
//! HTTP/JSON gateway. docs/ETCD.md describes the mapping.
//!
//! Calls run on the caller's thread (each blocks until its outcome, as on
//! a kunci server); background work — releases nobody waits for, lease
//! revocations, and the renewals of kept leases — runs on short-lived
//! threads, and one keeper thread per client schedules the renewals with
//! the same [`KeptLeases`] bookkeeping as the kunci I/O thread.

pub(crate) mod http;
mod json;
mod recipe;

pub use http::EtcdCredentials;

use std::sync::mpsc::RecvTimeoutError;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use crate::addr::EtcdLayout;
use crate::mailbox;

use super::handoff::{KeepTask, KeptLeases, LeaseMessage, Message, Reply};
use super::keep_alive::KeepId;
use super::vocabulary::{Key, Op, Outcome, Submission, TRANSPORT_DEADLINE, Unavailable};
use recipe::{Claim, Cluster, LimitMismatch};

/// What the keeper thread is told.
enum Note {
    Lease(Box<LeaseMessage>),
    Renewed(KeepId, Outcome),
    Close,
}

/// One client's handle on one etcd cluster.
pub(crate) struct Shared {
    cluster: Arc<Cluster>,
    keeper: Mutex<mailbox::Sender<Note>>,
}

impl Shared {
    /// A handle on the cluster whose members are `endpoints` (`HOST:PORT`).
    pub(crate) fn start(
        endpoints: Vec<String>,
        connect_timeout: Duration,
        credentials: Option<EtcdCredentials>,
        tls: http::Tls,
        layout: EtcdLayout,
    ) -> std::io::Result<Arc<Shared>> {
        let members =
            http::Members::new(endpoints, connect_timeout, tls).with_credentials(credentials);
        let cluster = Arc::new(Cluster::new(members).with_layout(layout));
        let (sender, notes) = mailbox::channel();
        let keeper = Keeper {
            cluster: cluster.clone(),
            notes,
            reply: sender.clone(),
            kept: KeptLeases::default(),
        };
        std::thread::Builder::new()
            .name("kunci-etcd-keeper".into())
            .spawn(move || keeper.run())?;
        Ok(Arc::new(Shared {
            cluster,
            keeper: Mutex::new(sender),
        }))
    }

    /// Runs a request on the caller's thread and returns its outcome.
    pub(crate) fn call(&self, submission: Submission<Reply>) -> Outcome {
        execute(
            &self.cluster,
            submission.op,
            submission.key,
            submission.deadline,
        )
    }

    /// Runs a request nobody waits for on its own thread.
    pub(crate) fn submit(&self, submission: Submission<Reply>) -> bool {
        run_in_background(&self.cluster, submission);
        true
    }

    /// Hands a message to the keeper (kept leases) or, for a request, runs
    /// it in the background.
    pub(crate) fn send(&self, message: Message) -> bool {
        match message {
            Message::Request(submission) => self.submit(submission),
            Message::Lease(message) => self.note(Note::Lease(Box::new(message))),
        }
    }

    pub(crate) fn close(&self) {
        self.note(Note::Close);
    }

    fn note(&self, note: Note) -> bool {
        self.keeper
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .send(note)
            .is_ok()
    }
}

fn execute(cluster: &Arc<Cluster>, op: Op, key: Key, deadline: Instant) -> Outcome {
    if let Some(why) = cluster.refuses_key(key) {
        return Outcome::Invalid(why);
    }
    match op {
        Op::Acquire {
            owner,
            lease_s,
            wait_until,
            permits,
            label,
            campaign,
        } => {
            let (limit, take) = permits.wire();
            let claim = Claim {
                limit,
                take,
                label: label.as_str().to_owned(),
                campaign,
            };
            match cluster.acquire(key, owner, &claim, lease_s, wait_until, deadline) {
                Ok(outcome) => outcome,
                Err(LimitMismatch { limit }) => Outcome::LimitMismatch {
                    key_limit: Some(limit),
                },
            }
        }
        Op::Release { token } => cluster.release(key, token, deadline),
        Op::Extend { token, lease_s } => cluster.renew(key, token, lease_s, deadline),
        Op::Query => cluster.query(key, deadline),
        Op::Info => cluster.info(deadline),
        Op::Ping { .. } => cluster.ping(deadline),
        // Rule 11's clean-up never comes here: an etcd acquire that ends
        // `Indeterminate` has already revoked its own lease.
        Op::Holders { .. } => cluster.holders(key, deadline),
        Op::List { cursor, count, .. } => cluster.list(key, cursor, count, deadline),
        Op::Observe {
            since,
            wait_s,
            seen,
            ..
        } => cluster.observe(key, since, wait_s != 0, seen, deadline),
        Op::Proclaim { token, label } => cluster.proclaim(key, token, label.as_str(), deadline),
    }
}

fn run_in_background(cluster: &Arc<Cluster>, submission: Submission<Reply>) {
    let cluster = cluster.clone();
    let spawned = std::thread::Builder::new()
        .name("kunci-etcd-background".into())
        .spawn(move || {
            let outcome = execute(&cluster, submission.op, submission.key, submission.deadline);
            if let Op::Release { token } = submission.op
                && outcome != Outcome::Released
            {
                log::debug!("background release of {token}: {}", outcome.summary());
            }
        });
    if let Err(error) = spawned {
        log::warn!("cannot start a background request: {error}");
    }
}

/// Schedules the renewals of kept leases ([`KeptLeases`]); each renewal
/// runs on its own thread and reports back, so a slow member delays no
/// other lease.
struct Keeper {
    cluster: Arc<Cluster>,
    notes: mailbox::Receiver<Note>,
    reply: mailbox::Sender<Note>,
    kept: KeptLeases,
}

impl Keeper {
    fn run(mut self) {
        loop {
            let note = match self.kept.poll_timeout() {
                Some(at) => {
                    let left = at.saturating_duration_since(Instant::now());
                    match self.notes.recv_timeout(left) {
                        Ok(note) => Some(note),
                        Err(RecvTimeoutError::Timeout) => None,
                        Err(RecvTimeoutError::Disconnected) => break,
                    }
                }
                None => match self.notes.recv() {
                    Ok(note) => Some(note),
                    Err(_) => break,
                },
            };
            let now = Instant::now();
            match note {
                Some(Note::Close) => break,
                Some(Note::Renewed(id, outcome)) => self.kept.handle_outcome(id, outcome, now),
                Some(Note::Lease(message)) => self.kept.receive(*message, now),
                None => {}
            }
            self.kept.handle_timeout(Instant::now());
            self.run_tasks();
        }
        self.kept.lose_all();
    }

    fn run_tasks(&mut self) {
        while let Some(task) = self.kept.poll_task() {
            match task {
                KeepTask::Renew {
                    id,
                    key,
                    token,
                    lease_s,
                } => {
                    let cluster = self.cluster.clone();
                    let reply = self.reply.clone();
                    let spawned = std::thread::Builder::new()
                        .name("kunci-etcd-renew".into())
                        .spawn(move || {
                            let deadline = Instant::now() + TRANSPORT_DEADLINE;
                            let outcome = cluster.renew(key, token, lease_s, deadline);
                            let _ = reply.send(Note::Renewed(id, outcome));
                        });
                    if let Err(error) = spawned {
                        log::warn!("cannot start a renewal: {error}");
                        self.kept.handle_outcome(
                            id,
                            Outcome::Unavailable(Unavailable::Unreachable),
                            Instant::now(),
                        );
                    }
                }
                // etcd keeps a label with its entry: nothing is adopted
                // without it (and the connection count stays 0).
                KeepTask::CheckLabel { .. } => {}
                KeepTask::Release { key, token } => run_in_background(
                    &self.cluster,
                    Submission {
                        op: Op::Release { token },
                        key,
                        deadline: Instant::now() + TRANSPORT_DEADLINE,
                        reply: None,
                    },
                ),
            }
        }
    }
}
