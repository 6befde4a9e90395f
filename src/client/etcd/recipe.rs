//! The lock recipe on etcd (docs/ETCD.md): each kunci request as etcd
//! requests, with the outcomes and rules of spec §8.
//!
//! One acquire is one lease (TTL = the kunci lease) and one key
//! `kunci/LEN:KEY/LEASEID` attached to it, valued with the owner. The
//! holder is the key with the lowest create revision under the key's
//! prefix; its create revision is the fencing token. A waiter watches only
//! the key just before its own. Every failure path removes the caller's
//! entry by revoking its lease.

use std::time::{Duration, Instant};

use super::http::{Answer, Failure, Members};
use super::json::{self, JsonValue};
use crate::client::engine::{Key, Outcome};
use crate::client::{KeyStatus, Unavailable};

/// The pause before a read that changes nothing is tried again.
const READ_RETRY_PAUSE: Duration = Duration::from_millis(50);

/// How long one attempt of a request that may be repeated (a read, a
/// revocation, a grant) waits for its answer before it is tried again on
/// another member, within the call's deadline. A healthy cluster answers
/// in milliseconds; an election takes about one election timeout (1 s by
/// default).
const ATTEMPT_LIMIT: Duration = Duration::from_secs(2);

/// The end of one attempt of a repeatable request.
fn attempt_until(deadline: Instant) -> Instant {
    deadline.min(Instant::now() + ATTEMPT_LIMIT)
}

/// How etcd answered a request that changes something.
enum Fault {
    /// Certainly not sent to any member: nothing changed.
    Unsent,
    /// Possibly sent and no usable answer: it may or may not have applied.
    Unknown,
}

impl Fault {
    fn outcome(self) -> Outcome {
        match self {
            Fault::Unsent => Outcome::Unavailable(Unavailable::Unreachable),
            Fault::Unknown => Outcome::Indeterminate,
        }
    }
}

/// The etcd error code for "not found" (gRPC `NotFound`): a lease that
/// expired or was revoked.
const CODE_NOT_FOUND: i64 = 5;

/// Where one kunci key's entries live: `kunci/LEN:KEY/`. The length makes
/// prefixes of different keys disjoint (key `a` and key `a/b` never share
/// one).
fn prefix(key: Key) -> String {
    let key = key.as_str();
    format!("kunci/{}:{key}/", key.len())
}

/// The first key after every key starting with `prefix` (its last byte,
/// `/`, plus one).
fn prefix_end(prefix: &str) -> String {
    let mut end = prefix.trim_end_matches('/').to_owned();
    end.push('0');
    end
}

/// A key-value pair as a range returns it.
struct Entry {
    name: Vec<u8>,
    create_revision: i64,
    lease: i64,
    value: Vec<u8>,
}

impl Entry {
    fn from_json(kv: &JsonValue) -> Option<Entry> {
        Some(Entry {
            name: json::bytes(kv, "key")?,
            create_revision: json::int(kv, "create_revision")?,
            lease: json::int(kv, "lease")?,
            value: json::bytes(kv, "value")?,
        })
    }

    fn owner(&self) -> u64 {
        std::str::from_utf8(&self.value)
            .ok()
            .and_then(|text| text.trim().parse().ok())
            .unwrap_or(0)
    }
}

/// The lowest entry of a range answer, and how many entries the range has.
fn first_entry(range: &JsonValue) -> Option<(Option<Entry>, i64)> {
    let count = json::int(range, "count")?;
    match json::array(range, "kvs").first() {
        Some(kv) => Some((Some(Entry::from_json(kv)?), count)),
        None => Some((None, count)),
    }
}

fn range_body(prefix: &str, limit: i64, order: &str, max_create_revision: i64) -> String {
    format!(
        r#"{{"key":"{}","range_end":"{}","limit":"{limit}","sort_target":"CREATE","sort_order":"{order}","max_create_revision":"{max_create_revision}"}}"#,
        json::base64(prefix.as_bytes()),
        json::base64(prefix_end(prefix).as_bytes()),
    )
}

/// The client's view of one etcd cluster.
pub(crate) struct Cluster {
    members: Members,
}

/// How a waiting acquire's turn check ended.
enum Turn {
    Holder,
    /// The entry just before ours, and the revision the check saw.
    Behind {
        predecessor: Vec<u8>,
        revision: i64,
    },
    /// Our own entry is gone (its lease ran out).
    Gone,
}

impl Cluster {
    pub(crate) fn new(members: Members) -> Cluster {
        Cluster { members }
    }

    pub(crate) fn endpoints(&self) -> &[String] {
        self.members.endpoints()
    }

    /// A request that changes something: sent at most once (rule 5), moved
    /// to another member only while certainly unsent (rule 4). An error
    /// answer is returned as such; the caller knows which are definitive.
    fn write(
        &self,
        path: &str,
        body: &str,
        deadline: Instant,
    ) -> Result<(Instant, JsonValue), Fault> {
        let answer = self
            .members
            .post(path, body, deadline)
            .map_err(|failure| match failure {
                Failure::Unsent => Fault::Unsent,
                Failure::Unanswered => Fault::Unknown,
            })?;
        let value = json::parse(&answer.body).ok_or(Fault::Unknown)?;
        Ok((answer.sent_at, value))
    }

    /// A request that changes nothing (a range, a status, a lease's time
    /// to live): tried again on any failure until `deadline`, since
    /// sending it twice is exactly as sending it once.
    fn read(
        &self,
        path: &str,
        body: &str,
        deadline: Instant,
    ) -> Result<(Instant, JsonValue), Fault> {
        let mut sent = false;
        loop {
            match self.members.post(path, body, attempt_until(deadline)) {
                Ok(Answer {
                    sent_at,
                    status: 200,
                    body,
                }) => {
                    if let Some(value) = json::parse(&body) {
                        return Ok((sent_at, value));
                    }
                    sent = true;
                }
                Ok(answer) => {
                    sent = true;
                    log::debug!(
                        "etcd {path}: status {}: {}",
                        answer.status,
                        String::from_utf8_lossy(&answer.body)
                    );
                }
                Err(Failure::Unanswered) => sent = true,
                Err(Failure::Unsent) => {}
            }
            pause_before_retry(deadline, sent)?;
        }
    }

    /// Revokes a lease, removing every key attached to it. Idempotent
    /// (a lease already gone counts as revoked), so tried until `deadline`.
    fn revoke(&self, lease: i64, deadline: Instant) -> Result<(), Fault> {
        let body = format!(r#"{{"ID":"{lease}"}}"#);
        let mut sent = false;
        loop {
            match self
                .members
                .post("/v3/lease/revoke", &body, attempt_until(deadline))
            {
                Ok(answer) if answer.status == 200 => return Ok(()),
                Ok(answer) => {
                    let code = json::parse(&answer.body).and_then(|v| json::int(&v, "code"));
                    if code == Some(CODE_NOT_FOUND) {
                        return Ok(());
                    }
                    sent = true;
                }
                Err(Failure::Unanswered) => sent = true,
                Err(Failure::Unsent) => {}
            }
            pause_before_retry(deadline, sent)?;
        }
    }

    /// Revokes a lease nobody waits for (compensation, clean-up), on its
    /// own thread so that the caller's answer is not delayed.
    pub(crate) fn revoke_in_background(self: &std::sync::Arc<Self>, lease: i64) {
        let cluster = self.clone();
        let spawned = std::thread::Builder::new()
            .name("kunci-etcd-revoke".into())
            .spawn(move || {
                let deadline = Instant::now() + crate::client::TRANSPORT_DEADLINE;
                if cluster.revoke(lease, deadline).is_err() {
                    log::warn!("could not revoke etcd lease {lease:x}; it runs out by itself");
                }
            });
        if let Err(error) = spawned {
            log::warn!("cannot revoke etcd lease {lease:x}: {error}; it runs out by itself");
        }
    }

    /// Grants a lease of `lease_s` seconds. A grant whose answer is lost
    /// leaves at most a lease with nothing attached, which runs out by
    /// itself, so a fresh grant is tried until `deadline`. `Err` only when
    /// none succeeded: nothing was acquired.
    /// The grant's send instant, the lease id, and the TTL etcd gave it (at
    /// least `lease_s`: etcd raises short ones to its minimum).
    fn grant(&self, lease_s: u8, deadline: Instant) -> Result<(Instant, i64, i64), Fault> {
        let body = format!(r#"{{"TTL":"{lease_s}"}}"#);
        loop {
            if let Ok((sent_at, value)) =
                self.write("/v3/lease/grant", &body, attempt_until(deadline))
                && let Some(id) = json::int(&value, "ID").filter(|id| *id != 0)
                && let Some(ttl) = json::int(&value, "TTL").filter(|ttl| *ttl >= lease_s.into())
            {
                return Ok((sent_at, id, ttl));
            }
            pause_before_retry(deadline, false)?;
        }
    }

    /// Renews `lease` by one keep-alive: `Ok(Some((sent_at, ttl)))` with
    /// the send instant of the attempt that was answered, `Ok(None)` if the
    /// lease no longer exists. A keep-alive only ever makes a lease end
    /// later, so an unanswered attempt is repeated, on the next member,
    /// until `deadline`: `Err(Unknown)` then if any attempt may have
    /// reached etcd, else `Err(Unsent)`.
    fn keep_alive(&self, lease: i64, deadline: Instant) -> Result<Option<(Instant, i64)>, Fault> {
        let body = format!(r#"{{"ID":"{lease}"}}"#);
        let mut sent = false;
        loop {
            match self.write("/v3/lease/keepalive", &body, attempt_until(deadline)) {
                Ok((sent_at, value)) => {
                    if let Some(result) = json::field(&value, "result")
                        && let Some(ttl) = json::int(result, "TTL")
                    {
                        return Ok((ttl > 0).then_some((sent_at, ttl)));
                    }
                    // An error answer (no leader yet, a timeout inside etcd).
                    sent = true;
                }
                Err(Fault::Unknown) => sent = true,
                Err(Fault::Unsent) => {}
            }
            pause_before_retry(deadline, sent)?;
        }
    }

    /// The holder's entry of `key` if its token (create revision) is
    /// `token`; else the outcome that ends the request: `NotHeld`, or what
    /// the read's fault makes of it.
    fn held_by(&self, key: Key, token: u64, deadline: Instant) -> Result<Entry, Outcome> {
        match self.holder(key, deadline) {
            Ok((Some(entry), _)) if entry.create_revision as u64 == token => Ok(entry),
            Ok(_) => Err(Outcome::NotHeld),
            Err(fault) => Err(fault.outcome()),
        }
    }

    /// The holder of `key` and how many entries its prefix has.
    fn holder(&self, key: Key, deadline: Instant) -> Result<(Option<Entry>, i64), Fault> {
        let (_, value) = self.read(
            "/v3/kv/range",
            &range_body(&prefix(key), 1, "ASCEND", 0),
            deadline,
        )?;
        first_entry(&value).ok_or(Fault::Unknown)
    }

    /// `A`: see the module docs and docs/ETCD.md.
    pub(crate) fn acquire(
        self: &std::sync::Arc<Self>,
        key: Key,
        owner: u64,
        lease_s: u8,
        wait_until: Option<Instant>,
        deadline: Instant,
    ) -> Outcome {
        let (set_at, lease, _) = match self.grant(lease_s, deadline) {
            Ok(granted) => granted,
            Err(fault) => return fault.outcome(),
        };
        let prefix = prefix(key);
        let name = format!("{prefix}{lease:016x}");
        let put = format!(
            r#"{{"request_put":{{"key":"{}","value":"{}","lease":"{lease}"}}}}"#,
            json::base64(name.as_bytes()),
            json::base64(owner.to_string().as_bytes()),
        );
        // Free → put (granted). Held → put too when the caller waits (it
        // joins the queue), nothing when it does not.
        let txn = format!(
            r#"{{"compare":[{{"key":"{}","range_end":"{}","target":"CREATE","result":"EQUAL","create_revision":"0"}}],"success":[{put}],"failure":[{}]}}"#,
            json::base64(prefix.as_bytes()),
            json::base64(prefix_end(&prefix).as_bytes()),
            if wait_until.is_some() {
                put.as_str()
            } else {
                ""
            },
        );
        let (succeeded, revision) = match self.write("/v3/kv/txn", &txn, deadline) {
            Ok((_, value)) => {
                let revision = json::field(&value, "header").and_then(|h| json::int(h, "revision"));
                match revision {
                    Some(revision) if revision > 0 => {
                        (json::boolean(&value, "succeeded"), revision)
                    }
                    // An error answer: whether it applied is unknown.
                    _ => {
                        self.revoke_in_background(lease);
                        return Outcome::Indeterminate;
                    }
                }
            }
            Err(fault) => {
                self.revoke_in_background(lease);
                return fault.outcome();
            }
        };
        if succeeded {
            return Outcome::Acquired {
                token: revision as u64,
                sent_at: set_at,
            };
        }
        let Some(wait_until) = wait_until else {
            // Held, and no wait: nothing was put; the lease is dropped.
            self.revoke_in_background(lease);
            return Outcome::Timeout;
        };
        self.wait_turn(
            key, name, revision, lease, lease_s, set_at, wait_until, deadline,
        )
    }

    /// Waits until the entry created at `revision` is the lowest of its
    /// prefix, keeping its lease alive meanwhile. At `wait_until` the
    /// entry is removed (its lease revoked): `Timeout`.
    #[allow(clippy::too_many_arguments)]
    fn wait_turn(
        self: &std::sync::Arc<Self>,
        key: Key,
        name: String,
        revision: i64,
        lease: i64,
        lease_s: u8,
        mut set_at: Instant,
        wait_until: Instant,
        deadline: Instant,
    ) -> Outcome {
        let lease_length = Duration::from_secs(lease_s.into());
        let keep_every = lease_length / 3;
        let mut next_keep_alive = set_at + keep_every;
        loop {
            let now = Instant::now();
            if now >= wait_until {
                return self.give_up(lease, deadline);
            }
            if now >= crate::client::valid_until(set_at, lease_length) {
                // The lease could not be kept alive: the entry may be gone.
                self.revoke_in_background(lease);
                return Outcome::Indeterminate;
            }
            if now >= next_keep_alive {
                match self.keep_alive(
                    lease,
                    wait_until.min(now + crate::client::TRANSPORT_DEADLINE),
                ) {
                    Ok(Some((sent_at, _))) => {
                        set_at = sent_at;
                        next_keep_alive = sent_at + keep_every;
                    }
                    Ok(None) => {
                        self.revoke_in_background(lease);
                        return Outcome::Indeterminate;
                    }
                    Err(_) => next_keep_alive = Instant::now() + READ_RETRY_PAUSE,
                }
                continue;
            }
            let turn = match self.turn(key, &name, revision, wait_until.min(next_keep_alive)) {
                Ok(turn) => turn,
                Err(_) => continue,
            };
            match turn {
                Turn::Holder => {
                    // The grant's lease starts now, as on a kunci server:
                    // one keep-alive, if time allows; else the last one
                    // still bounds it.
                    let by = deadline.min(Instant::now() + Duration::from_secs(1));
                    match self.keep_alive(lease, by) {
                        Ok(Some((sent_at, _))) => set_at = sent_at,
                        Ok(None) => {
                            self.revoke_in_background(lease);
                            return Outcome::Indeterminate;
                        }
                        Err(_) => {}
                    }
                    return Outcome::Acquired {
                        token: revision as u64,
                        sent_at: set_at,
                    };
                }
                Turn::Gone => {
                    self.revoke_in_background(lease);
                    return Outcome::Indeterminate;
                }
                Turn::Behind {
                    predecessor,
                    revision: seen,
                } => self.watch_deletion(
                    &predecessor,
                    seen.saturating_add(1),
                    wait_until.min(next_keep_alive),
                ),
            }
        }
    }

    /// Where the entry created at `revision` stands: one read-only
    /// transaction reads the entry just before it and the entry itself.
    fn turn(&self, key: Key, name: &str, revision: i64, deadline: Instant) -> Result<Turn, Fault> {
        let txn = format!(
            r#"{{"success":[{{"request_range":{}}},{{"request_range":{{"key":"{}"}}}}]}}"#,
            range_body(&prefix(key), 1, "DESCEND", revision - 1),
            json::base64(name.as_bytes()),
        );
        let (_, value) = self.read("/v3/kv/txn", &txn, deadline)?;
        let seen = json::field(&value, "header")
            .and_then(|h| json::int(h, "revision"))
            .ok_or(Fault::Unknown)?;
        let responses = json::array(&value, "responses");
        let ranges: Vec<&JsonValue> = responses
            .iter()
            .filter_map(|r| json::field(r, "response_range"))
            .collect();
        let [before, own] = ranges[..] else {
            return Err(Fault::Unknown);
        };
        let (own, _) = first_entry(own).ok_or(Fault::Unknown)?;
        if own.is_none_or(|own| own.create_revision != revision) {
            return Ok(Turn::Gone);
        }
        match first_entry(before).ok_or(Fault::Unknown)? {
            (None, _) => Ok(Turn::Holder),
            (Some(entry), _) => Ok(Turn::Behind {
                predecessor: entry.name,
                revision: seen,
            }),
        }
    }

    /// Blocks until `name` is deleted at or after `from_revision`, or
    /// until `until`, or until the watch breaks (the caller checks again).
    fn watch_deletion(&self, name: &[u8], from_revision: i64, until: Instant) {
        let body = format!(
            r#"{{"create_request":{{"key":"{}","start_revision":"{from_revision}","filters":["NOPUT"]}}}}"#,
            json::base64(name),
        );
        let Some(mut stream) = self.members.open_stream("/v3/watch", &body, until) else {
            let left = until.saturating_duration_since(Instant::now());
            std::thread::sleep(left.min(READ_RETRY_PAUSE));
            return;
        };
        loop {
            let message = match stream.next_message(until) {
                Ok(Some(message)) => message,
                Ok(None) => return,
                Err(error) => {
                    log::debug!("etcd watch broke: {error}");
                    let left = until.saturating_duration_since(Instant::now());
                    std::thread::sleep(left.min(READ_RETRY_PAUSE));
                    return;
                }
            };
            let Some(value) = json::parse(&message) else {
                return;
            };
            let Some(result) = json::field(&value, "result") else {
                // An error message on the stream.
                return;
            };
            if json::boolean(result, "canceled") || !json::array(result, "events").is_empty() {
                return;
            }
        }
    }

    /// The wait ran out: the caller's entry is removed (its lease revoked)
    /// before `Timeout` is said.
    fn give_up(&self, lease: i64, deadline: Instant) -> Outcome {
        match self.revoke(lease, deadline) {
            Ok(()) => Outcome::Timeout,
            Err(_) => Outcome::Indeterminate,
        }
    }

    /// `R`: a transaction that deletes the holder's entry only if its
    /// create revision is `token`, then the lease is revoked.
    pub(crate) fn release(
        self: &std::sync::Arc<Self>,
        key: Key,
        token: u64,
        deadline: Instant,
    ) -> Outcome {
        let entry = match self.held_by(key, token, deadline) {
            Ok(entry) => entry,
            Err(outcome) => return outcome,
        };
        let txn = format!(
            r#"{{"compare":[{{"key":"{name}","target":"CREATE","result":"EQUAL","create_revision":"{token}"}}],"success":[{{"request_delete_range":{{"key":"{name}"}}}}]}}"#,
            name = json::base64(&entry.name),
        );
        match self.write("/v3/kv/txn", &txn, deadline) {
            Ok((_, value)) if json::field(&value, "header").is_some() => {
                if json::boolean(&value, "succeeded") {
                    self.revoke_in_background(entry.lease);
                    Outcome::Released
                } else {
                    Outcome::NotHeld
                }
            }
            Ok(_) => Outcome::Indeterminate,
            Err(fault) => fault.outcome(),
        }
    }

    /// `E`: a keep-alive of the holder's lease when its length is
    /// `lease_s`, else a transaction that moves the entry to a new lease.
    pub(crate) fn renew(
        self: &std::sync::Arc<Self>,
        key: Key,
        token: u64,
        lease_s: u8,
        deadline: Instant,
    ) -> Outcome {
        let entry = match self.held_by(key, token, deadline) {
            Ok(entry) => entry,
            Err(outcome) => return outcome,
        };
        let (sent_at, ttl) = match self.keep_alive(entry.lease, deadline) {
            Ok(Some(renewed)) => renewed,
            Ok(None) => return Outcome::NotHeld,
            Err(fault) => return fault.outcome(),
        };
        if ttl == i64::from(lease_s) {
            // The lease was renewed; the entry must still be on it (a
            // release deletes the entry before it revokes the lease).
            let own = format!(r#"{{"key":"{}"}}"#, json::base64(&entry.name));
            return match self.read("/v3/kv/range", &own, deadline) {
                Ok((_, value)) => match first_entry(&value) {
                    Some((Some(now), _)) if now.create_revision as u64 == token => {
                        Outcome::Extended { sent_at }
                    }
                    Some(_) => Outcome::NotHeld,
                    None => Outcome::Indeterminate,
                },
                Err(_) => Outcome::Indeterminate,
            };
        }
        // A new length: a new lease, and the entry moved onto it only if it
        // still carries the token.
        let (moved_at, new_lease, new_ttl) = match self.grant(lease_s, deadline) {
            Ok(granted) => granted,
            Err(fault) => return fault.outcome(),
        };
        if new_ttl == ttl {
            // etcd raised both to its minimum TTL: the keep-alive did it.
            self.revoke_in_background(new_lease);
            return Outcome::Extended { sent_at };
        }
        let txn = format!(
            r#"{{"compare":[{{"key":"{name}","target":"CREATE","result":"EQUAL","create_revision":"{token}"}}],"success":[{{"request_put":{{"key":"{name}","value":"{}","lease":"{new_lease}"}}}}]}}"#,
            json::base64(&entry.value),
            name = json::base64(&entry.name),
        );
        match self.write("/v3/kv/txn", &txn, deadline) {
            Ok((_, value)) if json::field(&value, "header").is_some() => {
                if json::boolean(&value, "succeeded") {
                    self.revoke_in_background(entry.lease);
                    Outcome::Extended { sent_at: moved_at }
                } else {
                    self.revoke_in_background(new_lease);
                    Outcome::NotHeld
                }
            }
            // Whether the entry moved is unknown: neither lease may be
            // revoked (either may be the one holding it).
            Ok(_) => Outcome::Indeterminate,
            Err(fault) => fault.outcome(),
        }
    }

    /// `Q`: the holder's token and owner, its lease's time to live, and the
    /// number of entries behind it.
    pub(crate) fn query(&self, key: Key, deadline: Instant) -> Outcome {
        let (entry, count) = match self.holder(key, deadline) {
            Ok((Some(entry), count)) => (entry, count),
            Ok((None, _)) => return Outcome::Query(KeyStatus::default()),
            Err(fault) => return fault.outcome(),
        };
        let body = format!(r#"{{"ID":"{}"}}"#, entry.lease);
        let ttl = match self.read("/v3/kv/lease/timetolive", &body, deadline) {
            Ok((_, value)) => json::int(&value, "TTL").unwrap_or(0),
            Err(fault) => return fault.outcome(),
        };
        Outcome::Query(KeyStatus {
            token: entry.create_revision as u64,
            owner: entry.owner(),
            lease_ms: u32::try_from(ttl.max(0).saturating_mul(1000)).unwrap_or(u32::MAX),
            waiters: u32::try_from(count.saturating_sub(1)).unwrap_or(0),
        })
    }

    /// `I`: the answering member's status as `name=value` pairs.
    pub(crate) fn info(&self, deadline: Instant) -> Outcome {
        match self.read("/v3/maintenance/status", "{}", deadline) {
            Ok((_, value)) => {
                let header = json::field(&value, "header");
                let revision = header.and_then(|h| json::int(h, "revision")).unwrap_or(0);
                let member = header.and_then(|h| json::uint(h, "member_id")).unwrap_or(0);
                Outcome::Info(format!(
                    "backend=etcd version={} members={} member={:x} leader={:x} raft_term={} revision={revision} db_size={}",
                    json::text(&value, "version"),
                    self.endpoints().len(),
                    member,
                    json::uint(&value, "leader").unwrap_or(0),
                    json::int(&value, "raftTerm").unwrap_or(0),
                    json::int(&value, "dbSize").unwrap_or(0),
                ))
            }
            Err(fault) => fault.outcome(),
        }
    }

    /// `P`: one status request's round trip.
    pub(crate) fn ping(&self, deadline: Instant) -> Outcome {
        match self.read("/v3/maintenance/status", "{}", deadline) {
            Ok((sent_at, _)) => Outcome::Pong {
                round_trip: sent_at.elapsed(),
            },
            Err(fault) => fault.outcome(),
        }
    }
}

/// Waits before the next attempt of a repeatable request, or ends it at
/// `deadline` with the fault its attempts earned: `Unknown` once any of
/// them may have reached etcd, else `Unsent`.
fn pause_before_retry(deadline: Instant, sent: bool) -> Result<(), Fault> {
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return Err(if sent { Fault::Unknown } else { Fault::Unsent });
    }
    std::thread::sleep(left.min(READ_RETRY_PAUSE));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefixes_of_different_keys_never_overlap() {
        let a = prefix(Key::new("a").unwrap());
        let ab = prefix(Key::new("a/b").unwrap());
        assert_eq!(a, "kunci/1:a/");
        assert_eq!(ab, "kunci/3:a/b/");
        assert!(!ab.starts_with(&a) && !a.starts_with(&ab));
        assert_eq!(prefix_end(&a), "kunci/1:a0");
        assert!(format!("{a}{:016x}", 7u64) < prefix_end(&a));
    }
}
