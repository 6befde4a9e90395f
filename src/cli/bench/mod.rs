//! `kunci bench`: a single-threaded load generator for a kunci server.
//!
//! - [`fleet`] — the connections, the mio loop, request/reply correlation;
//! - [`workloads`] — what each workload sends next;
//! - [`events`] — workloads where one event sets off much work;
//! - [`stats`] — counts, latency histograms, the report;
//! - `closed_loop` — pairs and contended through the client, for
//!   `etcd://` (the fleet speaks only kunci's protocol).

#[cfg(feature = "etcd")]
mod closed_loop;
mod events;
mod fleet;
pub(super) mod stats;
mod workloads;

use std::ffi::OsString;
use std::io::IsTerminal as _;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use super::{args, exit};
use crate::addr::{Address, DEFAULT_ADDRESS};
use crate::protocol::KEY_LEN_MAX;
use fleet::{Fleet, Workload};
use stats::{Stats, json_string};

const HELP: &str = "\
kunci bench — load-test a server and report throughput and latency

Usage: kunci bench [WORKLOAD] [options]

Drives load against a kunci server from one thread and reports requests/s,
latency percentiles per request type and a count of every reply kind.
Any X, unexpected reply or lost connection is counted as an error, printed,
and makes the exit status 1.

Workloads:
  pairs          acquire (wait=0) a random key, release it with the token as
                 soon as the grant arrives; a T is a miss (default workload)
  contended      the same with --wait on few keys, each grant held for --hold:
                 hand-over rate, wait distribution, per-connection fairness
  semaphore      contended with one permit of a semaphore of --limit L per
                 grant: at most L holders of a key at once
  rw             contended as readers (shared) and --writers % writers
                 (exclusive), writers holding --write-hold: grants/s, read
                 and write waits apart; --exclusive-only runs the same mix
                 with every request exclusive, to show what sharing gains
  hold N         acquire N distinct keys, renew them every lease/3, keep them
                 until the run ends, release them; shows only progress
  waiters N      one connection holds --keys keys, the others queue N waits
                 on them (--wait, default 255 s)
  idle N         N connections, one ping each, then silence
  timers         lateness of wait timeouts and lease expiries (1 s timers):
                 --connections probes of each kind
  watches N      N watches (O) of one key on N/4000 connections; once all
                 are held, one grant with a 128-byte label (then a release)
                 wakes them all, and they are armed again: wake latency
                 (each, and the last) and an innocent client's ping
  handover N     one connection holds N/16384 shared keys exclusively, N
                 readers queue behind them; the keys are released at once,
                 pipelined, and handed to all N: grant latency (each, and
                 the last), the readers give them back, and again; with an
                 innocent client's ping

With --scrapers S and --metrics ADDR, S threads scrape ADDR/metrics in a
loop during the run (scrape latency). With watches, handover, or
--scrapers, an innocent client pings the server from a thread and a
connection of its own, 1 ms between a pong and the next ping
(innocent_ping: what the event or the scrapes cost everyone else).

Options (defaults: pairs / contended / hold / waiters / idle / timers;
semaphore and rw as contended, with 1 key and --hold 1):
  --server ADDR        HOST:PORT or unix:PATH (default: the first address
                       in $KUNCI_SERVER, else 127.0.0.1:5862), or
                       etcd://HOST:PORT[,...]: pairs and contended only, as
                       closed loops through the client (one thread per
                       connection, --pipeline 1)
  --secret-file FILE   the secret for a server with --auth (default:
                       $KUNCI_SECRET): each connection sends U first;
                       only over tls://, unix: or loopback unless
                       --insecure-plaintext-secret (or
                       $KUNCI_ALLOW_PLAINTEXT_SECRET=1)
  --connections C      connections (50 / 50 / 4 / 1+N/4000 / N / 8 probes)
  --pipeline P         requests in flight per connection (32 / 1 / 128)
  --keys K             key space (1000000 / 8 / N / 1000)
  --duration S         measured seconds; 0 = until SIGINT/SIGTERM
                       (10 / 10 / 0 / 0 / 0 / 30)
  --warmup S           seconds run before measuring (2 / 2 / 0 / 0 / 0 / 2)
  --lease L            lease in whole seconds (10 / 10 / 255 / 255 / - / 1)
  --wait W             wait in whole seconds (0 / 10 / - / 255 / - / 1)
  --hold MS            contended, semaphore, rw: milliseconds to hold each
                       grant (0 / 1 / 1)
  --limit L            semaphore: permits of each key (4)
  --writers PCT        rw: percentage of writers, 0..=100 (10)
  --write-hold MS      rw: milliseconds a writer holds (as --hold)
  --exclusive-only     rw: every request takes the whole key
  --key-prefix TEXT    key names are TEXT + 12 digits (pair- / cont- / hold-
                       / wait- / - / timr-: 17-byte keys)
  --seed N             seed of the random key choice (1)
  --scrapers S         threads that scrape --metrics in a loop (0)
  --metrics HOST:PORT  the server's --metrics listener, for --scrapers
  --json               print the report as one JSON object
";

/// The concrete parameters of a run.
#[derive(Clone, Debug)]
pub struct Plan {
    pub connections: usize,
    pub pipeline: usize,
    pub keys: u64,
    pub lease_s: u8,
    pub wait_s: u8,
    pub hold: Duration,
    pub seed: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Which {
    Pairs,
    Contended,
    Semaphore,
    ReadWrite,
    Hold(u64),
    Waiters(u64),
    Idle(u64),
    Timers,
    Watches(u64),
    HandOver(u64),
}

/// What was asked on the command line; unset options take the workload's
/// default.
#[derive(Default)]
struct Options {
    server: Option<Address>,
    secret_file: Option<OsString>,
    /// `--insecure-plaintext-secret`.
    allow_plaintext_secret: bool,
    tls: super::client::TlsOptions,
    workload: Option<Which>,
    connections: Option<usize>,
    pipeline: Option<usize>,
    keys: Option<u64>,
    duration: Option<Duration>,
    warmup: Option<Duration>,
    lease_s: Option<u8>,
    wait_s: Option<u8>,
    hold: Option<Duration>,
    limit: Option<u16>,
    writers_percent: Option<u8>,
    write_hold: Option<Duration>,
    exclusive_only: bool,
    key_prefix: Option<String>,
    seed: Option<u64>,
    scrapers: Option<usize>,
    metrics: Option<String>,
    json: bool,
}

/// The largest key space: 12 digits.
const KEYS_MAX: u64 = 1_000_000_000_000;
/// How long the end of a run waits for answers still owed.
const DRAIN: Duration = Duration::from_secs(10);
const PROGRESS_EVERY: Duration = Duration::from_secs(1);
/// Waits the server queues per connection by default (`--max-waits-per-conn`),
/// with a margin.
const WAITS_PER_CONN: u64 = 4000;

pub fn main(arguments: Vec<OsString>) -> u8 {
    let options = match parse(arguments) {
        Ok(Some(options)) => options,
        Ok(None) => {
            print!("{HELP}");
            return exit::DONE;
        }
        Err(message) => {
            eprintln!("kunci bench: {message}\n(see kunci bench --help)");
            return exit::USAGE;
        }
    };
    let run = match Run::plan(options) {
        Ok(run) => run,
        Err(message) => {
            eprintln!("kunci bench: {message}\n(see kunci bench --help)");
            return exit::USAGE;
        }
    };
    match run.execute() {
        Ok(stats) if stats.errors() == 0 => exit::DONE,
        Ok(_) => 1,
        Err(message) => {
            eprintln!("kunci bench: {message}");
            exit::UNAVAILABLE
        }
    }
}

fn parse(arguments: Vec<OsString>) -> Result<Option<Options>, String> {
    use lexopt::prelude::*;
    let mut o = Options::default();
    let mut parser = lexopt::Parser::from_args(arguments);
    while let Some(argument) = parser.next().map_err(|e| e.to_string())? {
        match argument {
            Long("server") => o.server = Some(args::address(parser.value())?),
            Long("secret-file") => o.secret_file = Some(parser.value().map_err(|e| e.to_string())?),
            Long("insecure-plaintext-secret") => o.allow_plaintext_secret = true,
            Long("connections") => o.connections = Some(positive("--connections", parser.value())?),
            Long("pipeline") => o.pipeline = Some(positive("--pipeline", parser.value())?),
            Long("keys") => o.keys = Some(count("--keys", parser.value())?),
            Long("duration") => {
                o.duration = Some(args::seconds("--duration", &args::text(parser.value())?)?)
            }
            Long("warmup") => {
                o.warmup = Some(args::seconds("--warmup", &args::text(parser.value())?)?)
            }
            Long("lease") => {
                let lease: u8 = args::number("--lease", parser.value())?;
                if lease == 0 {
                    return Err("--lease: must be 1..=255 seconds".into());
                }
                o.lease_s = Some(lease);
            }
            Long("wait") => o.wait_s = Some(args::number("--wait", parser.value())?),
            Long("hold") => {
                let ms: u64 = args::number("--hold", parser.value())?;
                o.hold = Some(Duration::from_millis(ms));
            }
            Long("limit") => {
                let limit: u16 = args::number("--limit", parser.value())?;
                if limit == 0 {
                    return Err("--limit: a semaphore needs at least 1 permit".into());
                }
                o.limit = Some(limit);
            }
            Long("writers") => {
                let percent: u8 = args::number("--writers", parser.value())?;
                if percent > 100 {
                    return Err("--writers: a percentage, 0..=100".into());
                }
                o.writers_percent = Some(percent);
            }
            Long("write-hold") => {
                let ms: u64 = args::number("--write-hold", parser.value())?;
                o.write_hold = Some(Duration::from_millis(ms));
            }
            Long("exclusive-only") => o.exclusive_only = true,
            Long("key-prefix") => {
                let prefix = args::text(parser.value())?;
                if prefix.len() + 12 > KEY_LEN_MAX || prefix.contains('\n') {
                    return Err(format!(
                        "--key-prefix: at most {} bytes, no newline",
                        KEY_LEN_MAX - 12
                    ));
                }
                o.key_prefix = Some(prefix);
            }
            Long("seed") => o.seed = Some(args::number("--seed", parser.value())?),
            Long("scrapers") => o.scrapers = Some(args::number("--scrapers", parser.value())?),
            Long("metrics") => o.metrics = Some(args::text(parser.value())?),
            Long("json") => o.json = true,
            Long(name) if name.starts_with("tls-") => {
                let name = name.to_owned();
                if !super::client::tls_option(&name, &mut parser, &mut o.tls)? {
                    return Err(format!("invalid option '--{name}'"));
                }
            }
            Short('h') | Long("help") => return Ok(None),
            Value(value) if o.workload.is_none() => {
                let name = value.string().map_err(|e| e.to_string())?;
                let mut n = || count(&name, parser.value());
                o.workload = Some(match name.as_str() {
                    "pairs" => Which::Pairs,
                    "contended" => Which::Contended,
                    "semaphore" => Which::Semaphore,
                    "rw" => Which::ReadWrite,
                    "timers" => Which::Timers,
                    "hold" => Which::Hold(n()?),
                    "waiters" => Which::Waiters(n()?),
                    "idle" => Which::Idle(n()?),
                    "watches" => Which::Watches(n()?),
                    "handover" => Which::HandOver(n()?),
                    other => return Err(format!("unknown workload {other:?}")),
                });
            }
            other => return Err(other.unexpected().to_string()),
        }
    }
    Ok(Some(o))
}

fn count(option: &str, value: Result<OsString, lexopt::Error>) -> Result<u64, String> {
    let n: u64 = args::number(option, value)
        .map_err(|_| format!("{option}: expected a count of 1..={KEYS_MAX}"))?;
    if n == 0 || n > KEYS_MAX {
        return Err(format!("{option}: expected a count of 1..={KEYS_MAX}"));
    }
    Ok(n)
}

fn positive(option: &str, value: Result<OsString, lexopt::Error>) -> Result<usize, String> {
    let n: usize = args::number(option, value)?;
    if n == 0 {
        return Err(format!("{option}: must be at least 1"));
    }
    Ok(n)
}

/// A planned run: the workload, its parameters, and how long it lasts.
struct Run {
    which: Which,
    server: Address,
    /// Sent as `U` first on every connection (a server with `--auth`).
    secret: Option<crate::client::Secret>,
    tls: super::client::TlsOptions,
    plan: Plan,
    mix: workloads::Mix,
    key_prefix: String,
    warmup: Duration,
    /// `None`: until SIGINT/SIGTERM.
    duration: Option<Duration>,
    /// Threads scraping `metrics` in a loop.
    scrapers: usize,
    metrics: Option<String>,
    json: bool,
}

impl Run {
    fn plan(o: Options) -> Result<Run, String> {
        let which = o.workload.unwrap_or(Which::Pairs);
        // (connections, pipeline, keys, lease, wait, duration s, warm-up s, prefix)
        let (connections, pipeline, keys, lease_s, wait_s, duration, warmup, prefix) = match which {
            Which::Pairs => (50, 32, 1_000_000, 10, 0, 10, 2, "pair-"),
            Which::Contended => (50, 1, 8, 10, 10, 10, 2, "cont-"),
            Which::Semaphore => (50, 1, 1, 10, 10, 10, 2, "sema-"),
            Which::ReadWrite => (50, 1, 1, 10, 10, 10, 2, "rdwr-"),
            Which::Hold(n) => (4, 128, n, 255, 0, 0, 0, "hold-"),
            Which::Waiters(n) => {
                let conns = 1 + n.div_ceil(WAITS_PER_CONN) as usize;
                (conns, 128, 1000, 255, 255, 0, 0, "wait-")
            }
            Which::Idle(n) => (n as usize, 1, 1, 1, 0, 0, 0, "idle-"),
            Which::Timers => (8, 1, 1, 1, 1, 30, 2, "timr-"),
            Which::Watches(n) => (events::connections(n), 1, 1, 255, 255, 10, 2, "wtch-"),
            Which::HandOver(n) => {
                let keys = n.div_ceil(events::WAITERS_PER_KEY);
                (events::connections(n), 1, keys, 255, 255, 10, 2, "hand-")
            }
        };
        let mut plan = Plan {
            connections: o.connections.unwrap_or(connections),
            pipeline: o.pipeline.unwrap_or(pipeline),
            keys: o.keys.unwrap_or(keys),
            lease_s: o.lease_s.unwrap_or(lease_s),
            wait_s: o.wait_s.unwrap_or(wait_s),
            hold: o.hold.unwrap_or(match which {
                Which::Semaphore | Which::ReadWrite => Duration::from_millis(1),
                _ => Duration::ZERO,
            }),
            seed: o.seed.unwrap_or(1),
        };
        let mix = match which {
            Which::Semaphore => workloads::Mix::Semaphore {
                limit: o.limit.unwrap_or(4),
            },
            Which::ReadWrite => workloads::Mix::ReadWrite {
                writers_percent: o.writers_percent.unwrap_or(10),
                write_hold: o.write_hold.unwrap_or(plan.hold),
                sharing: !o.exclusive_only,
            },
            _ => workloads::Mix::Exclusive,
        };
        if o.limit.is_some() && which != Which::Semaphore {
            return Err("--limit: only for the semaphore workload".into());
        }
        if (o.writers_percent.is_some() || o.write_hold.is_some() || o.exclusive_only)
            && which != Which::ReadWrite
        {
            return Err(
                "--writers, --write-hold, --exclusive-only: only for the rw workload".into(),
            );
        }
        match which {
            Which::Hold(n) | Which::Idle(n) if o.keys.is_some_and(|k| k != n) => {
                return Err("--keys: this workload's N is its key count".into());
            }
            Which::Waiters(_) if plan.connections < 2 => {
                return Err("waiters: needs --connections of at least 2".into());
            }
            Which::Idle(n) if o.connections.is_some_and(|c| c as u64 != n) => {
                return Err("idle: N is the number of connections".into());
            }
            Which::Watches(_) | Which::HandOver(_)
                if o.connections.is_some() || o.pipeline.is_some() =>
            {
                return Err("watches, handover: N sets the connections".into());
            }
            Which::HandOver(n)
                if o.keys
                    .is_some_and(|k| n.div_ceil(k) > events::WAITERS_PER_KEY) =>
            {
                return Err(format!(
                    "handover: at most {} waiters a key",
                    events::WAITERS_PER_KEY
                ));
            }
            Which::Watches(_) if o.keys.is_some() => {
                return Err("watches: one key is watched".into());
            }
            Which::Timers => plan.connections = workloads::Timers::connections(plan.connections),
            _ => {}
        }
        if matches!(o.server, Some(Address::Etcd { .. })) {
            if !matches!(which, Which::Pairs | Which::Contended) {
                return Err("etcd:// runs only the pairs and contended workloads".into());
            }
            if o.pipeline.is_some_and(|p| p != 1) {
                return Err("etcd://: one request in flight per connection (--pipeline 1)".into());
            }
            plan.pipeline = 1;
        }
        let scrapers = o.scrapers.unwrap_or(0);
        if scrapers > 0 && o.metrics.is_none() {
            return Err("--scrapers: needs --metrics HOST:PORT".into());
        }
        if matches!(o.server, Some(Address::Etcd { .. })) && scrapers > 0 {
            return Err("--scrapers: not with etcd://".into());
        }
        let duration = o.duration.unwrap_or(Duration::from_secs(duration));
        let server = match o.server {
            Some(server) => server,
            // One server is driven: the first of $KUNCI_SERVER's.
            None => super::client::default_servers()?
                .into_iter()
                .next()
                .unwrap_or_else(|| Address::Tcp(DEFAULT_ADDRESS.to_owned())),
        };
        let secret = super::client::secret(o.secret_file)?;
        super::client::check_plaintext_secret(
            std::slice::from_ref(&server),
            secret.as_ref(),
            o.allow_plaintext_secret,
        )?;
        Ok(Run {
            which,
            secret,
            tls: o.tls,
            server,
            plan,
            mix,
            key_prefix: o.key_prefix.unwrap_or_else(|| prefix.to_owned()),
            warmup: o.warmup.unwrap_or(Duration::from_secs(warmup)),
            duration: (!duration.is_zero()).then_some(duration),
            scrapers,
            metrics: o.metrics,
            json: o.json,
        })
    }

    fn name(&self) -> String {
        match self.which {
            Which::Pairs => "pairs".into(),
            Which::Contended => "contended".into(),
            Which::Semaphore => "semaphore".into(),
            Which::ReadWrite => "rw".into(),
            Which::Hold(n) => format!("hold {n}"),
            Which::Waiters(n) => format!("waiters {n}"),
            Which::Idle(n) => format!("idle {n}"),
            Which::Timers => "timers".into(),
            Which::Watches(n) => format!("watches {n}"),
            Which::HandOver(n) => format!("handover {n}"),
        }
    }

    fn workload(&self) -> Box<dyn Workload> {
        let plan = self.plan.clone();
        match self.which {
            Which::Pairs | Which::Contended | Which::Semaphore | Which::ReadWrite => {
                Box::new(workloads::Cycles::new(plan, self.mix))
            }
            Which::Hold(_) => Box::new(workloads::Hold::new(plan)),
            Which::Waiters(n) => Box::new(workloads::Waiters::new(plan, n)),
            Which::Idle(_) => Box::new(workloads::Idle::new(&plan)),
            Which::Timers => Box::new(workloads::Timers::new((plan.connections - 1) / 3)),
            Which::Watches(n) => Box::new(events::Watches::new(
                n,
                plan.connections,
                plan.lease_s,
                plan.wait_s,
            )),
            Which::HandOver(n) => Box::new(events::HandOver::new(
                n,
                plan.keys,
                plan.connections,
                plan.lease_s,
                plan.wait_s,
            )),
        }
    }

    fn execute(&self) -> Result<Stats, String> {
        let wanted = self.plan.connections + 64;
        if let Some(limit) = crate::server::raise_fd_limit(wanted).filter(|&l| l < wanted as u64) {
            return Err(format!(
                "{} connections need a file descriptor limit of {wanted}; it is {limit} (ulimit -n)",
                self.plan.connections
            ));
        }
        let stop = Arc::new(AtomicBool::new(false));
        for signal in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
            signal_hook::flag::register(signal, Arc::clone(&stop))
                .map_err(|e| format!("cannot handle signal {signal}: {e}"))?;
        }
        #[cfg(feature = "etcd")]
        if matches!(self.server, Address::Etcd { .. }) {
            let stats = closed_loop::execute(self, &stop)?;
            return Ok(self.report(stats));
        }
        let mut fleet = Fleet::connect(
            &self.server,
            &self.tls,
            self.plan.connections,
            &self.key_prefix,
            self.secret.as_ref(),
        )
        .map_err(|e| e.to_string())?;
        let mut workload = self.workload();
        let mut progress = Progress::new(std::io::stderr().is_terminal());
        let scrapers = Scrapers::start(self.scrapers, self.metrics.as_deref());
        let pinger =
            matches!(self.which, Which::Watches(_) | Which::HandOver(_)) || self.scrapers > 0;
        let mut pinger = if pinger {
            Some(Pinger::start(&self.server).map_err(|e| format!("the innocent client: {e}"))?)
        } else {
            None
        };

        let start = Instant::now();
        fleet.wire.now = start;
        let mut stats = Stats::new(start);
        if self.warmup.is_zero() {
            stats.begin(start);
        }
        workload.start(&mut fleet.wire, &mut stats);
        let measure_from = start + self.warmup;
        let until = self.duration.map(|d| measure_from + d);
        loop {
            let now = Instant::now();
            fleet.wire.now = now;
            if !stats.measuring() && now >= measure_from {
                stats.begin(now);
            }
            if stop.load(Ordering::Relaxed) || until.is_some_and(|u| now >= u) || fleet.open() == 0
            {
                break;
            }
            let next = workload.tick(&mut fleet.wire, &mut stats);
            scrapers.collect(&mut stats);
            if let Some(pinger) = pinger.as_mut() {
                pinger.collect(&mut stats);
            }
            progress.show(now, &stats, &*workload);
            let wake = [
                next,
                (!stats.measuring()).then_some(measure_from),
                until,
                Some(progress.next),
            ]
            .into_iter()
            .flatten()
            .min()
            .unwrap_or(now + PROGRESS_EVERY);
            fleet
                .turn(
                    wake.saturating_duration_since(now),
                    &mut *workload,
                    &mut stats,
                )
                .map_err(|e| format!("poll failed: {e}"))?;
        }
        scrapers.collect(&mut stats);
        drop(scrapers);
        if let Some(pinger) = pinger.as_mut() {
            pinger.collect(&mut stats);
            pinger.during(&workload.windows(Instant::now()), measure_from, &mut stats);
        }
        drop(pinger);
        let stopped = Instant::now();
        stats.end(stopped);
        fleet.wire.now = stopped;
        workload.stop(&mut fleet.wire, &mut stats);
        let drain_until = stopped + DRAIN;
        while fleet.wire.in_flight_total() > 0 && fleet.open() > 0 {
            let now = Instant::now();
            if now >= drain_until {
                stats.error(format!(
                    "{} requests still unanswered {} s after the run ended",
                    fleet.wire.in_flight_total(),
                    DRAIN.as_secs()
                ));
                break;
            }
            fleet.wire.now = now;
            workload.tick(&mut fleet.wire, &mut stats);
            fleet
                .turn(
                    (drain_until - now).min(PROGRESS_EVERY),
                    &mut *workload,
                    &mut stats,
                )
                .map_err(|e| format!("poll failed: {e}"))?;
        }
        workload.finish(&mut stats);
        progress.clear();
        Ok(self.report(stats))
    }

    fn report(&self, stats: Stats) -> Stats {
        if self.json {
            println!("{}", stats.json(&self.header()));
        } else {
            print!("{}", stats.human(&self.title()));
        }
        stats
    }

    /// What a `semaphore` or `rw` run asks for, for its title.
    fn mix_text(&self) -> String {
        match self.mix {
            workloads::Mix::Exclusive => String::new(),
            workloads::Mix::Semaphore { limit } => format!(", limit {limit}"),
            workloads::Mix::ReadWrite {
                writers_percent,
                write_hold,
                sharing,
            } => format!(
                ", {writers_percent} % writers holding {} ms{}",
                write_hold.as_millis(),
                if sharing { "" } else { ", all exclusive" }
            ),
        }
    }

    fn title(&self) -> String {
        let p = &self.plan;
        format!(
            "kunci bench {} against {}: {} connections × {} in flight, {} keys, \
             lease {} s, wait {} s, hold {} ms{}, {} s warm-up",
            self.name(),
            self.server,
            p.connections,
            p.pipeline,
            p.keys,
            p.lease_s,
            p.wait_s,
            p.hold.as_millis(),
            self.mix_text(),
            crate::decimal::seconds_shortest(self.warmup)
        )
    }

    fn header(&self) -> Vec<(&'static str, String)> {
        let p = &self.plan;
        let mut header = vec![
            ("workload", json_string(&self.name())),
            ("server", json_string(&self.server.to_string())),
            ("connections", p.connections.to_string()),
            ("pipeline", p.pipeline.to_string()),
            ("keys", p.keys.to_string()),
            ("lease_s", p.lease_s.to_string()),
            ("wait_s", p.wait_s.to_string()),
            ("hold_ms", p.hold.as_millis().to_string()),
        ];
        match self.mix {
            workloads::Mix::Exclusive => {}
            workloads::Mix::Semaphore { limit } => header.push(("limit", limit.to_string())),
            workloads::Mix::ReadWrite {
                writers_percent,
                write_hold,
                sharing,
            } => {
                header.push(("writers_percent", writers_percent.to_string()));
                header.push(("write_hold_ms", write_hold.as_millis().to_string()));
                header.push(("sharing", sharing.to_string()));
            }
        }
        header.extend([
            ("seed", p.seed.to_string()),
            ("warmup_s", crate::decimal::seconds(self.warmup, 3)),
        ]);
        header
    }
}

/// Threads that scrape a metrics listener in a loop (`--scrapers`), each
/// scrape's time sent back to the run; they stop when this is dropped.
struct Scrapers {
    stop: Arc<AtomicBool>,
    threads: Vec<std::thread::JoinHandle<()>>,
    done: std::sync::mpsc::Receiver<Result<Duration, String>>,
}

impl Scrapers {
    fn start(count: usize, address: Option<&str>) -> Scrapers {
        let stop = Arc::new(AtomicBool::new(false));
        let (sender, done) = std::sync::mpsc::channel();
        let threads = match address {
            Some(address) => (0..count)
                .map(|_| {
                    let (stop, sender) = (Arc::clone(&stop), sender.clone());
                    let address = address.to_owned();
                    std::thread::spawn(move || {
                        while !stop.load(Ordering::Relaxed) {
                            let started = Instant::now();
                            let result = scrape(&address).map(|()| started.elapsed());
                            if sender.send(result).is_err() {
                                return;
                            }
                        }
                    })
                })
                .collect(),
            None => Vec::new(),
        };
        Scrapers {
            stop,
            threads,
            done,
        }
    }

    /// Adds the scrapes finished since the last call to `stats`.
    fn collect(&self, stats: &mut Stats) {
        if self.threads.is_empty() {
            return;
        }
        while let Ok(result) = self.done.try_recv() {
            match result {
                Ok(took) => {
                    stats.count("scrapes", 1);
                    stats.sample("scrape", took);
                }
                Err(e) => stats.error(format!("scrape: {e}")),
            }
        }
    }
}

impl Drop for Scrapers {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
    }
}

/// An innocent client: one thread, one connection of its own, a ping at a
/// time 1 ms apart; each round trip is a sample of `innocent_ping`. Kept
/// out of the fleet's loop, which a burst of answers may keep busy.
struct Pinger {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
    done: std::sync::mpsc::Receiver<Result<(Instant, Duration), String>>,
    /// Every round trip so far: when it started, how long it took.
    samples: Vec<(Instant, Duration)>,
}

impl Pinger {
    fn start(server: &Address) -> Result<Pinger, String> {
        let mut stream: Box<dyn ReadWrite> = match server {
            Address::Tcp(host_port) => {
                let stream = std::net::TcpStream::connect(host_port.as_str())
                    .map_err(|e| format!("{server}: {e}"))?;
                stream.set_nodelay(true).map_err(|e| e.to_string())?;
                Box::new(stream)
            }
            Address::Unix(path) => Box::new(
                std::os::unix::net::UnixStream::connect(path)
                    .map_err(|e| format!("{server}: {e}"))?,
            ),
            _ => return Err("only tcp and unix: servers".into()),
        };
        let stop = Arc::new(AtomicBool::new(false));
        let (sender, done) = std::sync::mpsc::channel();
        let thread = {
            let stop = Arc::clone(&stop);
            // Named, so that a benchmark script can find it (and renice it).
            std::thread::Builder::new()
                .name("innocent-ping".into())
                .spawn(move || {
                    let mut nonce = 0;
                    while !stop.load(Ordering::Relaxed) {
                        nonce += 1;
                        let started = Instant::now();
                        let result =
                            ping(&mut *stream, nonce).map(|()| (started, started.elapsed()));
                        let failed = result.is_err();
                        if sender.send(result).is_err() || failed {
                            return;
                        }
                        std::thread::sleep(Duration::from_millis(1));
                    }
                })
        }
        .map_err(|e| e.to_string())?;
        Ok(Pinger {
            stop,
            thread: Some(thread),
            done,
            samples: Vec::new(),
        })
    }

    fn collect(&mut self, stats: &mut Stats) {
        while let Ok(result) = self.done.try_recv() {
            match result {
                Ok((started, took)) => {
                    stats.sample("innocent_ping", took);
                    self.samples.push((started, took));
                }
                Err(e) => stats.error(format!("the innocent client: {e}")),
            }
        }
    }

    /// Adds `ping_in_event`: the round trips measured (from `from` on)
    /// that overlap one of `windows`, the spans of the workload's events.
    fn during(&self, windows: &[(Instant, Instant)], from: Instant, stats: &mut Stats) {
        for &(started, took) in &self.samples {
            let ended = started + took;
            let overlaps = windows
                .iter()
                .any(|&(begin, end)| started < end && ended > begin);
            if started >= from && overlaps {
                stats.sample("ping_in_event", took);
            }
        }
    }
}

impl Drop for Pinger {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

trait ReadWrite: std::io::Read + std::io::Write + Send {}
impl<T: std::io::Read + std::io::Write + Send> ReadWrite for T {}

/// One `P nonce` and its `Pong`.
fn ping(stream: &mut dyn ReadWrite, nonce: u64) -> Result<(), String> {
    let mut frame = Vec::new();
    crate::protocol::encode_request(&crate::protocol::Request::Ping { nonce }, &mut frame);
    stream.write_all(&frame).map_err(|e| e.to_string())?;
    let mut answer = Vec::new();
    let mut buffer = [0u8; 64];
    loop {
        match crate::protocol::decode_response(&answer) {
            Ok(Some((crate::protocol::Response::Pong { nonce: got }, _))) if got == nonce => {
                return Ok(());
            }
            Ok(Some((other, _))) => return Err(format!("answered {other:?}")),
            Ok(None) => {}
            Err(e) => return Err(e.to_string()),
        }
        let n = stream.read(&mut buffer).map_err(|e| e.to_string())?;
        if n == 0 {
            return Err("the server closed the connection".into());
        }
        answer.extend_from_slice(&buffer[..n]);
    }
}

/// One `GET /metrics` on a fresh connection, read to the end.
fn scrape(address: &str) -> Result<(), String> {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(address).map_err(|e| e.to_string())?;
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .map_err(|e| e.to_string())?;
    stream
        .write_all(b"GET /metrics HTTP/1.1\r\nHost: kunci\r\n\r\n")
        .map_err(|e| e.to_string())?;
    let mut answer = Vec::new();
    stream.read_to_end(&mut answer).map_err(|e| e.to_string())?;
    if answer.starts_with(b"HTTP/1.1 200 ") {
        Ok(())
    } else {
        Err(format!(
            "answered {:?}",
            String::from_utf8_lossy(&answer[..answer.len().min(40)])
        ))
    }
}

/// The one-line progress display, on stderr when it is a terminal.
struct Progress {
    enabled: bool,
    next: Instant,
    last: Instant,
    last_replies: u64,
    started: Instant,
}

impl Progress {
    fn new(enabled: bool) -> Progress {
        let now = Instant::now();
        Progress {
            enabled,
            next: now + PROGRESS_EVERY,
            last: now,
            last_replies: 0,
            started: now,
        }
    }

    fn show(&mut self, now: Instant, stats: &Stats, workload: &dyn Workload) {
        if now < self.next {
            return;
        }
        self.next = now + PROGRESS_EVERY;
        let interval = now.saturating_duration_since(self.last);
        let replies = stats.replies_seen - self.last_replies;
        self.last = now;
        self.last_replies = stats.replies_seen;
        if self.enabled && !interval.is_zero() {
            let (numerator, denominator) = crate::decimal::per_second(replies, interval);
            eprint!(
                "\r{:>6} s {:>12} replies/s  {}{}\x1b[K",
                crate::decimal::seconds(now.saturating_duration_since(self.started), 0),
                crate::decimal::fixed(numerator, denominator, 0),
                workload.progress(),
                if stats.measuring() { "" } else { "  (warm-up)" }
            );
        }
    }

    fn clear(&self) {
        if self.enabled {
            eprint!("\r\x1b[K");
        }
    }
}
