//! The lock recipe on etcd (docs/ETCD.md): each kunci request as etcd
//! requests, with the outcomes and rules of spec §8.
//!
//! One acquire is one lease (TTL = the kunci lease) and one key
//! `kunci/LEN:KEY/LEASEID` attached to it, valued with the owner and, for
//! permits (spec §10), the limit, take and label ([`Claim::value`]). With
//! the entries in create-revision order, an entry holds when it and every
//! earlier entry fit (§10.3 as a prefix sum: [`judge`]); its create
//! revision is the fencing token. A waiter watches only earlier entries,
//! and only as many as must go before it can fit ([`Verdict::Waits`]).
//! Every failure path removes the caller's entry by revoking its lease.
//!
//! In etcd's own layout (`?layout=etcd`, [`EtcdLayout::Etcd`]) the same
//! recipe runs on etcd's `client/v3/concurrency` keys: the entry is
//! `KEY/` + the lease id in lowercase hex, its value the label alone, and
//! every entry is exclusive, so the holder is the first entry and a waiter
//! watches the entry just before its own, as `concurrency.Mutex` does.

use std::collections::BTreeMap;
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use super::http::{Answer, Failure, Members};
use super::json::{self, JsonValue};
use crate::addr::EtcdLayout;
use crate::client::vocabulary::{
    Denied, Grant, HOLDERS_MAX, Holders, Key, KeyPage, KeyState, KeyStatus, KeySummary, Outcome,
    Seen, TRANSPORT_DEADLINE, Unavailable, Waiter, valid_until,
};

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
    /// etcd refused the client's user or its permissions: nothing applied.
    Denied(Denied),
}

impl Fault {
    fn outcome(self) -> Outcome {
        match self {
            Fault::Unsent => Outcome::Unavailable(Unavailable::Unreachable),
            Fault::Unknown => Outcome::Indeterminate,
            Fault::Denied(why) => Outcome::PermissionDenied(why),
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
/// `/`, plus one). Only that one `/`: in etcd's layout a key that ends
/// with `/` itself would otherwise take in other keys' entries.
fn prefix_end(prefix: &str) -> String {
    let mut end = prefix.strip_suffix('/').unwrap_or(prefix).to_owned();
    end.push('0');
    end
}

/// A key-value pair as a range returns it, and the layout that reads its
/// value.
#[derive(Debug, PartialEq, Eq)]
struct Entry {
    name: Vec<u8>,
    create_revision: i64,
    lease: i64,
    value: Vec<u8>,
    layout: EtcdLayout,
}

impl Entry {
    fn from_json(kv: &JsonValue, layout: EtcdLayout) -> Option<Entry> {
        Some(Entry {
            name: json::bytes(kv, "key")?,
            create_revision: json::int(kv, "create_revision")?,
            lease: json::int(kv, "lease")?,
            value: json::bytes(kv, "value")?,
            layout,
        })
    }

    /// In etcd's layout the value is the holder's alone: owner 0.
    fn owner(&self) -> u64 {
        match self.layout {
            EtcdLayout::Kunci => decode(&self.value).0,
            EtcdLayout::Etcd => 0,
        }
    }

    /// In etcd's layout every entry is exclusive, whatever its value.
    fn slot(&self) -> Slot {
        match self.layout {
            EtcdLayout::Kunci => decode(&self.value).1,
            EtcdLayout::Etcd => Slot::EXCLUSIVE,
        }
    }

    /// The label its acquire stored (empty when none), byte for byte; in
    /// etcd's layout the value up to its first newline (empty when it is
    /// not UTF-8), as a label has none.
    fn label(&self) -> String {
        match self.layout {
            EtcdLayout::Kunci => decode_label(&self.value).to_owned(),
            EtcdLayout::Etcd => std::str::from_utf8(first_line(&self.value))
                .unwrap_or_default()
                .to_owned(),
        }
    }
}

/// The largest label (spec §11.1).
const LABEL_LEN_MAX: usize = 128;

/// What one acquire asks for (spec §10.1): `limit` 0 names no limit,
/// `take` 0 takes every permit (exclusive), `label` says who asks;
/// `campaign`: its entry stores its grant time once it holds (spec
/// §13.6, [`Claim::campaign_value`]). The default is `A`'s: no limit,
/// exclusive, no label, no campaign.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Claim {
    pub(crate) limit: u16,
    pub(crate) take: u16,
    pub(crate) label: String,
    pub(crate) campaign: bool,
}

impl Claim {
    /// Why the claim is invalid (spec §10.1, §11.1), if it is.
    fn invalid(&self) -> Option<&'static str> {
        if self.take > self.limit {
            return Some("take is more than the limit");
        }
        if self.label.len() > LABEL_LEN_MAX {
            return Some("label is longer than 128 bytes");
        }
        if self.label.contains('\n') {
            return Some("label contains a newline");
        }
        None
    }

    /// `A` exactly: mismatch is impossible and it fits only alone.
    fn is_plain(&self) -> bool {
        self.limit == 0 && self.take == 0
    }

    /// The entry's value (docs/ETCD.md, "The value"): the owner alone,
    /// as every earlier version wrote it, when the claim is `A`'s (no
    /// limit, exclusive, no label); else `OWNER LIMIT TAKE`, then ` LABEL`
    /// when there is one. All numbers decimal, single spaces; the label
    /// is the rest of the value and may contain spaces.
    fn value(&self, owner: u64) -> String {
        match (self.is_plain(), self.label.is_empty()) {
            (true, true) => owner.to_string(),
            (_, true) => format!("{owner} {} {}", self.limit, self.take),
            (_, false) => format!("{owner} {} {} {}", self.limit, self.take, self.label),
        }
    }

    /// For a campaign with a label (a campaign always has one), its
    /// [`value`](Self::value), to which its entry adds the grant time
    /// once it holds ([`granted_value`]).
    fn campaign_value(&self, owner: u64) -> Option<String> {
        (self.campaign && !self.label.is_empty()).then(|| self.value(owner))
    }

    fn slot(&self) -> Slot {
        Slot {
            limit: self.limit,
            take: self.take,
        }
    }
}

/// The longest a campaign's hand-over waits for its grant time to be
/// written ([`Cluster::stamp`]): min(1 s, lease/4).
fn stamp_limit(lease_s: u8) -> Duration {
    Duration::from_secs(1).min(Duration::from_secs(lease_s.into()) / 4)
}

/// A campaign's value with its grant time, now: the trailer
/// `\ngranted_ms=MS`, wall-clock milliseconds since the Unix epoch
/// ([`granted_ms`]; 0 for a clock before it).
fn granted_value(value: &str) -> String {
    format!("{value}\ngranted_ms={}", wall_clock_ms())
}

/// Now on the wall clock, in milliseconds since the Unix epoch (0 before
/// it).
fn wall_clock_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |since| {
            u64::try_from(since.as_millis()).unwrap_or(u64::MAX)
        })
}

/// A value's first line: `OWNER[ LIMIT TAKE[ LABEL]]`. A label has no
/// newline, so what follows one is the trailer ([`granted_ms`]).
fn first_line(value: &[u8]) -> &[u8] {
    value
        .iter()
        .position(|byte| *byte == b'\n')
        .map_or(value, |end| &value[..end])
}

/// The wall-clock grant time (ms since the Unix epoch) a campaign stored
/// in its entry ([`granted_value`]), if any: the value's lines
/// after the first are `NAME=VALUE` fields, unknown names ignored; this
/// is `granted_ms` with 1..=19 decimal digits. Peer input: never panics.
fn granted_ms(value: &[u8]) -> Option<u64> {
    value.split(|byte| *byte == b'\n').skip(1).find_map(|line| {
        let digits = line.strip_prefix(b"granted_ms=")?;
        if digits.is_empty() || digits.len() > 19 || !digits.iter().all(u8::is_ascii_digit) {
            return None;
        }
        std::str::from_utf8(digits).ok()?.parse().ok()
    })
}

/// An entry as the fit rule sees it: its limit (0: none) and take (0:
/// exclusive).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Slot {
    limit: u16,
    take: u16,
}

impl Slot {
    const EXCLUSIVE: Slot = Slot { limit: 0, take: 0 };
}

/// The owner and slot of an entry's value ([`Claim::value`]). A value
/// that cannot be read (another tool wrote it, or a future format) counts
/// as exclusive with no limit: it blocks while it is there and never lets
/// anyone overcommit. Peer input: never panics.
fn decode(value: &[u8]) -> (u64, Slot) {
    let Ok(text) = std::str::from_utf8(first_line(value)) else {
        return (0, Slot::EXCLUSIVE);
    };
    if let Ok(owner) = text.trim().parse() {
        // The owner alone, as `A` writes it (an old client trimmed too).
        return (owner, Slot::EXCLUSIVE);
    }
    let mut fields = text.splitn(4, ' ');
    let owner = fields.next().and_then(|owner| owner.parse().ok());
    let owner_or_0 = owner.unwrap_or(0);
    let (Some(limit), Some(take)) = (fields.next(), fields.next()) else {
        return (owner_or_0, Slot::EXCLUSIVE);
    };
    match (owner, limit.parse::<u16>(), take.parse::<u16>()) {
        (Some(_), Ok(limit), Ok(take)) if take <= limit => (owner_or_0, Slot { limit, take }),
        _ => (owner_or_0, Slot::EXCLUSIVE),
    }
}

/// The label of an entry's value ([`Claim::value`]): the rest after
/// `OWNER LIMIT TAKE `, when those three are valid; else empty. Peer
/// input: never panics.
fn decode_label(value: &[u8]) -> &str {
    let Ok(text) = std::str::from_utf8(first_line(value)) else {
        return "";
    };
    let mut fields = text.splitn(4, ' ');
    let valid = fields
        .next()
        .is_some_and(|owner| owner.parse::<u64>().is_ok())
        && fields
            .next()
            .is_some_and(|limit| limit.parse::<u16>().is_ok())
        && fields
            .next()
            .is_some_and(|take| take.parse::<u16>().is_ok());
    match fields.next() {
        Some(label) if valid => label,
        _ => "",
    }
}

/// Where an entry stands, from the entries created before it.
#[derive(Debug, PartialEq, Eq)]
enum Verdict<'a> {
    /// Its limit differs from that of an earlier live entry, whose limit
    /// this is.
    Mismatch { limit: u16 },
    /// It and every earlier entry fit: it holds, for as long as it lives.
    Holds,
    /// It cannot fit while every one of these earlier entries lives: its
    /// wake set. Only their deletion can change the verdict.
    Waits { wake: Vec<&'a Entry> },
}

/// Spec §10.3–4 on etcd. `earlier` are the entries created before the
/// judged one, the latest first (`DESCEND` by create revision). With
/// `check_limit`, `earlier` must be all of them.
///
/// An entry holds when it and every earlier entry fit. For an exclusive
/// entry that is "no earlier entry". For a counted one it is "no earlier
/// exclusive entry, and the earlier takes plus its own ≤ its limit": the
/// earlier entries' prefix sums are smaller, so they fit too. Nobody
/// overtakes: an earlier entry that does not fit makes every later one
/// not fit.
///
/// The wake set of an entry that does not hold is one sufficient reason:
/// the latest earlier entry for an exclusive one; for a counted one the
/// latest earlier exclusive entry, or else the latest earlier entries
/// whose takes alone leave no room for its own. Those are the entries
/// that FIFO removes last, so a waiter wakes late and seldom.
fn judge(own: Slot, earlier: &[Entry], check_limit: bool) -> Verdict<'_> {
    if check_limit && own.limit != 0 {
        let conflict = earlier
            .iter()
            .rev()
            .map(Entry::slot)
            .find(|slot| slot.limit != 0 && slot.limit != own.limit);
        if let Some(slot) = conflict {
            return Verdict::Mismatch { limit: slot.limit };
        }
    }
    let Some(latest) = earlier.first() else {
        return Verdict::Holds;
    };
    if own.take == 0 {
        return Verdict::Waits { wake: vec![latest] };
    }
    let room = u32::from(own.limit.saturating_sub(own.take));
    let mut used = 0u32;
    for (index, entry) in earlier.iter().enumerate() {
        let slot = entry.slot();
        if slot.take == 0 {
            return Verdict::Waits { wake: vec![entry] };
        }
        used += u32::from(slot.take);
        if used > room {
            return Verdict::Waits {
                wake: earlier[..=index].iter().collect(),
            };
        }
    }
    Verdict::Holds
}

/// How many entries hold, of a key's entries in create-revision order
/// (`ASCEND`): the longest prefix in which each fits ([`judge`]).
fn holders(entries: &[Entry]) -> usize {
    let mut used = 0u32;
    for (index, entry) in entries.iter().enumerate() {
        let slot = entry.slot();
        if index > 0 && slot.take == 0 {
            return index;
        }
        if slot.take == 0 {
            // An exclusive first entry holds alone.
            return 1;
        }
        used += u32::from(slot.take);
        if used > u32::from(slot.limit) {
            return index;
        }
    }
    entries.len()
}

/// An acquire that named a limit other than the key's (spec §10.2): the
/// entry was removed, nothing was acquired or queued. `limit` is the one
/// of the earliest live entry that disagreed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct LimitMismatch {
    pub(crate) limit: u16,
}

/// The lowest entry of a range answer, and how many entries the range has.
fn first_entry(range: &JsonValue, layout: EtcdLayout) -> Option<(Option<Entry>, i64)> {
    let count = json::int(range, "count")?;
    match json::array(range, "kvs").first() {
        Some(kv) => Some((Some(Entry::from_json(kv, layout)?), count)),
        None => Some((None, count)),
    }
}

/// Every entry of a range answer, in its order, read in `layout`.
fn entries(range: &JsonValue, layout: EtcdLayout) -> Option<Vec<Entry>> {
    json::array(range, "kvs")
        .iter()
        .map(|kv| Entry::from_json(kv, layout))
        .collect()
}

/// The `response_range`s of a transaction's answer, in order.
fn txn_ranges(answer: &JsonValue) -> Vec<&JsonValue> {
    json::array(answer, "responses")
        .iter()
        .filter_map(|response| json::field(response, "response_range"))
        .collect()
}

/// The revision in an answer's header; `None` (an error answer) if none.
fn header_revision(answer: &JsonValue) -> Option<i64> {
    json::field(answer, "header")
        .and_then(|header| json::int(header, "revision"))
        .filter(|revision| *revision > 0)
}

fn range_body(prefix: &str, limit: i64, order: &str, max_create_revision: i64) -> String {
    format!(
        r#"{{"key":"{}","range_end":"{}","limit":"{limit}","sort_target":"CREATE","sort_order":"{order}","max_create_revision":"{max_create_revision}"}}"#,
        json::base64(prefix.as_bytes()),
        json::base64(prefix_end(prefix).as_bytes()),
    )
}

/// A `/v3/watch` request from `from_revision` with one `filter`
/// (`NOPUT`, `NODELETE`; empty: none): on the entry named `name`, or with `prefix` on
/// every entry of a key (under its prefix).
fn watch_body(name: &[u8], prefix: Option<&str>, from_revision: i64, filter: &str) -> String {
    let range = match prefix {
        Some(prefix) => {
            format!(
                r#""key":"{}","range_end":"{}""#,
                json::base64(prefix.as_bytes()),
                json::base64(prefix_end(prefix).as_bytes()),
            )
        }
        None => format!(r#""key":"{}""#, json::base64(name)),
    };
    // An empty filter: every event (a proclaim's put as well as a delete).
    let filters = if filter.is_empty() {
        String::new()
    } else {
        format!(r#","filters":["{filter}"]"#)
    };
    format!(r#"{{"create_request":{{{range},"start_revision":"{from_revision}"{filters}}}}}"#)
}

/// Where every kunci key's entries live: the prefix [`prefix`] puts
/// before `LEN:KEY/`, and the first key after all of them.
const ROOT: &str = "kunci/";
const ROOT_END: &str = "kunci0";

/// The kunci key an entry's name belongs to (`kunci/LEN:KEY/LEASEID`
/// gives `KEY`), and the name's end of its prefix; `None` for a name
/// kunci did not write.
fn key_of(name: &[u8]) -> Option<&str> {
    let rest = name.strip_prefix(ROOT.as_bytes())?;
    let colon = rest.iter().position(|byte| *byte == b':')?;
    let len: usize = std::str::from_utf8(&rest[..colon]).ok()?.parse().ok()?;
    let key = rest.get(colon + 1..colon + 1 + len)?;
    if rest.get(colon + 1 + len) != Some(&b'/') {
        return None;
    }
    std::str::from_utf8(key).ok()
}

/// How many listing cursors one client remembers (docs/ETCD.md, "Who
/// holds it"): the oldest is forgotten beyond this.
const CURSORS_MAX: usize = 1024;

/// The listing cursors handed out on etcd: `L`'s cursor is a number, the
/// place in etcd's key space is a key, so the client keeps the key and
/// hands out a number for it (never 0, which starts a listing).
#[derive(Default)]
struct Cursors {
    issued: u64,
    open: BTreeMap<u64, Vec<u8>>,
}

impl Cursors {
    fn issue(&mut self, resume_at: Vec<u8>) -> u64 {
        self.issued += 1;
        self.open.insert(self.issued, resume_at);
        while self.open.len() > CURSORS_MAX {
            self.open.pop_first();
        }
        self.issued
    }
}

/// The client's view of one etcd cluster.
pub(crate) struct Cluster {
    members: Members,
    cursors: Mutex<Cursors>,
    layout: EtcdLayout,
}

/// What etcd's layout refuses before anything is sent: what its recipe
/// cannot express.
const EXCLUSIVE_ONLY: &str =
    "etcd's layout (?layout=etcd) has exclusive locks only: no limit, take or shared";
const NO_LISTING: &str =
    "etcd's layout (?layout=etcd) cannot list keys: its locks are anywhere in etcd's keys";
const RESERVED_NAME: &str = "etcd's layout (?layout=etcd) refuses kunci and kunci/…: kunci's own layout keeps its locks there";

/// How a waiting acquire's turn check ended.
enum Turn {
    Holder,
    /// The names of the entries whose deletion may let ours hold (its
    /// wake set, [`Verdict::Waits`]), and the revision the check saw.
    Behind {
        wake: Vec<Vec<u8>>,
        revision: i64,
    },
    /// Our own entry is gone (its lease ran out).
    Gone,
}

/// A waiting acquire's entry: its key, name, create revision and slot;
/// for a campaign, its value without the grant time
/// ([`Claim::campaign_value`]).
struct Place {
    key: Key,
    name: String,
    revision: i64,
    slot: Slot,
    campaign_value: Option<String>,
}

impl Cluster {
    pub(crate) fn new(members: Members) -> Cluster {
        Cluster {
            members,
            cursors: Mutex::default(),
            layout: EtcdLayout::Kunci,
        }
    }

    /// The cluster in `layout` (`?layout=`).
    pub(crate) fn with_layout(mut self, layout: EtcdLayout) -> Cluster {
        self.layout = layout;
        self
    }

    /// Why this layout refuses `key` before anything is sent, if it does.
    /// In etcd's layout the entries of `kunci` and `kunci/…` would lie
    /// among kunci's layout's (`kunci/LEN:KEY/…`): a lock there would wait
    /// for, or be read as, the other layout's entries.
    pub(crate) fn refuses_key(&self, key: Key) -> Option<&'static str> {
        let name = key.as_str();
        (self.layout == EtcdLayout::Etcd && (name == "kunci" || name.starts_with("kunci/")))
            .then_some(RESERVED_NAME)
    }

    /// Where a key's entries live: [`prefix`], or in etcd's layout `KEY/`
    /// (as `concurrency.Mutex` and `Election` name them).
    fn prefix(&self, key: Key) -> String {
        match self.layout {
            EtcdLayout::Kunci => prefix(key),
            EtcdLayout::Etcd => key.as_str().to_owned() + "/",
        }
    }

    /// An entry's name: the prefix and its lease id in hex (in etcd's
    /// layout lowercase and unpadded, as Go's `fmt.Sprintf("%s%x")`).
    fn entry_name(&self, prefix: &str, lease: i64) -> String {
        let width = match self.layout {
            EtcdLayout::Kunci => 16,
            EtcdLayout::Etcd => 0,
        };
        format!("{prefix}{lease:0width$x}")
    }

    /// Every entry of a range answer ([`entries`]), read in this layout.
    fn entries(&self, range: &JsonValue) -> Option<Vec<Entry>> {
        entries(range, self.layout)
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
                Failure::Denied(why) => Fault::Denied(why),
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
                Err(Failure::Denied(why)) => return Err(Fault::Denied(why)),
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
                Err(Failure::Denied(why)) => return Err(Fault::Denied(why)),
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
                let deadline = Instant::now() + TRANSPORT_DEADLINE;
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
            let answer = self.write("/v3/lease/grant", &body, attempt_until(deadline));
            if let Err(denied @ Fault::Denied(_)) = answer {
                return Err(denied);
            }
            if let Ok((sent_at, value)) = answer
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
                Err(denied @ Fault::Denied(_)) => return Err(denied),
            }
            pause_before_retry(deadline, sent)?;
        }
    }

    /// The entry of `key` whose create revision is `token`, if it holds;
    /// else the outcome that ends the request: `NotHeld`, or what the
    /// read's fault makes of it. One read: that entry and every earlier
    /// one (normally only grants: waiters come after).
    fn held_by(&self, key: Key, token: u64, deadline: Instant) -> Result<Entry, Outcome> {
        let Ok(token_revision) = i64::try_from(token) else {
            return Err(Outcome::NotHeld);
        };
        let read = self.read(
            "/v3/kv/range",
            &range_body(&self.prefix(key), 0, "DESCEND", token_revision),
            deadline,
        );
        let mut found = match read {
            Ok((_, value)) => self.entries(&value).ok_or(Outcome::Indeterminate)?,
            Err(fault) => return Err(fault.outcome()),
        };
        match found.first() {
            Some(own)
                if own.create_revision == token_revision
                    && judge(own.slot(), &found[1..], false) == Verdict::Holds =>
            {
                Ok(found.swap_remove(0))
            }
            _ => Err(Outcome::NotHeld),
        }
    }

    /// `A`, and `S` with `claim`: see the module docs and docs/ETCD.md.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn acquire(
        self: &std::sync::Arc<Self>,
        key: Key,
        owner: u64,
        claim: &Claim,
        lease_s: u8,
        wait_until: Option<Instant>,
        deadline: Instant,
    ) -> Result<Outcome, LimitMismatch> {
        if let Some(why) = claim.invalid() {
            return Ok(Outcome::Invalid(why));
        }
        if self.layout == EtcdLayout::Etcd && !claim.is_plain() {
            return Ok(Outcome::Invalid(EXCLUSIVE_ONLY));
        }
        let (set_at, lease, _) = match self.grant(lease_s, deadline) {
            Ok(granted) => granted,
            Err(fault) => return Ok(fault.outcome()),
        };
        let prefix = self.prefix(key);
        let name = self.entry_name(&prefix, lease);
        let put_valued = |value: &str| {
            format!(
                r#"{{"request_put":{{"key":"{}","value":"{}","lease":"{lease}"}}}}"#,
                json::base64(name.as_bytes()),
                json::base64(value.as_bytes()),
            )
        };
        // etcd's layout stores the label alone (a Mutex writes "", an
        // Election its value): there is no room for a grant time.
        let (put, campaign_value) = match self.layout {
            EtcdLayout::Kunci => (put_valued(&claim.value(owner)), claim.campaign_value(owner)),
            EtcdLayout::Etcd => (put_valued(&claim.label), None),
        };
        // A campaign's put that is a grant (the key is free) carries the
        // grant time; a queued entry gets it when it is granted (`stamp`).
        let put_granted = match &campaign_value {
            Some(value) => put_valued(&granted_value(value)),
            None => put.clone(),
        };
        // The entries before ours, the latest first. `A` needs only
        // whether there is one and which (it can only mismatch nothing);
        // the rest need them all (the limit, the sum of takes).
        let earlier = format!(
            r#"{{"request_range":{}}}"#,
            range_body(&prefix, i64::from(claim.is_plain()), "DESCEND", 0)
        );
        // Free → put (granted). Held → read the entries (in the same
        // transaction, before the put: exactly the earlier ones) and, when
        // the caller waits, put too (it joins the queue). `A` without a
        // wait needs nothing read: a held key is `Timeout`.
        let failure = match (wait_until.is_some(), claim.is_plain()) {
            (true, _) => format!("{earlier},{put}"),
            (false, false) => earlier.clone(),
            (false, true) => String::new(),
        };
        let txn = format!(
            r#"{{"compare":[{{"key":"{}","range_end":"{}","target":"CREATE","result":"EQUAL","create_revision":"0"}}],"success":[{put_granted}],"failure":[{failure}]}}"#,
            json::base64(prefix.as_bytes()),
            json::base64(prefix_end(&prefix).as_bytes()),
        );
        let mut answer = match self.write("/v3/kv/txn", &txn, deadline) {
            Ok((_, value)) => value,
            Err(fault) => {
                self.revoke_in_background(lease);
                return Ok(fault.outcome());
            }
        };
        loop {
            let Some(revision) = header_revision(&answer) else {
                // An error answer: whether it applied is unknown.
                self.revoke_in_background(lease);
                return Ok(Outcome::Indeterminate);
            };
            if json::boolean(&answer, "succeeded") {
                return Ok(Outcome::Acquired {
                    token: revision as u64,
                    sent_at: set_at,
                });
            }
            if wait_until.is_none() && claim.is_plain() {
                // Held, and no wait: nothing was put; the lease is dropped.
                self.revoke_in_background(lease);
                return Ok(Outcome::Timeout);
            }
            let snapshot = txn_ranges(&answer)
                .first()
                .and_then(|range| self.entries(range));
            let Some(snapshot) = snapshot else {
                self.revoke_in_background(lease);
                return Ok(Outcome::Indeterminate);
            };
            let verdict = judge(claim.slot(), &snapshot, !claim.is_plain());
            let Some(wait_until) = wait_until else {
                // Nothing was put. Where it would fit, put it now unless an
                // entry was created since the read: the entries can only
                // have gone, which never makes it fit less.
                match verdict {
                    Verdict::Holds => {}
                    Verdict::Mismatch { limit } => {
                        self.revoke_in_background(lease);
                        return Err(LimitMismatch { limit });
                    }
                    Verdict::Waits { .. } => {
                        self.revoke_in_background(lease);
                        return Ok(Outcome::Timeout);
                    }
                }
                let txn = format!(
                    r#"{{"compare":[{{"key":"{}","range_end":"{}","target":"CREATE","result":"LESS","create_revision":"{}"}}],"success":[{put_granted}],"failure":[{earlier}]}}"#,
                    json::base64(prefix.as_bytes()),
                    json::base64(prefix_end(&prefix).as_bytes()),
                    revision + 1,
                );
                answer = match self.write("/v3/kv/txn", &txn, deadline) {
                    Ok((_, value)) => value,
                    Err(fault) => {
                        self.revoke_in_background(lease);
                        return Ok(fault.outcome());
                    }
                };
                continue;
            };
            // Our entry is in the queue, created at `revision`.
            let place = Place {
                key,
                name,
                revision,
                slot: claim.slot(),
                campaign_value,
            };
            return match verdict {
                Verdict::Holds => {
                    self.stamp(&place, lease, lease_s, deadline);
                    Ok(Outcome::Acquired {
                        token: revision as u64,
                        sent_at: set_at,
                    })
                }
                Verdict::Mismatch { limit } => match self.revoke(lease, deadline) {
                    Ok(()) => Err(LimitMismatch { limit }),
                    Err(_) => Ok(Outcome::Indeterminate),
                },
                Verdict::Waits { wake } => {
                    let wake = wake.into_iter().map(|entry| entry.name.clone()).collect();
                    Ok(self.wait_turn(
                        place,
                        (wake, revision),
                        lease,
                        lease_s,
                        set_at,
                        wait_until,
                        deadline,
                    ))
                }
            };
        }
    }

    /// Waits until the entry at `place` holds, keeping its lease alive
    /// meanwhile; `first` is the wake set and revision of the check that
    /// queued it. At `wait_until` the entry is removed (its lease
    /// revoked): `Timeout`.
    #[allow(clippy::too_many_arguments)]
    fn wait_turn(
        self: &std::sync::Arc<Self>,
        place: Place,
        first: (Vec<Vec<u8>>, i64),
        lease: i64,
        lease_s: u8,
        mut set_at: Instant,
        wait_until: Instant,
        deadline: Instant,
    ) -> Outcome {
        let lease_length = Duration::from_secs(lease_s.into());
        let keep_every = lease_length / 3;
        let mut next_keep_alive = set_at + keep_every;
        let mut known = Some(first);
        loop {
            let now = Instant::now();
            if now >= wait_until {
                return self.give_up(lease, deadline);
            }
            if now >= valid_until(set_at, lease_length) {
                // The lease could not be kept alive: the entry may be gone.
                self.revoke_in_background(lease);
                return Outcome::Indeterminate;
            }
            if now >= next_keep_alive {
                match self.keep_alive(lease, wait_until.min(now + TRANSPORT_DEADLINE)) {
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
            let turn = match known.take() {
                Some((wake, revision)) => Turn::Behind { wake, revision },
                None => match self.turn(&place, wait_until.min(next_keep_alive)) {
                    Ok(turn) => turn,
                    Err(_) => continue,
                },
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
                    self.stamp(&place, lease, lease_s, deadline);
                    return Outcome::Acquired {
                        token: place.revision as u64,
                        sent_at: set_at,
                    };
                }
                Turn::Gone => {
                    self.revoke_in_background(lease);
                    return Outcome::Indeterminate;
                }
                Turn::Behind { wake, revision } => self.watch_deletion(
                    &place,
                    &wake,
                    revision.saturating_add(1),
                    wait_until.min(next_keep_alive),
                ),
            }
        }
    }

    /// Where the entry at `place` stands: one read-only transaction reads
    /// the entries before it (the latest only, for an exclusive entry:
    /// it holds when there is none) and the entry itself.
    fn turn(&self, place: &Place, deadline: Instant) -> Result<Turn, Fault> {
        let exclusive = place.slot.take == 0;
        let txn = format!(
            r#"{{"success":[{{"request_range":{}}},{{"request_range":{{"key":"{}"}}}}]}}"#,
            range_body(
                &self.prefix(place.key),
                i64::from(exclusive),
                "DESCEND",
                place.revision - 1
            ),
            json::base64(place.name.as_bytes()),
        );
        let (_, value) = self.read("/v3/kv/txn", &txn, deadline)?;
        let seen = header_revision(&value).ok_or(Fault::Unknown)?;
        let [before, own] = txn_ranges(&value)[..] else {
            return Err(Fault::Unknown);
        };
        let (own, _) = first_entry(own, self.layout).ok_or(Fault::Unknown)?;
        if own.is_none_or(|own| own.create_revision != place.revision) {
            return Ok(Turn::Gone);
        }
        let before = self.entries(before).ok_or(Fault::Unknown)?;
        // The limit was checked when the entry was put; the earlier
        // entries can only have gone since.
        Ok(match judge(place.slot, &before, false) {
            Verdict::Holds => Turn::Holder,
            Verdict::Waits { wake } => Turn::Behind {
                wake: wake.into_iter().map(|entry| entry.name.clone()).collect(),
                revision: seen,
            },
            Verdict::Mismatch { .. } => return Err(Fault::Unknown),
        })
    }

    /// Blocks until one of the `wake` entries is deleted at or after
    /// `from_revision`, or until `until`, or until the watch breaks (the
    /// caller checks again in every case). One entry is watched by its
    /// key; several by one watch on the key's prefix, whose other deletions
    /// (later entries leaving) are read and ignored here: etcd cannot watch
    /// a set of keys that is not a range, nor select by create revision.
    fn watch_deletion(&self, place: &Place, wake: &[Vec<u8>], from_revision: i64, until: Instant) {
        let body = match wake {
            [one] => watch_body(one, None, from_revision, "NOPUT"),
            _ => watch_body(&[], Some(&self.prefix(place.key)), from_revision, "NOPUT"),
        };
        self.watch_until(&body, until, &|event_key| match event_key {
            Some(deleted) => deleted == place.name.as_bytes() || wake.contains(&deleted),
            // Unreadable: check again rather than miss it.
            None => true,
        });
    }

    /// Follows the watch `body` until an event for which `woken` (given
    /// the event's key, `None` when unreadable) is true, or until `until`,
    /// or until the watch breaks or cannot be opened (after a short pause
    /// then: the caller reads again in every case). The watch's connection
    /// is closed on return.
    fn watch_until(&self, body: &str, until: Instant, woken: &dyn Fn(Option<Vec<u8>>) -> bool) {
        // A watch that could not start, broke, or was refused: the caller
        // reads and watches again, after a pause (a gateway that refuses
        // every watch must not turn that into a busy loop).
        let pause = || {
            let left = until.saturating_duration_since(Instant::now());
            std::thread::sleep(left.min(READ_RETRY_PAUSE));
        };
        let Some(mut stream) = self.members.open_stream("/v3/watch", body, until) else {
            return pause();
        };
        loop {
            let message = match stream.next_message(until) {
                Ok(Some(message)) => message,
                Ok(None) => return,
                Err(error) => {
                    log::debug!("etcd watch broke: {error}");
                    return pause();
                }
            };
            // Unreadable, an error message on the stream, or cancelled.
            let Some(value) = json::parse(&message) else {
                return pause();
            };
            let Some(result) = json::field(&value, "result") else {
                return pause();
            };
            if json::boolean(result, "canceled") {
                return pause();
            }
            let woken = json::array(result, "events")
                .iter()
                .any(|event| woken(json::field(event, "kv").and_then(|kv| json::bytes(kv, "key"))));
            if woken {
                return;
            }
        }
    }

    /// Writes the grant time into the entry of a campaign granted after it
    /// was queued (what a leader's held_for reads): one put of the same
    /// value with the time, on the same lease, guarded by the entry's
    /// create revision and lease so that it never re-creates a released
    /// entry nor moves it back to a lease it left. Best effort, for at
    /// most min(1 s, lease/4) (the campaign's hand-over waits for it; a
    /// short lease must keep most of itself): without it the time is
    /// unknown, nothing else.
    fn stamp(&self, place: &Place, lease: i64, lease_s: u8, deadline: Instant) {
        let Some(value) = &place.campaign_value else {
            return;
        };
        let txn = format!(
            r#"{{"compare":[{{"key":"{name}","target":"CREATE","result":"EQUAL","create_revision":"{}"}},{{"key":"{name}","target":"LEASE","result":"EQUAL","lease":"{lease}"}}],"success":[{{"request_put":{{"key":"{name}","value":"{}","lease":"{lease}"}}}}]}}"#,
            place.revision,
            json::base64(granted_value(value).as_bytes()),
            name = json::base64(place.name.as_bytes()),
        );
        let by = deadline.min(Instant::now() + stamp_limit(lease_s));
        if self.write("/v3/kv/txn", &txn, by).is_err() {
            log::debug!("could not write the grant time of {}", place.revision);
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
                Ok((_, value)) => match first_entry(&value, self.layout) {
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

    /// `C` (spec §13.4a) on etcd: a put of the holder's own entry, guarded
    /// by its create revision (`token`), on the lease it has
    /// (`ignore_lease`), with `label` as its label. In kunci's layout the
    /// owner, limit, take and grant time stay; in etcd's the value is the
    /// label alone, as an `Election`'s `Proclaim` writes it. `NotHeld`
    /// when `token` does not hold `key`.
    pub(crate) fn proclaim(&self, key: Key, token: u64, label: &str, deadline: Instant) -> Outcome {
        let entry = match self.held_by(key, token, deadline) {
            Ok(entry) => entry,
            Err(outcome) => return outcome,
        };
        let value = match self.layout {
            EtcdLayout::Etcd => label.to_owned(),
            EtcdLayout::Kunci => {
                let (owner, slot) = decode(&entry.value);
                let claim = Claim {
                    limit: slot.limit,
                    take: slot.take,
                    label: label.to_owned(),
                    campaign: false,
                };
                let trailer = &entry.value[first_line(&entry.value).len()..];
                claim.value(owner) + &String::from_utf8_lossy(trailer)
            }
        };
        let txn = format!(
            r#"{{"compare":[{{"key":"{name}","target":"CREATE","result":"EQUAL","create_revision":"{token}"}}],"success":[{{"request_put":{{"key":"{name}","value":"{}","ignore_lease":true}}}}]}}"#,
            json::base64(value.as_bytes()),
            name = json::base64(&entry.name),
        );
        match self.write("/v3/kv/txn", &txn, deadline) {
            Ok((_, answer)) if json::field(&answer, "header").is_some() => {
                if json::boolean(&answer, "succeeded") {
                    Outcome::Proclaimed
                } else {
                    Outcome::NotHeld
                }
            }
            Ok(_) => Outcome::Indeterminate,
            Err(fault) => fault.outcome(),
        }
    }

    /// Every entry of `key` in create-revision order, in one read; the
    /// outcome to end the call with when that read fails.
    fn key_entries(&self, key: Key, deadline: Instant) -> Result<Vec<Entry>, Outcome> {
        match self.read(
            "/v3/kv/range",
            &range_body(&self.prefix(key), 0, "ASCEND", 0),
            deadline,
        ) {
            Ok((_, value)) => self.entries(&value).ok_or(Outcome::Indeterminate),
            Err(fault) => Err(fault.outcome()),
        }
    }

    /// `Q`: the grant with the smallest token (the first entry, which
    /// always holds), its owner and its lease's time to live, and the
    /// number of entries that do not hold (the queue). One read of every
    /// entry: which ones hold depends on all of them.
    pub(crate) fn query(&self, key: Key, deadline: Instant) -> Outcome {
        let all = match self.key_entries(key, deadline) {
            Ok(all) => all,
            Err(outcome) => return outcome,
        };
        let Some(entry) = all.first() else {
            return Outcome::Query(KeyStatus::default());
        };
        let queued = all.len() - holders(&all);
        let ttl = match self.time_to_live(entry.lease, deadline) {
            Ok(ttl) => ttl,
            Err(fault) => return fault.outcome(),
        };
        Outcome::Query(KeyStatus {
            token: entry.create_revision as u64,
            owner: entry.owner(),
            lease_ms: u32::try_from(ttl.max(0).saturating_mul(1000)).unwrap_or(u32::MAX),
            waiters: u32::try_from(queued).unwrap_or(u32::MAX),
        })
    }

    /// `O` (spec §13.1) on etcd: the key's state, whose token is the
    /// create revision of its first entry (the earliest grant; 0 when it
    /// has none), answered at once when that differs from `since` or the
    /// call does not wait; else followed with an etcd watch (not polling)
    /// until it differs, or what it shows besides the token differs from
    /// `seen` (the first read's, when the caller gives none): a proclaim,
    /// a grant time stamped after the grant; or the wait (`deadline` less
    /// the transport deadline) ends. The first entry can be replaced only
    /// by its own deletion (later entries come after it), so a held key's
    /// watch is on that entry (its deletion, and its puts: a proclaim, a
    /// stamp), and a free key's on a put under its prefix. A watch that
    /// breaks or cannot be opened (an outage) only sends it back to the
    /// read, which is retried until `deadline`.
    pub(crate) fn observe(
        &self,
        key: Key,
        since: u64,
        waits: bool,
        seen: Option<Seen>,
        deadline: Instant,
    ) -> Outcome {
        let mut seen = seen;
        let wait_until = deadline.checked_sub(TRANSPORT_DEADLINE).unwrap_or(deadline);
        let prefix = self.prefix(key);
        let range = range_body(&prefix, 0, "ASCEND", 0);
        loop {
            let value = match self.read("/v3/kv/range", &range, deadline) {
                Ok((_, value)) => value,
                Err(fault) => return fault.outcome(),
            };
            let (Some(found), Some(revision)) = (self.entries(&value), header_revision(&value))
            else {
                return Outcome::Indeterminate;
            };
            let state = key_state(&found);
            let shows = Seen::of(&state);
            let changed = *seen.get_or_insert(shows) != shows;
            if state.token != since || changed || !waits || Instant::now() >= wait_until {
                return Outcome::Observed(state);
            }
            let watch = match found.first() {
                Some(first) => watch_body(&first.name, None, revision.saturating_add(1), ""),
                None => watch_body(&[], Some(&prefix), revision.saturating_add(1), "NODELETE"),
            };
            self.watch_until(&watch, wait_until, &|_| true);
        }
    }

    /// The time to live of `lease` in whole seconds as etcd reports it
    /// (rounded down; -1 when the lease is gone).
    fn time_to_live(&self, lease: i64, deadline: Instant) -> Result<i64, Fault> {
        let body = format!(r#"{{"ID":"{lease}"}}"#);
        let (_, value) = self.read("/v3/kv/lease/timetolive", &body, deadline)?;
        Ok(json::int(&value, "TTL").unwrap_or(0))
    }

    /// `H` (spec §11.2) on etcd: one read of every entry in create-revision
    /// order; the prefix that fits holds ([`holders`]), the rest wait.
    /// Each grant's lease left is one `lease/timetolive`; a grant whose
    /// lease has under a second left or is gone (etcd deletes the entry
    /// within moments) is not listed, so an expired lease is never shown
    /// as held. etcd stores no wall time: time held and wait left are
    /// unknown and given as 0 (docs/ETCD.md, "Who holds it").
    pub(crate) fn holders(&self, key: Key, deadline: Instant) -> Outcome {
        let all = match self.key_entries(key, deadline) {
            Ok(all) => all,
            Err(outcome) => return outcome,
        };
        let (held, queued) = all.split_at(holders(&all));
        let mut grants = Vec::new();
        for entry in held.iter().take(HOLDERS_MAX) {
            let ttl = match self.time_to_live(entry.lease, deadline) {
                Ok(ttl) => ttl,
                Err(fault) => return fault.outcome(),
            };
            if ttl <= 0 {
                continue;
            }
            grants.push(Grant {
                token: entry.create_revision.max(0) as u64,
                owner: entry.owner(),
                take: entry.slot().take,
                lease_left: Duration::from_secs(ttl as u64),
                held_for: Duration::ZERO,
                label: entry.label(),
            });
        }
        let waiters = queued
            .iter()
            .take(HOLDERS_MAX)
            .map(|entry| Waiter {
                owner: entry.owner(),
                take: entry.slot().take,
                wait_left: Duration::ZERO,
                label: entry.label(),
            })
            .collect();
        let left_out =
            held.len().saturating_sub(HOLDERS_MAX) + queued.len().saturating_sub(HOLDERS_MAX);
        Outcome::Holders(Holders {
            grants,
            waiters,
            left_out: left_out as u64,
        })
    }

    /// `L` (spec §11.3) on etcd: one range read of at most `count`
    /// entries under `kunci/` in key order from the cursor's place,
    /// grouped by kunci key and filtered by `prefix` here, so a page has
    /// at most `count` keys and may have none before the end. A key whose
    /// entries the page cut off is read whole by a second range. The
    /// cursor names the etcd key after the page's last kunci key; it is
    /// kept by this client (docs/ETCD.md, "Who holds it").
    pub(crate) fn list(
        &self,
        prefix_key: Key,
        cursor: u64,
        count: u16,
        deadline: Instant,
    ) -> Outcome {
        if self.layout == EtcdLayout::Etcd {
            return Outcome::Invalid(NO_LISTING);
        }
        let start = if cursor == 0 {
            ROOT.as_bytes().to_vec()
        } else {
            let cursors = self.cursors.lock().unwrap_or_else(PoisonError::into_inner);
            match cursors.open.get(&cursor) {
                Some(start) => start.clone(),
                None => return Outcome::Invalid("unknown or forgotten listing cursor"),
            }
        };
        let body = format!(
            r#"{{"key":"{}","range_end":"{}","limit":"{count}"}}"#,
            json::base64(&start),
            json::base64(ROOT_END.as_bytes()),
        );
        let (page, more) = match self.read("/v3/kv/range", &body, deadline) {
            Ok((_, value)) => match self.entries(&value) {
                Some(page) => (page, json::boolean(&value, "more")),
                None => return Outcome::Indeterminate,
            },
            Err(fault) => return fault.outcome(),
        };
        // The next page starts after the last entry's name and after every
        // entry of its kunci key (kunci's own names always have one).
        let mut resume_at = page
            .last()
            .map(|entry| entry.name.clone())
            .unwrap_or_default();
        resume_at.push(0);
        if let Some(key) = page
            .last()
            .and_then(|entry| key_of(&entry.name))
            .and_then(|name| Key::new(name).ok())
        {
            resume_at = resume_at.max(prefix_end(&self.prefix(key)).into_bytes());
        }
        // Consecutive entries of one kunci key form a group.
        let mut groups: Vec<(String, Vec<Entry>)> = Vec::new();
        for entry in page {
            let Some(name) = key_of(&entry.name).map(str::to_owned) else {
                continue;
            };
            match groups.last_mut() {
                Some((last, group)) if *last == name => group.push(entry),
                _ => groups.push((name, vec![entry])),
            }
        }
        let mut keys = Vec::new();
        let group_count = groups.len();
        for (index, (name, mut group)) in groups.into_iter().enumerate() {
            if !name.starts_with(prefix_key.as_str()) {
                continue;
            }
            if more && index + 1 == group_count {
                // The page may have cut this key's entries: read them all.
                let Ok(key) = Key::new(&name) else { continue };
                group = match self.key_entries(key, deadline) {
                    Ok(all) => all,
                    Err(outcome) => return outcome,
                };
            }
            group.sort_by_key(|entry| entry.create_revision);
            if group.is_empty() {
                continue;
            }
            let grants = holders(&group);
            keys.push(KeySummary {
                key: name,
                grants: u32::try_from(grants).unwrap_or(u32::MAX),
                waiters: u32::try_from(group.len() - grants).unwrap_or(u32::MAX),
                limit: group
                    .iter()
                    .map(|entry| entry.slot().limit)
                    .find(|limit| *limit != 0)
                    .unwrap_or(0),
            });
        }
        let next = if more {
            self.cursors
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .issue(resume_at)
        } else {
            0
        };
        Outcome::Keys(KeyPage { keys, next })
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

/// The [`KeyState`] of a key's entries in create-revision order: the
/// first one's create revision and label, and its time held from the
/// grant time it stored (wall clock; unknown when it stored none: it was
/// not a campaign's, [`granted_ms`]). The lease left is not read (0).
fn key_state(found: &[Entry]) -> KeyState {
    let Some(first) = found.first() else {
        return KeyState {
            held_ms: Some(0),
            ..KeyState::default()
        };
    };
    let grants = holders(found);
    let held_ms = granted_ms(&first.value)
        .map(|granted| u32::try_from(wall_clock_ms().saturating_sub(granted)).unwrap_or(u32::MAX));
    KeyState {
        token: first.create_revision.max(0) as u64,
        lease_ms: 0,
        held_ms,
        grants: u16::try_from(grants).unwrap_or(u16::MAX),
        waiters: u32::try_from(found.len() - grants).unwrap_or(u32::MAX),
        label: first.label(),
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
#[path = "cluster_tests.rs"]
mod cluster_tests;

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

    #[test]
    fn etcds_layout_names_entries_as_go_does_and_reads_every_value_as_exclusive() {
        let members = || Members::new(vec!["127.0.0.1:1".into()], Duration::from_secs(1), None);
        let etcd = Cluster::new(members()).with_layout(EtcdLayout::Etcd);
        let kunci = Cluster::new(members());
        let key = Key::new("jobs/a/").unwrap();
        assert_eq!(etcd.prefix(key), "jobs/a//");
        assert_eq!(kunci.prefix(key), "kunci/7:jobs/a//");
        // Only the last `/` ends the range: `jobs/a/x/…` is not this key's.
        assert_eq!(prefix_end(&etcd.prefix(key)), "jobs/a/0");
        assert_eq!(etcd.entry_name("n/", 0x694d_8a3b_00c1), "n/694d8a3b00c1");
        assert_eq!(kunci.entry_name("n/", 0xc1), "n/00000000000000c1");
        let read = |value: &[u8]| Entry {
            value: value.to_vec(),
            layout: EtcdLayout::Etcd,
            ..entry(3, "")
        };
        for value in [&b""[..], b"7", b"7 5 1", b"7 3 2 db1"] {
            let entry = read(value);
            assert_eq!((entry.owner(), entry.slot()), (0, Slot::EXCLUSIVE));
            assert_eq!(entry.label().as_bytes(), value);
        }
        assert_eq!(read(b"db1:5432\ngranted_ms=1").label(), "db1:5432");
        assert_eq!(read(b"\xff").label(), "");
        // Every entry exclusive: the first holds alone, a waiter watches
        // the entry just before its own.
        let mut queue = vec![read(b"7 5 1"), read(b"8 5 1")];
        queue[1].create_revision = 4;
        assert_eq!(holders(&queue), 1);
        queue.reverse();
        assert_eq!(wake_revisions(judge(Slot::EXCLUSIVE, &queue, false)), [4]);
    }

    fn entry(revision: i64, value: &str) -> Entry {
        Entry {
            name: format!("kunci/1:k/{revision:016x}").into_bytes(),
            create_revision: revision,
            lease: revision,
            value: value.as_bytes().to_vec(),
            layout: EtcdLayout::Kunci,
        }
    }

    fn claim(limit: u16, take: u16, label: &str) -> Claim {
        Claim {
            limit,
            take,
            label: label.to_owned(),
            campaign: false,
        }
    }

    fn slot(limit: u16, take: u16) -> Slot {
        Slot { limit, take }
    }

    /// The earlier entries the latest first, as a `DESCEND` range gives
    /// them, from values in create order.
    fn queue(values: &[&str]) -> Vec<Entry> {
        let mut all: Vec<Entry> = (1..)
            .zip(values)
            .map(|(revision, value)| entry(revision, value))
            .collect();
        all.reverse();
        all
    }

    fn wake_revisions(verdict: Verdict<'_>) -> Vec<i64> {
        match verdict {
            Verdict::Waits { wake } => wake.iter().map(|e| e.create_revision).collect(),
            other => panic!("expected Waits, got {other:?}"),
        }
    }

    #[test]
    fn a_plain_acquire_writes_the_value_every_version_wrote() {
        assert_eq!(Claim::default().value(42), "42");
        assert_eq!(claim(0, 0, "").value(u64::MAX), u64::MAX.to_string());
        assert_eq!(claim(5, 0, "").value(7), "7 5 0");
        assert_eq!(claim(3, 2, "").value(7), "7 3 2");
        assert_eq!(claim(0, 0, "ops").value(7), "7 0 0 ops");
        assert_eq!(
            claim(65535, 1, "ann@db1 pid=9 backup --full").value(7),
            "7 65535 1 ann@db1 pid=9 backup --full"
        );
    }

    #[test]
    fn values_decode_and_an_unreadable_one_is_exclusive() {
        for (limit, take, label) in [(0, 0, ""), (3, 2, ""), (65535, 1, "a b  c "), (9, 0, "x")] {
            let value = claim(limit, take, label).value(12);
            assert_eq!(decode(value.as_bytes()), (12, slot(limit, take)), "{value}");
        }
        // Old values: the owner alone (an old client also trimmed).
        assert_eq!(decode(b"12"), (12, Slot::EXCLUSIVE));
        assert_eq!(decode(b" 12\n"), (12, Slot::EXCLUSIVE));
        // What another tool or a broken writer may leave: exclusive.
        for bad in [
            &b""[..],
            b"\xff\xfe",
            b"owner",
            b"12 3",
            b"12 3 4",
            b"12 0 1",
            b"12 65536 1",
            b"12 -1 0",
            b"x 3 1",
            b"12 3 x label",
        ] {
            assert_eq!(decode(bad).1, Slot::EXCLUSIVE, "{bad:?}");
        }
        assert_eq!(decode(b"12 3 4").0, 12);
    }

    #[test]
    fn a_campaign_s_stamp_waits_at_most_a_quarter_of_its_lease_and_1_s() {
        let ms = Duration::from_millis;
        assert_eq!(stamp_limit(1), ms(250));
        assert_eq!(stamp_limit(2), ms(500));
        assert_eq!(stamp_limit(3), ms(750));
        assert_eq!(stamp_limit(4), ms(1000));
        assert_eq!(stamp_limit(30), ms(1000));
        assert_eq!(stamp_limit(255), ms(1000));
    }

    #[test]
    fn a_campaign_s_grant_time_is_a_trailer_every_reader_skips() {
        let campaign = Claim {
            campaign: true,
            ..claim(0, 0, "db1 a b")
        };
        let base = campaign.campaign_value(7).unwrap();
        assert_eq!(base, "7 0 0 db1 a b");
        let before = wall_clock_ms();
        let value = granted_value(&base);
        let stored = granted_ms(value.as_bytes()).unwrap();
        assert!((before..=wall_clock_ms()).contains(&stored), "{value}");
        assert_eq!(value, format!("7 0 0 db1 a b\ngranted_ms={stored}"));
        assert_eq!(decode(value.as_bytes()), (7, Slot::EXCLUSIVE));
        assert_eq!(decode_label(value.as_bytes()), "db1 a b");
        // A lock or a campaign without a label stores no time.
        assert_eq!(claim(0, 0, "db1").campaign_value(7), None);
        let unlabelled = Claim {
            campaign: true,
            ..Claim::default()
        };
        assert_eq!(unlabelled.campaign_value(7), None);
        // Other fields are skipped; only 1..=19 digits count.
        assert_eq!(granted_ms(b"7 0 0 x\nother=1\ngranted_ms=12"), Some(12));
        for bad in [
            &b"7 0 0 x"[..],
            b"granted_ms=12",
            b"7 0 0 x\ngranted_ms=",
            b"7 0 0 x\ngranted_ms=-1",
            b"7 0 0 x\ngranted_ms=1 ",
            b"7 0 0 x\ngranted_ms=12345678901234567890",
            b"7 0 0 x\n\xffgranted_ms=1",
        ] {
            assert_eq!(granted_ms(bad), None, "{bad:?}");
        }
        assert_eq!(
            granted_ms(b"7 0 0 x\ngranted_ms=9999999999999999999"),
            Some(9_999_999_999_999_999_999)
        );
    }

    #[test]
    fn the_key_state_is_the_first_entry_s() {
        assert_eq!(key_state(&[]).token, 0);
        let now = wall_clock_ms();
        let mut first = entry(5, &format!("1 0 0 ann\ngranted_ms={}", now - 2_000));
        first.create_revision = 5;
        let all = [first, entry(6, "2 0 0 bob"), entry(7, "3")];
        let state = key_state(&all);
        assert_eq!(
            (
                state.token,
                state.label.as_str(),
                state.grants,
                state.waiters
            ),
            (5, "ann", 1, 2)
        );
        let held = state.held_ms.unwrap();
        assert!((2_000..3_000).contains(&held), "{held}");
        // No grant time stored (a lock, an older client): unknown.
        assert_eq!(key_state(&all[1..]).held_ms, None);
        // A grant time in the future (a clock ahead): 0.
        let ahead = [entry(5, &format!("1 0 0 a\ngranted_ms={}", now + 60_000))];
        assert_eq!(key_state(&ahead).held_ms, Some(0));
    }

    #[test]
    fn invalid_claims_are_refused_before_anything_is_sent() {
        assert_eq!(
            claim(0, 1, "").invalid(),
            Some("take is more than the limit")
        );
        assert_eq!(
            claim(2, 3, "").invalid(),
            Some("take is more than the limit")
        );
        assert_eq!(claim(2, 2, &"é".repeat(64)).invalid(), None);
        assert!(claim(2, 2, &"a".repeat(129)).invalid().is_some());
        assert!(claim(2, 2, "a\nb").invalid().is_some());
        assert_eq!(Claim::default().invalid(), None);
    }

    #[test]
    fn an_exclusive_entry_holds_alone_and_watches_its_predecessor() {
        assert_eq!(judge(Slot::EXCLUSIVE, &[], true), Verdict::Holds);
        let earlier = queue(&["1 5 1", "2 5 2"]);
        assert_eq!(wake_revisions(judge(Slot::EXCLUSIVE, &earlier, true)), [2]);
        // A writer that names the readers' limit is checked like them.
        assert_eq!(wake_revisions(judge(slot(5, 0), &earlier, true)), [2]);
        assert_eq!(
            judge(slot(6, 0), &earlier, true),
            Verdict::Mismatch { limit: 5 }
        );
    }

    #[test]
    fn counted_entries_fit_as_a_prefix_sum_in_fifo_order() {
        // Semaphore of 2: two holders, the third waits for either.
        let two = queue(&["1 2 1", "2 2 1"]);
        assert_eq!(judge(slot(2, 1), &two[1..], true), Verdict::Holds);
        assert_eq!(wake_revisions(judge(slot(2, 1), &two, true)), [2, 1]);
        // The fourth: one deletion of the three earlier is not enough, so
        // it watches only the two latest (their takes fill the limit).
        let three = queue(&["1 2 1", "2 2 1", "3 2 1"]);
        assert_eq!(wake_revisions(judge(slot(2, 1), &three, true)), [3, 2]);
        // A big take at the head blocks small ones behind it (no
        // overtaking): 1 + 3 > 3, so the 1 behind waits though 1 + 1 ≤ 3.
        let big = queue(&["1 3 1", "2 3 3"]);
        assert_eq!(wake_revisions(judge(slot(3, 1), &big, true)), [2]);
        assert_eq!(wake_revisions(judge(slot(3, 3), &big[1..], true)), [1]);
        // Readers share; a reader behind a writer waits for the writer
        // alone, whatever readers are before or after it.
        let readers = queue(&["1 65535 1", "2 65535 1"]);
        assert_eq!(judge(slot(65535, 1), &readers, true), Verdict::Holds);
        let writer_between = queue(&["1 65535 1", "2", "3 65535 1"]);
        assert_eq!(
            wake_revisions(judge(slot(65535, 1), &writer_between, true)),
            [2]
        );
        // An unreadable earlier value blocks like a writer.
        let foreign = queue(&["1 4 1", "garbage"]);
        assert_eq!(wake_revisions(judge(slot(4, 1), &foreign, true)), [2]);
    }

    #[test]
    fn the_earliest_conflicting_limit_is_reported_and_limit_0_never_conflicts() {
        let mixed = queue(&["1", "2 3 1", "3 4 1"]);
        assert_eq!(
            judge(slot(4, 1), &mixed, true),
            Verdict::Mismatch { limit: 3 }
        );
        assert_eq!(
            judge(slot(3, 1), &mixed, true),
            Verdict::Mismatch { limit: 4 }
        );
        // Without a limit of its own, nothing conflicts.
        assert_eq!(wake_revisions(judge(Slot::EXCLUSIVE, &mixed, true)), [3]);
        // Re-checks (the limit was checked when the entry was put) only
        // judge the fit.
        assert_eq!(wake_revisions(judge(slot(4, 1), &mixed, false)), [1]);
    }

    #[test]
    fn holders_are_the_prefix_that_fits() {
        let count = |values: &[&str]| {
            let mut all = queue(values);
            all.reverse();
            holders(&all)
        };
        assert_eq!(count(&[]), 0);
        assert_eq!(count(&["1"]), 1);
        assert_eq!(count(&["1", "2"]), 1);
        assert_eq!(count(&["1 2 1", "2 2 1", "3 2 1"]), 2);
        assert_eq!(count(&["1 9 1", "2 9 1", "3", "4 9 1"]), 2);
        assert_eq!(count(&["1 9 0", "2 9 1"]), 1);
        assert_eq!(count(&["1 3 1", "2 3 3", "3 3 1"]), 1);
        assert_eq!(count(&["1 3 3", "2 3 1"]), 1);
        // Every holder by `holders` is a holder by `judge`, and the next
        // is not.
        let values = ["1 4 1", "2 4 2", "3 4 1", "4 4 1"];
        let mut all = queue(&values);
        all.reverse();
        let held = holders(&all);
        assert_eq!(held, 3);
        for index in 0..all.len() {
            let mut earlier: Vec<Entry> = all[..index]
                .iter()
                .map(|e| entry(e.create_revision, std::str::from_utf8(&e.value).unwrap()))
                .collect();
            earlier.reverse();
            let holds = judge(all[index].slot(), &earlier, false) == Verdict::Holds;
            assert_eq!(holds, index < held, "entry {index}");
        }
    }
}
