//! The client's rules with no IO and no clock: every §8 decision lives here.
//!
//! [`Engine`] owns the requests, the per-session queues, write buffers and
//! correlation state. The I/O thread (`io.rs`) only moves bytes: it feeds
//! what it reads to [`Engine::handle_input`], asks [`Engine::poll_transmit`]
//! for bytes to write just before it writes them and reports how many the
//! socket accepted with [`Engine::transmitted`], performs the [`Action`]s the
//! engine asks for (connect, close, read what has arrived), and calls
//! [`Engine::handle_timeout`] when [`Engine::poll_timeout`] says so. Every
//! call takes `now`, so tests drive the engine on a fake clock.
//!
//! A request is in exactly one of these places:
//!
//! - the *unassigned* queue: certainly not sent, waiting for a session;
//! - a session's `queue`: certainly not sent, waiting for the socket to be
//!   writable (its frame is encoded only when the writer is about to write,
//!   so the wire wait is computed then);
//! - a session's current write *batch*: encoded, handed to the socket, and
//!   not yet known whether the socket took any of its bytes;
//! - *sent* on a session: the socket accepted at least one byte, so it is
//!   possibly sent and is never sent again; it waits for its correlated
//!   answer (acquires by `owner`, the others in request order, checked
//!   against their token or nonce).

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use slab::Slab;

use crate::protocol::{self, Correlation, ErrorCode, Request, Response};
use crate::timer_wheel::{self, TimerId, TimerLinks, TimerStore, TimerWheel};

use super::config::Secret;
use super::vocabulary::{
    Denied, Grant, HOLDERS_MAX, Holders, Key, KeyPage, KeyState, KeyStatus, KeySummary, Op,
    Outcome, Submission, TRANSPORT_DEADLINE, Unavailable, Waiter,
};

#[cfg(test)]
mod invariants;
#[cfg(test)]
mod simulation;

/// A session: one connection slot, numbered from 0.
pub(crate) type SessionId = usize;

type ReqId = usize;

/// A batch of frames stops growing past this many bytes, so that one write
/// stays a reasonable size and the socket buffer is not overrun.
const BATCH_BYTES_MAX: usize = 64 * 1024;

/// After its first failure a session slot is retried at once; after `n`
/// consecutive failures, after `RETRY_DELAY_BASE × 2^(n − 2)`, at most
/// [`RETRY_DELAY_MAX`].
const RETRY_DELAY_BASE: Duration = Duration::from_millis(10);
const RETRY_DELAY_MAX: Duration = Duration::from_millis(500);

impl Op {
    /// What ties this request to its answer (the rule lives in
    /// [`protocol::Correlation`]).
    fn correlation(&self) -> Correlation {
        match *self {
            Op::Acquire { owner, .. } => Correlation::Acquire { owner },
            Op::Release { token } => Correlation::Release { token },
            Op::Extend { token, .. } => Correlation::Extend { token },
            Op::Query => Correlation::Query,
            Op::Ping { nonce } => Correlation::Ping { nonce },
            Op::Info => Correlation::Info,
            Op::Holders { id, .. } => Correlation::Holders { id },
            Op::List { id, .. } => Correlation::List { id },
            Op::Observe { id, .. } => Correlation::Observe { id },
            Op::Proclaim { token, .. } => Correlation::Proclaim { token },
        }
    }
}

/// Why a session ended before the server executed any of its requests.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Refusal {
    Unavailable(Unavailable),
    /// The server refused this client's certificate, or its absence.
    #[cfg_attr(not(feature = "tls"), allow(dead_code))]
    PermissionDenied(&'static str),
}

impl Refusal {
    /// Whether the cause stays for the rest of a call (spec §8 rule 4):
    /// then a request every address refused ends at once.
    fn is_final(self) -> bool {
        !matches!(
            self,
            Refusal::Unavailable(Unavailable::ConnectionLimit | Unavailable::Unreachable)
        )
    }

    /// What a certainly-not-sent request ends with at `D`.
    fn outcome(refused: Option<Refusal>) -> Outcome {
        match refused {
            None => Outcome::Unavailable(Unavailable::Unreachable),
            Some(Refusal::Unavailable(why)) => Outcome::Unavailable(why),
            Some(Refusal::PermissionDenied(why)) => {
                Outcome::PermissionDenied(Denied::Certificate(why))
            }
        }
    }
}

/// Where a session is with its `U` (spec §8 rule 12).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Authentication {
    /// No secret is configured, or the server took it.
    Done,
    /// The `U` must be the next frame written.
    Due,
    /// The `U` is written (or being written) and its answer not yet read.
    Awaiting,
}

/// What the engine asks the I/O layer to do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Action {
    /// Open a connection for this session; report with
    /// [`Engine::connected`] or [`Engine::connect_failed`].
    Connect(SessionId),
    /// Drop this session's connection (the engine already forgot it).
    Close(SessionId),
    /// Read what has already arrived on this session and hand it to
    /// [`Engine::handle_input`] before calling [`Engine::expire`].
    Drain(SessionId),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Place {
    Unassigned,
    Queued(SessionId),
    Batch(SessionId),
    Sent(SessionId),
}

struct Req<R> {
    op: Op,
    key: Key,
    deadline: Instant,
    reply: Option<R>,
    place: Place,
    sent_at: Option<Instant>,
    /// Why a session that had it refused it (`X 7`, `X 9`, a TLS
    /// handshake that failed): the outcome if no other session takes it by
    /// `D`.
    refused: Option<Refusal>,
    /// The engine's refusal count when it was submitted: only refusals
    /// after it count for this call (rule 4).
    since: u64,
    /// The frames of a multi-frame answer (`H`, `L`) that came before its
    /// `Z`.
    gathered: Gathered,
    timer: TimerLinks,
}

/// What has arrived of an answer that ends with `Z`.
#[derive(Default)]
enum Gathered {
    #[default]
    Nothing,
    Holders(Holders),
    Keys(Vec<KeySummary>),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Link {
    /// No connection; a new one may be opened from `retry_at` on.
    Down {
        retry_at: Instant,
    },
    Connecting {
        deadline: Instant,
    },
    Up,
}

struct Session {
    link: Link,
    /// Consecutive failures (refused connects, sessions that closed before
    /// any answer); sets the retry delay.
    failures: u32,
    queue: VecDeque<ReqId>,
    /// Encoded frames. `out[..out_sent]` has been accepted by the socket.
    out: Vec<u8>,
    out_sent: usize,
    /// The frames of the batch being written and where each ends in `out`.
    batch: Vec<(ReqId, usize)>,
    /// When the batch was encoded: just before its first write.
    batch_at: Option<Instant>,
    /// Possibly-sent requests other than acquires, in request order.
    others: VecDeque<ReqId>,
    /// Possibly-sent acquires (they are found by owner in `Engine::owners`).
    acquires: usize,
    /// Bytes of a response frame that has not fully arrived.
    input: Vec<u8>,
    /// Set when a request on this session reached `D` unanswered.
    expiring: bool,
    /// A frame has arrived on this connection: an `X 7` or `X 9` after it
    /// is not a refusal at accept.
    heard_from: bool,
    authentication: Authentication,
    /// The bytes at the start of `out` that are the `U`, not a request's.
    batch_lead: usize,
}

impl Session {
    fn new(now: Instant) -> Session {
        Session {
            link: Link::Down { retry_at: now },
            failures: 0,
            queue: VecDeque::new(),
            out: Vec::new(),
            out_sent: 0,
            batch: Vec::new(),
            batch_at: None,
            others: VecDeque::new(),
            acquires: 0,
            input: Vec::new(),
            expiring: false,
            heard_from: false,
            authentication: Authentication::Done,
            batch_lead: 0,
        }
    }
}

/// The requests with their timer links, as the timer wheel sees them.
struct Requests<R> {
    slab: Slab<Req<R>>,
    /// Stands in for a stale id, which the wheel never passes in practice.
    spare: TimerLinks,
}

impl<R> TimerStore for Requests<R> {
    fn links(&mut self, id: TimerId) -> &mut TimerLinks {
        match self.slab.get_mut(id as usize) {
            Some(req) => &mut req.timer,
            None => &mut self.spare,
        }
    }
}

/// The client's request and session state (see the module docs).
pub(crate) struct Engine<R> {
    epoch: Instant,
    connect_timeout: Duration,
    requests: Requests<R>,
    wheel: TimerWheel,
    sessions: Vec<Session>,
    unassigned: VecDeque<ReqId>,
    owners: HashMap<u64, ReqId, foldhash::fast::RandomState>,
    /// Requests that reached `D` possibly sent, waiting for [`Engine::expire`].
    expired: Vec<ReqId>,
    actions: VecDeque<Action>,
    completions: VecDeque<(R, Outcome)>,
    /// The session the next batch of unassigned requests goes to.
    rotation: usize,
    /// Sessions per server address: session `s` talks to address
    /// `s / per_server`.
    per_server: usize,
    /// Per address: the refusal count when it last refused a session with
    /// `X 9` (not allowed), until one of its sessions hears anything else.
    not_allowed_at: Vec<Option<u64>>,
    /// Refusals seen so far that do not change within one call (`X 9`, a
    /// TLS failure), and the last of them.
    refusals: u64,
    last_final_refusal: Refusal,
    /// `X 8` (server shutting down) frames seen so far.
    shutdown_notices: u64,
    /// Connections that were up and ended, so far.
    sessions_ended: u64,
    /// Sent as `U` first on every session.
    secret: Option<Secret>,
    /// Why no request can run with this configuration (a secret that
    /// would go in clear, spec §12.5): each ends `Invalid` at once.
    refusal: Option<&'static str>,
    /// Whether a connection refused at the only address ends the
    /// requests waiting for a session at once ([`Engine::connect_refused`]).
    end_at_refusal: bool,
}

impl<R> Engine<R> {
    /// An engine for `servers` addresses with `per_server` sessions each.
    pub(crate) fn new(
        servers: usize,
        per_server: usize,
        connect_timeout: Duration,
        now: Instant,
    ) -> Engine<R> {
        let servers = servers.max(1);
        let per_server = per_server.max(1);
        let sessions = servers * per_server;
        Engine {
            epoch: now,
            connect_timeout,
            requests: Requests {
                slab: Slab::new(),
                spare: TimerLinks::UNARMED,
            },
            wheel: TimerWheel::new(),
            sessions: (0..sessions).map(|_| Session::new(now)).collect(),
            unassigned: VecDeque::new(),
            owners: HashMap::default(),
            expired: Vec::new(),
            actions: VecDeque::new(),
            completions: VecDeque::new(),
            rotation: 0,
            per_server,
            not_allowed_at: vec![None; servers],
            last_final_refusal: Refusal::Unavailable(Unavailable::NotAllowed),
            refusals: 0,
            shutdown_notices: 0,
            sessions_ended: 0,
            secret: None,
            refusal: None,
            end_at_refusal: false,
        }
    }

    /// Makes a connection refused at the only address end every request
    /// that waits for a session `Unavailable` at once, instead of at its
    /// `D` ([`Config::end_at_refusal`](super::Config::end_at_refusal)).
    pub(crate) fn end_at_refusal(&mut self) {
        self.end_at_refusal = true;
    }

    /// Makes every session start with `U secret` (spec §12.2). A secret
    /// no server could take ends every request `Invalid` at once, before
    /// anything is sent.
    pub(crate) fn authenticate_with(&mut self, secret: Secret) {
        self.secret = Some(secret);
    }

    /// Makes every request end `Invalid(why)` at once, before anything is
    /// connected or sent.
    pub(crate) fn refuse_every_request(&mut self, why: &'static str) {
        self.refusal = Some(why);
    }

    /// How many times a server said it is shutting down (`X 8`).
    pub(crate) fn shutdown_notices(&self) -> u64 {
        self.shutdown_notices
    }

    /// How many connections that were up have ended (a kept lease renewed
    /// after one may have been adopted by a restarted server).
    pub(crate) fn sessions_ended(&self) -> u64 {
        self.sessions_ended
    }

    /// No request is pending: nothing would be lost by stopping.
    pub(crate) fn is_idle(&self) -> bool {
        self.requests.slab.is_empty()
    }

    /// Takes a request. Its outcome comes out of [`Engine::poll_completion`]
    /// no later than its deadline (as seen by [`Engine::handle_timeout`]).
    pub(crate) fn submit(&mut self, submission: Submission<R>, now: Instant) {
        let id = self.requests.slab.insert(Req {
            op: submission.op,
            key: submission.key,
            deadline: submission.deadline,
            reply: submission.reply,
            place: Place::Unassigned,
            sent_at: None,
            refused: None,
            since: self.refusals,
            gathered: Gathered::Nothing,
            timer: TimerLinks::UNARMED,
        });
        if let Op::Acquire { owner, .. } = submission.op {
            self.owners.insert(owner, id);
        }
        if let Some(problem) = self
            .refusal
            .or_else(|| self.secret.as_ref().and_then(Secret::problem))
        {
            return self.complete(id, Outcome::Invalid(problem), now);
        }
        let tick = self.tick_at_or_after(submission.deadline);
        self.wheel.arm(&mut self.requests, id as TimerId, tick);
        self.unassigned.push_back(id);
        self.assign(now);
    }

    /// After an acquire by `owner` ended `Indeterminate` with its grant
    /// unknown (spec §8 rule 11): asks for the key's holders and releases
    /// the grants of that owner, if the server granted it after all, so
    /// that the key is free again long before the lease would end. The
    /// `H`'s id is that owner: the ids of `H` and `L` come from the
    /// client's owner counter, so no other request in flight has it.
    /// Nobody waits for it.
    fn clean_up_after(&mut self, key: Key, owner: u64, now: Instant) {
        self.submit(
            Submission {
                op: Op::Holders {
                    id: owner,
                    clean_up_for: Some(owner),
                },
                key,
                deadline: now + TRANSPORT_DEADLINE,
                reply: None,
            },
            now,
        );
    }

    /// Schedules a release of `token` that nobody waits for.
    pub(crate) fn release_in_background(&mut self, key: Key, token: u64, now: Instant) {
        self.submit(
            Submission {
                op: Op::Release { token },
                key,
                deadline: now + TRANSPORT_DEADLINE,
                reply: None,
            },
            now,
        );
    }

    pub(crate) fn poll_action(&mut self) -> Option<Action> {
        self.actions.pop_front()
    }

    pub(crate) fn poll_completion(&mut self) -> Option<(R, Outcome)> {
        self.completions.pop_front()
    }

    /// The next instant [`Engine::handle_timeout`] has work to do.
    pub(crate) fn poll_timeout(&self) -> Option<Instant> {
        let timer = self
            .wheel
            .next_tick()
            .map(|tick| self.epoch + Duration::from_micros(timer_wheel::tick_start(tick)));
        let demand = !self.unassigned.is_empty();
        let links = self
            .sessions
            .iter()
            .filter_map(|session| match session.link {
                Link::Connecting { deadline } => Some(deadline),
                Link::Down { retry_at } if demand => Some(retry_at),
                _ => None,
            });
        timer.into_iter().chain(links).min()
    }

    /// Ends what is due at `now`: certainly-not-sent requests past `D` are
    /// `Unavailable`; possibly-sent ones are set aside for
    /// [`Engine::expire`], after their sessions were drained
    /// ([`Action::Drain`]). Connects past their timeout fail.
    pub(crate) fn handle_timeout(&mut self, now: Instant) {
        let tick = self.tick_at_or_before(now);
        while let Some(id) = self.wheel.poll(&mut self.requests, tick) {
            let id = id as ReqId;
            let Some(req) = self.requests.slab.get(id) else {
                continue;
            };
            if req.deadline > now {
                // Cannot happen (ticks round the deadline up); never early.
                let tick = self.tick_at_or_after(req.deadline);
                self.wheel.arm(&mut self.requests, id as TimerId, tick);
                continue;
            }
            match req.place {
                Place::Unassigned => {
                    let outcome = Refusal::outcome(req.refused);
                    self.unassigned.retain(|&queued| queued != id);
                    self.complete(id, outcome, now);
                }
                Place::Queued(s) => {
                    let outcome = Refusal::outcome(req.refused);
                    self.sessions[s].queue.retain(|&queued| queued != id);
                    self.complete(id, outcome, now);
                }
                // A batch only exists between `poll_transmit` and
                // `transmitted`; treat it as sent to stay on the safe side.
                Place::Batch(s) | Place::Sent(s) => {
                    self.expired.push(id);
                    if !self.sessions[s].expiring {
                        self.sessions[s].expiring = true;
                        self.actions.push_back(Action::Drain(s));
                    }
                }
            }
        }
        for s in 0..self.sessions.len() {
            if let Link::Connecting { deadline } = self.sessions[s].link
                && deadline <= now
            {
                log::debug!("session {s}: connect timed out");
                self.actions.push_back(Action::Close(s));
                self.connect_failed(s, now);
            }
        }
        self.assign(now);
    }

    /// Closes every session on which a request set aside by
    /// [`Engine::handle_timeout`] is still unanswered (rule 5).
    pub(crate) fn expire(&mut self, now: Instant) {
        let expired = std::mem::take(&mut self.expired);
        for &id in &expired {
            // Check the deadline too: a drained answer may have freed the
            // slot, and a new request may have taken it since.
            if let Some(&Req {
                place: Place::Sent(s) | Place::Batch(s),
                deadline,
                ..
            }) = self.requests.slab.get(id)
                && deadline <= now
            {
                log::debug!("session {s}: no answer by the deadline; closing it");
                self.close(s, now);
            }
        }
        // One that a refusal read in the drain made certainly not sent
        // ends as at `D`, at the next `handle_timeout`: re-arm its timer.
        for &id in &expired {
            if let Some(req) = self.requests.slab.get(id)
                && !req.timer.is_armed()
            {
                let tick = self.tick_at_or_after(req.deadline);
                self.wheel.arm(&mut self.requests, id as TimerId, tick);
            }
        }
        for session in &mut self.sessions {
            session.expiring = false;
        }
        self.expired = expired;
        self.expired.clear();
        self.assign(now);
    }

    pub(crate) fn connected(&mut self, s: SessionId, now: Instant) {
        if let Some(session) = self.sessions.get_mut(s)
            && matches!(session.link, Link::Connecting { .. })
        {
            session.link = Link::Up;
            session.authentication = match self.secret {
                Some(_) => Authentication::Due,
                None => Authentication::Done,
            };
            self.assign(now);
        }
    }

    pub(crate) fn connect_failed(&mut self, s: SessionId, now: Instant) {
        if let Some(session) = self.sessions.get_mut(s)
            && matches!(session.link, Link::Connecting { .. })
        {
            session.failures = session.failures.saturating_add(1);
            session.link = Link::Down {
                retry_at: now + retry_delay(session.failures),
            };
            self.assign(now);
        }
    }

    /// Session `s`'s connection attempt was refused: nothing listens at
    /// its address, or it is a unix socket that is missing or that this
    /// user may not open. With [`Engine::end_at_refusal`] and one address,
    /// the requests that wait for a session end `Unavailable` now: none
    /// was sent (rule 4 lets them wait for another session until `D`, and
    /// there is no other address to try). Otherwise as
    /// [`Engine::connect_failed`].
    pub(crate) fn connect_refused(&mut self, s: SessionId, now: Instant) {
        self.connect_failed(s, now);
        if self.end_at_refusal && self.not_allowed_at.len() == 1 {
            let waiting: Vec<ReqId> = self.unassigned.drain(..).collect();
            for id in waiting {
                self.complete(id, Outcome::Unavailable(Unavailable::Unreachable), now);
            }
        }
    }

    /// The connection of session `s` ended (end of stream, a read or write
    /// error). Its possibly-sent requests are `Indeterminate`; the others
    /// may move to another session.
    pub(crate) fn session_closed(&mut self, s: SessionId, now: Instant) {
        if matches!(self.sessions.get(s).map(|x| x.link), Some(Link::Up)) {
            self.close(s, now);
            self.assign(now);
        }
    }

    /// The bytes to write on session `s` now, if any: what is left of a
    /// partly written frame, else a new batch encoded at `now` (the wire
    /// wait of each acquire is computed here, rule 3). The caller writes
    /// them at once and reports with [`Engine::transmitted`].
    pub(crate) fn poll_transmit(&mut self, s: SessionId, now: Instant) -> Option<&[u8]> {
        let session = self.sessions.get_mut(s)?;
        if session.link != Link::Up {
            return None;
        }
        if session.out_sent < session.out.len() {
            return Some(&session.out[session.out_sent..]);
        }
        session.out.clear();
        session.out_sent = 0;
        session.batch.clear();
        if session.authentication == Authentication::Due
            && let Some(secret) = &self.secret
        {
            let request = Request::Authenticate {
                secret: secret.as_bytes(),
            };
            protocol::encode_request(&request, &mut session.out);
            session.batch_lead = session.out.len();
            session.authentication = Authentication::Awaiting;
        }
        while session.out.len() < BATCH_BYTES_MAX {
            let Some(id) = session.queue.pop_front() else {
                break;
            };
            let Some(req) = self.requests.slab.get_mut(id) else {
                continue;
            };
            encode(req, now, &mut session.out);
            req.place = Place::Batch(s);
            session.batch.push((id, session.out.len()));
        }
        if session.out.is_empty() {
            return None;
        }
        session.batch_at = Some(now);
        Some(&session.out)
    }

    /// The socket of session `s` accepted `written` bytes of what
    /// [`Engine::poll_transmit`] returned (0 if it would block). Requests
    /// with at least one byte accepted are now possibly sent; the rest go
    /// back to the queue unencoded, to be encoded afresh at the next write.
    pub(crate) fn transmitted(&mut self, s: SessionId, written: usize) {
        let Some(session) = self.sessions.get_mut(s) else {
            return;
        };
        let start = session.out_sent;
        session.out_sent = (start + written).min(session.out.len());
        // A `U` that is not fully written stays, ahead of everything.
        let lead = std::mem::take(&mut session.batch_lead);
        if session.batch.is_empty() {
            return;
        }
        let sent_at = session.batch_at.take();
        let mut frame_start = lead;
        let mut kept = lead;
        let mut unsent_from = session.batch.len();
        for (index, &(id, frame_end)) in session.batch.iter().enumerate() {
            if frame_start >= session.out_sent {
                unsent_from = index;
                break;
            }
            kept = frame_end;
            frame_start = frame_end;
            let Some(req) = self.requests.slab.get_mut(id) else {
                continue;
            };
            req.place = Place::Sent(s);
            req.sent_at = sent_at;
            if matches!(req.op, Op::Acquire { .. }) {
                session.acquires += 1;
            } else {
                session.others.push_back(id);
            }
        }
        for &(id, _) in session.batch[unsent_from..].iter().rev() {
            if let Some(req) = self.requests.slab.get_mut(id) {
                req.place = Place::Queued(s);
                session.queue.push_front(id);
            }
        }
        session.batch.clear();
        session.out.truncate(kept);
        if session.out_sent == session.out.len() {
            session.out.clear();
            session.out_sent = 0;
        }
    }

    /// Whether session `s` has bytes to write.
    pub(crate) fn wants_write(&self, s: SessionId) -> bool {
        self.sessions.get(s).is_some_and(|session| {
            session.link == Link::Up
                && (session.out_sent < session.out.len()
                    || !session.queue.is_empty()
                    || session.authentication == Authentication::Due)
        })
    }

    /// Bytes that arrived on session `s`. Frames are decoded as they
    /// complete; an undecodable stream or an answer that correlates with
    /// nothing closes the session.
    pub(crate) fn handle_input(&mut self, s: SessionId, data: &[u8], now: Instant) {
        if self.sessions.get(s).map(|x| x.link) != Some(Link::Up) {
            return;
        }
        let mut input = std::mem::take(&mut self.sessions[s].input);
        let used = if input.is_empty() {
            let used = self.decode_frames(s, data, now);
            if let Some(rest) = used.and_then(|used| data.get(used..)) {
                input.extend_from_slice(rest);
            }
            used
        } else {
            input.extend_from_slice(data);
            let used = self.decode_frames(s, &input, now);
            input.drain(..used.unwrap_or(input.len()));
            used
        };
        match used {
            Some(_) if self.sessions[s].link == Link::Up => self.sessions[s].input = input,
            Some(_) => {}
            None => {
                self.close(s, now);
                self.assign(now);
            }
        }
    }

    /// Decodes and handles every whole frame of `data`. Returns how many
    /// bytes were used, or `None` when the session must be closed.
    fn decode_frames(&mut self, s: SessionId, data: &[u8], now: Instant) -> Option<usize> {
        let mut used = 0;
        loop {
            let rest = data.get(used..).unwrap_or_default();
            match protocol::decode_response(rest) {
                Ok(None) => return Some(used),
                Ok(Some((response, len))) => {
                    used += len;
                    if !self.handle_response(s, response, now) {
                        return None;
                    }
                    if let Some(session) = self.sessions.get_mut(s) {
                        session.heard_from = true;
                    }
                    // It talks to us: its `--allow` lets this client in now.
                    if let Some(refused) = self.not_allowed_at.get_mut(s / self.per_server) {
                        *refused = None;
                    }
                }
                Err(error) if !self.sessions.get(s).is_some_and(|x| x.heard_from) => {
                    // The first bytes of the session are no kunci answer:
                    // the peer speaks something else, and executed none of
                    // its requests. That does not change by trying again.
                    log::debug!("session {s}: not a kunci server: {error}");
                    let why = if matches!(rest, [0x15 | 0x16, 0x03, ..]) {
                        "the server speaks TLS: address it as tls://HOST:PORT"
                    } else {
                        "not a kunci server (its first answer is no kunci frame): \
                         check the address and port"
                    };
                    self.refused(
                        s,
                        Refusal::Unavailable(Unavailable::WrongProtocol(why)),
                        now,
                    );
                    return None;
                }
                Err(error) => {
                    log::debug!("session {s}: undecodable answer: {error}");
                    log::warn!(
                        "the server sent an answer this client cannot read ({error}); reconnecting"
                    );
                    return None;
                }
            }
        }
    }

    /// Correlates one answer and completes its request. `false`: the
    /// session must be closed (a fatal `X`, or an answer to nothing).
    fn handle_response(&mut self, s: SessionId, response: Response, now: Instant) -> bool {
        let (id, outcome) = match response {
            Response::Acquired { owner, token } => {
                let Some(id) = self.sent_acquire(s, owner) else {
                    return self.uncorrelated(s, &response);
                };
                let Some(req) = self.requests.slab.get(id) else {
                    return false;
                };
                if now < req.deadline {
                    let sent_at = req.sent_at.unwrap_or(now);
                    (id, Outcome::Acquired { token, sent_at })
                } else {
                    // Rule 7: too late to hand over; give the grant back.
                    let key = req.key;
                    self.release_in_background(key, token, now);
                    (id, Outcome::Indeterminate)
                }
            }
            Response::Timeout { owner } | Response::Busy { owner } => {
                let Some(id) = self.sent_acquire(s, owner) else {
                    return self.uncorrelated(s, &response);
                };
                let outcome = if matches!(response, Response::Timeout { .. }) {
                    Outcome::Timeout
                } else {
                    Outcome::Busy
                };
                (id, outcome)
            }
            Response::Error { code, id, ref text } => {
                let heard_from = self.sessions.get(s).is_some_and(|x| x.heard_from);
                let refusal = match ErrorCode::from_u8(code) {
                    Some(ErrorCode::ConnectionLimit) => Some(Unavailable::ConnectionLimit),
                    Some(ErrorCode::NotAllowed) => Some(Unavailable::NotAllowed),
                    _ => None,
                };
                if let Some(why) = refusal.filter(|_| !heard_from) {
                    log::debug!("session {s}: refused at accept: {text}");
                    self.refused(s, Refusal::Unavailable(why), now);
                    return false;
                }
                if ErrorCode::from_u8(code) == Some(ErrorCode::NotAuthenticated) && !heard_from {
                    self.denied(s, now);
                    return false;
                }
                if ErrorCode::from_u8(code) == Some(ErrorCode::ShuttingDown) {
                    // A routine stop or restart: the requests it leaves
                    // open end as the rules say; nothing to warn about.
                    log::debug!("the server is shutting down (a restart or a stop); reconnecting");
                    self.shutdown_notices += 1;
                    return false;
                }
                let Some(code) = ErrorCode::from_u8(code).filter(|code| !code.is_fatal()) else {
                    log::debug!("session {s}: X {code} {text}");
                    log::warn!("the server closed the connection: {text}");
                    return false;
                };
                let found = self.sent_acquire(s, id).or_else(|| {
                    self.sent_other(s, |op| op.correlation().is_answered_by(&response))
                });
                let Some(request) = found else {
                    return self.uncorrelated(s, &response);
                };
                let outcome = match code {
                    ErrorCode::LimitMismatch => Outcome::LimitMismatch {
                        key_limit: protocol::parse_limit_mismatch(text),
                    },
                    ErrorCode::NotPermitted => Outcome::PermissionDenied(Denied::NotPermitted),
                    // Definitive, nothing held: a capacity limit.
                    ErrorCode::TooManyWatches => Outcome::Busy,
                    code => Outcome::Invalid(code.text()),
                };
                (request, outcome)
            }
            Response::Grant { .. } | Response::Waiter { .. } | Response::Key { .. } => {
                return self.gather(s, response);
            }
            Response::Authenticated { ref name } => {
                let Some(session) = self.sessions.get_mut(s) else {
                    return false;
                };
                if session.authentication != Authentication::Awaiting {
                    return self.uncorrelated(s, &response);
                }
                session.authentication = Authentication::Done;
                log::debug!("session {s}: authenticated as {name:?}");
                return true;
            }
            Response::End { count, next, .. } => {
                let matches = |op: &Op| op.correlation().is_answered_by(&response);
                let Some(id) = self.sent_other(s, matches) else {
                    return self.uncorrelated(s, &response);
                };
                let Some(req) = self.requests.slab.get_mut(id) else {
                    return false;
                };
                let gathered = std::mem::take(&mut req.gathered);
                let (outcome, frames) = match (req.op, gathered) {
                    (Op::Holders { .. }, Gathered::Holders(holders)) => {
                        let frames = holders.grants.len() + holders.waiters.len();
                        let left_out = next;
                        (
                            Outcome::Holders(Holders {
                                left_out,
                                ..holders
                            }),
                            frames,
                        )
                    }
                    (Op::Holders { .. }, Gathered::Nothing) => (
                        Outcome::Holders(Holders {
                            left_out: next,
                            ..Holders::default()
                        }),
                        0,
                    ),
                    (Op::List { .. }, Gathered::Keys(keys)) => {
                        let frames = keys.len();
                        (Outcome::Keys(KeyPage { keys, next }), frames)
                    }
                    (Op::List { .. }, Gathered::Nothing) => (
                        Outcome::Keys(KeyPage {
                            keys: Vec::new(),
                            next,
                        }),
                        0,
                    ),
                    _ => return self.uncorrelated(s, &response),
                };
                if usize::try_from(count) != Ok(frames) {
                    log::warn!(
                        "session {s}: {response:?} counts {count} frames, {frames} came; closing it"
                    );
                    return false;
                }
                (id, outcome)
            }
            ref other => {
                let matches = |op: &Op| op.correlation().is_answered_by(other);
                let Some(id) = self.sent_other(s, matches) else {
                    return self.uncorrelated(s, other);
                };
                let sent_at = self
                    .requests
                    .slab
                    .get(id)
                    .and_then(|req| req.sent_at)
                    .unwrap_or(now);
                let outcome = match response {
                    Response::Released { .. } => Outcome::Released,
                    Response::Extended { .. } => Outcome::Extended { sent_at },
                    Response::NotHeld { .. } => Outcome::NotHeld,
                    Response::Proclaimed { .. } => Outcome::Proclaimed,
                    Response::Query {
                        token,
                        owner,
                        lease_ms,
                        waiters,
                    } => Outcome::Query(KeyStatus {
                        token,
                        owner,
                        lease_ms,
                        waiters,
                    }),
                    Response::Pong { .. } => Outcome::Pong {
                        round_trip: now.saturating_duration_since(sent_at),
                    },
                    Response::Info(text) => Outcome::Info(text),
                    Response::KeyState {
                        token,
                        lease_ms,
                        held_ms,
                        grants,
                        waiters,
                        label,
                        ..
                    } => Outcome::Observed(KeyState {
                        token,
                        lease_ms,
                        held_ms: Some(held_ms),
                        grants,
                        waiters,
                        label,
                    }),
                    _ => return false,
                };
                (id, outcome)
            }
        };
        if let Some(session) = self.sessions.get_mut(s) {
            session.failures = 0;
        }
        self.complete(id, outcome, now);
        true
    }

    /// Keeps one `G`, `W` or `K` frame with the request it belongs to,
    /// until its `Z`. `false`: the session must be closed (a frame that
    /// answers nothing, comes out of order, or passes the spec's bounds).
    fn gather(&mut self, s: SessionId, response: Response) -> bool {
        let matches = |op: &Op| op.correlation().is_answered_by(&response);
        let Some(id) = self.sent_other(s, matches) else {
            return self.uncorrelated(s, &response);
        };
        let Some(req) = self.requests.slab.get_mut(id) else {
            return false;
        };
        let gathered = &mut req.gathered;
        if matches!(gathered, Gathered::Nothing) {
            *gathered = match req.op {
                Op::List { .. } => Gathered::Keys(Vec::new()),
                _ => Gathered::Holders(Holders::default()),
            };
        }
        let fits = match (response, gathered, req.op) {
            (
                Response::Grant {
                    token,
                    owner,
                    lease_ms,
                    held_ms,
                    take,
                    label,
                    ..
                },
                Gathered::Holders(holders),
                _,
            ) if holders.waiters.is_empty() && holders.grants.len() < HOLDERS_MAX => {
                holders.grants.push(Grant {
                    token,
                    owner,
                    take,
                    lease_left: Duration::from_millis(lease_ms.into()),
                    held_for: Duration::from_millis(held_ms.into()),
                    label,
                });
                true
            }
            (
                Response::Waiter {
                    owner,
                    wait_ms,
                    take,
                    label,
                    ..
                },
                Gathered::Holders(holders),
                _,
            ) if holders.waiters.len() < HOLDERS_MAX => {
                holders.waiters.push(Waiter {
                    owner,
                    take,
                    wait_left: Duration::from_millis(wait_ms.into()),
                    label,
                });
                true
            }
            (
                Response::Key {
                    grants,
                    waiters,
                    limit,
                    key,
                    ..
                },
                Gathered::Keys(keys),
                Op::List { count, .. },
            ) if keys.len() < usize::from(count) => {
                keys.push(KeySummary {
                    key,
                    grants,
                    waiters,
                    limit,
                });
                true
            }
            _ => false,
        };
        if !fits {
            log::warn!(
                "session {s}: a frame of a list out of order or past its bounds; closing it"
            );
        }
        fits
    }

    fn uncorrelated(&self, s: SessionId, response: &Response) -> bool {
        log::debug!("session {s}: answer {response:?} matches no request");
        log::warn!("the server sent an answer to no request of this client; reconnecting");
        false
    }

    /// The possibly-sent acquire of session `s` with this owner.
    fn sent_acquire(&self, s: SessionId, owner: u64) -> Option<ReqId> {
        let &id = self.owners.get(&owner)?;
        let req = self.requests.slab.get(id)?;
        (req.place == Place::Sent(s)).then_some(id)
    }

    /// The first possibly-sent non-acquire of session `s` that `matches`
    /// (answers come in request order, so it is normally the front one).
    fn sent_other(&self, s: SessionId, matches: impl Fn(&Op) -> bool) -> Option<ReqId> {
        let session = self.sessions.get(s)?;
        session.others.iter().copied().find(|&id| {
            self.requests
                .slab
                .get(id)
                .is_some_and(|req| matches(&req.op))
        })
    }

    /// Ends a request: takes it out of every structure and hands its
    /// outcome to whoever waits for it.
    fn complete(&mut self, id: ReqId, outcome: Outcome, now: Instant) {
        self.wheel.cancel(&mut self.requests, id as TimerId);
        let Some(req) = self.requests.slab.try_remove(id) else {
            return;
        };
        match req.op {
            Op::Acquire { owner, .. } => {
                self.owners.remove(&owner);
                if let Place::Sent(s) = req.place
                    && let Some(session) = self.sessions.get_mut(s)
                {
                    session.acquires = session.acquires.saturating_sub(1);
                }
            }
            _ => {
                if let Place::Sent(s) = req.place
                    && let Some(session) = self.sessions.get_mut(s)
                {
                    if session.others.front() == Some(&id) {
                        session.others.pop_front();
                    } else {
                        session.others.retain(|&other| other != id);
                    }
                }
            }
        }
        if let (
            Op::Holders {
                clean_up_for: Some(owner),
                ..
            },
            Outcome::Holders(holders),
        ) = (&req.op, &outcome)
        {
            for grant in holders.grants.iter().filter(|grant| grant.owner == *owner) {
                log::debug!(
                    "releasing grant {} of {:?}: its acquire ended indeterminate",
                    grant.token,
                    req.key
                );
                self.release_in_background(req.key, grant.token, now);
            }
        }
        match req.reply {
            Some(reply) => self.completions.push_back((reply, outcome)),
            None => log::debug!(
                "background {} on {:?}: {}",
                req.op.summary(),
                req.key,
                outcome.summary()
            ),
        }
    }

    /// Forgets session `s`'s connection: possibly-sent requests are
    /// `Indeterminate`, the others go back to the unassigned queue, in
    /// order, ahead of newer requests.
    /// Session `s`'s first frame was `X 7` or `X 9`: the server executed
    /// none of its requests (spec §6, §8 rule 4), so each is certainly not
    /// sent and may move to another session until `D`; if none takes it,
    /// its `Unavailable` names `why`.
    fn refused(&mut self, s: SessionId, why: Refusal, now: Instant) {
        let mut sent = Vec::new();
        for (id, req) in self.requests.slab.iter_mut() {
            match req.place {
                Place::Sent(at) | Place::Batch(at) | Place::Queued(at) if at == s => {
                    req.refused = Some(why);
                    if req.place == Place::Sent(s) {
                        sent.push(id);
                    }
                }
                _ => {}
            }
        }
        for &id in sent.iter().rev() {
            self.requests.slab[id].place = Place::Unassigned;
            self.requests.slab[id].sent_at = None;
            self.unassigned.push_front(id);
        }
        if let Some(session) = self.sessions.get_mut(s) {
            session.others.clear();
            session.acquires = 0;
        }
        if why.is_final() {
            self.last_final_refusal = why;
            self.refusals += 1;
            if let Some(refused) = self.not_allowed_at.get_mut(s / self.per_server) {
                *refused = Some(self.refusals);
            }
            self.end_refused_everywhere(now);
        }
    }

    /// Session `s`'s first answer was `X 12`: the server executed none of
    /// its requests and will not with this secret (spec §8 rule 12), so
    /// every request on it ends `PermissionDenied` at once instead of
    /// moving to another session (which has the same secret).
    fn denied(&mut self, s: SessionId, now: Instant) {
        log::debug!(
            "session {s}: X 12: the server did not take the secret (one given: {})",
            self.secret.is_some()
        );
        let on_session: Vec<ReqId> = self
            .requests
            .slab
            .iter()
            .filter(|(_, req)| {
                matches!(req.place, Place::Sent(at) | Place::Batch(at) | Place::Queued(at) if at == s)
            })
            .map(|(id, _)| id)
            .collect();
        if let Some(session) = self.sessions.get_mut(s) {
            session.queue.clear();
            session.batch.clear();
        }
        for id in on_session {
            self.complete(id, Outcome::PermissionDenied(Denied::NotAuthenticated), now);
        }
    }

    /// Rule 4: `X 9` cannot change within one call, so a certainly-not-sent
    /// request that every address has refused with it since the call began
    /// is `Unavailable` at once instead of waiting for `D`.
    fn end_refused_everywhere(&mut self, now: Instant) {
        let refused_since = self
            .not_allowed_at
            .iter()
            .map(|at| at.unwrap_or(0))
            .min()
            .unwrap_or(0);
        let done: Vec<ReqId> = self
            .requests
            .slab
            .iter()
            .filter(|(_, req)| {
                matches!(req.place, Place::Unassigned | Place::Queued(_))
                    && req.since < refused_since
            })
            .map(|(id, _)| id)
            .collect();
        if done.is_empty() {
            return;
        }
        self.unassigned.retain(|id| !done.contains(id));
        for session in &mut self.sessions {
            session.queue.retain(|id| !done.contains(id));
        }
        for id in done {
            self.complete(id, Refusal::outcome(Some(self.last_final_refusal)), now);
        }
    }

    /// The TLS session of `s` failed before the server answered anything:
    /// the server executed none of its requests (it reads them only after
    /// the handshake, and decides on the client's certificate before it
    /// reads any). Like `X 9`, neither cause changes within one call.
    #[cfg_attr(not(feature = "tls"), allow(dead_code))]
    pub(crate) fn tls_failed(&mut self, s: SessionId, why: Refusal, now: Instant) {
        let heard_from = self.sessions.get(s).is_some_and(|x| x.heard_from);
        if matches!(self.sessions.get(s).map(|x| x.link), Some(Link::Up)) && !heard_from {
            self.refused(s, why, now);
        }
        self.session_closed(s, now);
    }

    fn close(&mut self, s: SessionId, now: Instant) {
        let Some(session) = self.sessions.get_mut(s) else {
            return;
        };
        if session.link != Link::Up {
            return;
        }
        self.sessions_ended += 1;
        // A healthy session (one that had answers: `failures` is 0) is
        // reopened at once; one that keeps closing backs off.
        session.failures = session.failures.saturating_add(1);
        session.link = Link::Down {
            retry_at: now + retry_delay(session.failures),
        };
        self.actions.push_back(Action::Close(s));
        let session = &mut self.sessions[s];
        let unsent: Vec<ReqId> = session
            .batch
            .drain(..)
            .map(|(id, _)| id)
            .chain(session.queue.drain(..))
            .collect();
        session.out.clear();
        session.out_sent = 0;
        session.batch_at = None;
        session.input.clear();
        session.heard_from = false;
        session.authentication = Authentication::Done;
        session.batch_lead = 0;
        for &id in unsent.iter().rev() {
            if let Some(req) = self.requests.slab.get_mut(id) {
                req.place = Place::Unassigned;
                self.unassigned.push_front(id);
            }
        }
        let sent: Vec<ReqId> = self
            .requests
            .slab
            .iter()
            .filter(|(_, req)| req.place == Place::Sent(s))
            .map(|(id, _)| id)
            .collect();
        for id in sent {
            let clean_up = match self.requests.slab.get(id) {
                Some(Req {
                    op: Op::Acquire { owner, .. },
                    key,
                    ..
                }) => Some((*key, *owner)),
                _ => None,
            };
            self.complete(id, Outcome::Indeterminate, now);
            if let Some((key, owner)) = clean_up {
                self.clean_up_after(key, owner, now);
            }
        }
        let session = &mut self.sessions[s];
        session.others.clear();
        session.acquires = 0;
    }

    /// Hands unassigned requests to a connected session, and opens
    /// connections while requests wait for one.
    fn assign(&mut self, now: Instant) {
        if self.unassigned.is_empty() {
            return;
        }
        for (s, session) in self.sessions.iter_mut().enumerate() {
            if let Link::Down { retry_at } = session.link
                && retry_at <= now
            {
                session.link = Link::Connecting {
                    deadline: now + self.connect_timeout,
                };
                self.actions.push_back(Action::Connect(s));
            }
        }
        // Requests that arrive together join the batch being filled; the
        // next batch goes to the next connected session.
        let count = self.sessions.len();
        let usable = |session: &Session| session.link == Link::Up && !session.expiring;
        let current = self.rotation % count;
        let filling = &self.sessions[current];
        let s = if usable(filling) && !filling.queue.is_empty() {
            current
        } else {
            let Some(s) = (1..=count)
                .map(|offset| (current + offset) % count)
                .find(|&s| usable(&self.sessions[s]))
            else {
                return;
            };
            s
        };
        self.rotation = s;
        let session = &mut self.sessions[s];
        while let Some(id) = self.unassigned.pop_front() {
            if let Some(req) = self.requests.slab.get_mut(id) {
                req.place = Place::Queued(s);
                session.queue.push_back(id);
            }
        }
    }

    /// The first tick at or after `at` (deadlines round up: never early).
    /// The rounding is the timer wheel's; nanoseconds round up to whole
    /// microseconds first, so nothing is lost on the way.
    fn tick_at_or_after(&self, at: Instant) -> u64 {
        let since = at.saturating_duration_since(self.epoch);
        timer_wheel::tick_at_or_after(since.as_nanos().div_ceil(1_000) as u64)
    }

    /// The tick the clock has reached at `at`.
    fn tick_at_or_before(&self, at: Instant) -> u64 {
        let since = at.saturating_duration_since(self.epoch);
        timer_wheel::tick_reached(since.as_micros() as u64)
    }
}

fn retry_delay(failures: u32) -> Duration {
    if failures <= 1 {
        return Duration::ZERO;
    }
    RETRY_DELAY_BASE
        .saturating_mul(1 << (failures - 2).min(16))
        .min(RETRY_DELAY_MAX)
}

/// The wire wait of an acquire written at `now` (rule 3).
pub(crate) fn wire_wait_s(wait_until: Option<Instant>, now: Instant) -> u8 {
    let Some(wait_until) = wait_until else {
        return 0;
    };
    let left = wait_until.saturating_duration_since(now);
    let whole = left.as_secs() + u64::from(left.subsec_nanos() > 0);
    whole.min(u64::from(protocol::WAIT_S_MAX)) as u8
}

fn encode<R>(req: &Req<R>, now: Instant, out: &mut Vec<u8>) {
    let key = req.key.as_str();
    let request = match req.op {
        Op::Acquire {
            owner,
            lease_s,
            wait_until,
            permits,
            ref label,
            ..
        } => {
            let (limit, take) = permits.wire();
            Request::Acquire {
                wait_s: wire_wait_s(wait_until, now),
                lease_s,
                owner,
                key,
                limit,
                take,
                label: label.as_str(),
            }
        }
        Op::Release { token } => Request::Release { token, key },
        Op::Extend { token, lease_s } => Request::Extend {
            lease_s,
            token,
            key,
        },
        Op::Query => Request::Query { key },
        Op::Ping { nonce } => Request::Ping { nonce },
        Op::Info => Request::Info,
        Op::Holders { id, .. } => Request::Holders { id, key },
        Op::List { id, cursor, count } => Request::List {
            id,
            cursor,
            count,
            prefix: key,
        },
        Op::Observe {
            id, since, wait_s, ..
        } => Request::Observe {
            wait_s,
            id,
            since,
            key,
        },
        Op::Proclaim { token, ref label } => Request::Proclaim {
            token,
            key,
            label: label.as_str(),
        },
    };
    protocol::encode_request(&request, out);
}
