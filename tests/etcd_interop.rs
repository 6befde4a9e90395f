//! etcd's own layout (`?layout=etcd`, docs/ETCD.md, "Two layouts"): the
//! client's and the CLI's exclusive locks and elections share etcd's
//! `client/v3/concurrency` recipe with the real `etcdctl lock` and
//! `etcdctl elect` (Debian's etcd-client): one FIFO queue, never two
//! holders, `kunci who` shows etcdctl's holders, `kunci leader --watch`
//! follows etcdctl's leaders and `etcdctl elect -l` kunci's; and what that
//! recipe cannot express is refused before anything is sent.
//!
//! Each test starts its own one-member cluster on loopback. Without `etcd`
//! or `etcdctl` installed they fail under CI and are skipped, saying so,
//! elsewhere (`util::require_tool`).

use std::io::{BufRead, BufReader};
use std::net::TcpListener;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use base64::Engine as _;
use kunci::client::{AcquireOptions, Client, Config, Error, Permits};

use crate::util::etcd::{Cluster, post};
use crate::util::{TempDir, kunci_command, require_tool};

const MS: Duration = Duration::from_millis(1);
const S: Duration = Duration::from_secs(1);

const EXCLUSIVE_ONLY: &str =
    "etcd's layout (?layout=etcd) has exclusive locks only: no limit, take or shared";
const NO_LISTING: &str =
    "etcd's layout (?layout=etcd) cannot list keys: its locks are anywhere in etcd's keys";
const RESERVED_NAME: &str = "etcd's layout (?layout=etcd) refuses kunci and kunci/…: kunci's own layout keeps its locks there";

/// Whether etcd and etcdctl are installed (under CI a missing one fails).
fn tools() -> bool {
    require_tool("etcd", "etcd-server") && require_tool("etcdctl", "etcd-client")
}

fn layout(cluster: &Cluster) -> String {
    format!("{}?layout=etcd", cluster.address())
}

fn client_of(address: &str) -> Client {
    Client::new([address.parse().unwrap()], Config::default()).unwrap()
}

/// `etcdctl ARGS` on the cluster's members.
fn etcdctl(cluster: &Cluster, args: &[&str]) -> Command {
    let endpoints: Vec<&str> = cluster.members.iter().map(|m| m.client.as_str()).collect();
    let mut command = Command::new("etcdctl");
    command
        .env("ETCDCTL_API", "3")
        .args(["--endpoints", &endpoints.join(",")])
        .args(args)
        .stdin(Stdio::null());
    command
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// A child that is killed if the test ends before it does.
struct Reaped(Option<Child>);

impl Reaped {
    fn spawn(command: &mut Command) -> Reaped {
        Reaped(Some(command.spawn().expect("spawn")))
    }

    fn child(&mut self) -> &mut Child {
        self.0.as_mut().expect("not finished")
    }

    /// Its output once it exits, killed at `by` if it has not.
    fn finish(mut self, by: Instant) -> Output {
        let mut child = self.0.take().expect("not finished");
        while child.try_wait().expect("try_wait").is_none() && Instant::now() < by {
            std::thread::sleep(20 * MS);
        }
        let _ = child.kill();
        child.wait_with_output().expect("output")
    }

    fn interrupt(&mut self) {
        let pid = self.child().id() as i32;
        // SAFETY: kill(2) on our own child's pid.
        unsafe { libc::kill(pid, libc::SIGINT) };
    }
}

impl Drop for Reaped {
    fn drop(&mut self) {
        if let Some(mut child) = self.0.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// An entry under `NAME/` as etcd's gateway shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Entry {
    key: String,
    create_revision: u64,
    lease: u64,
    value: String,
}

fn base64_text(text: &str) -> String {
    base64::engine::general_purpose::STANDARD.encode(text)
}

/// Every entry under `NAME/`, by create revision.
fn entries(cluster: &Cluster, name: &str) -> Vec<Entry> {
    let body = format!(
        r#"{{"key":"{}","range_end":"{}","sort_target":"CREATE","sort_order":"ASCEND"}}"#,
        base64_text(&format!("{name}/")),
        base64_text(&format!("{name}0")),
    );
    let answer = post(&cluster.members[0].client, "/v3/kv/range", &body).expect("a range answer");
    let answer = unchunked(&answer);
    // The gateway writes each kv as one flat object of string fields
    // (base64, or 64-bit integers as decimal strings): no JSON parser needed.
    let Some(kvs) = answer.split_once("\"kvs\":[").map(|(_, rest)| rest) else {
        return Vec::new();
    };
    let kvs = &kvs[..kvs.find(']').expect("the end of kvs")];
    kvs.split('}')
        .filter(|kv| kv.contains('{'))
        .map(|kv| {
            let field = |name: &str| {
                let start = format!("\"{name}\":\"");
                kv.split_once(start.as_str())
                    .and_then(|(_, rest)| rest.split_once('"'))
                    .map_or_else(String::new, |(value, _)| value.to_owned())
            };
            let decoded = |name: &str| {
                text(
                    &base64::engine::general_purpose::STANDARD
                        .decode(field(name))
                        .expect("base64"),
                )
            };
            Entry {
                key: decoded("key"),
                create_revision: field("create_revision").parse().expect("create_revision"),
                lease: field("lease").parse().expect("lease"),
                value: decoded("value"),
            }
        })
        .collect()
}

/// An HTTP body without its chunked transfer coding, if it has one (the
/// gateway chunks a larger answer).
fn unchunked(body: &str) -> String {
    if body.starts_with('{') {
        return body.to_owned();
    }
    let mut rest = body;
    let mut joined = String::new();
    while let Some((size, after)) = rest.split_once("\r\n") {
        let size = usize::from_str_radix(size.trim(), 16).expect("a chunk size");
        if size == 0 {
            break;
        }
        joined.push_str(&after[..size]);
        rest = after[size..].trim_start_matches("\r\n");
    }
    joined
}

/// Waits up to `limit` for `condition`.
fn wait_for(limit: Duration, mut condition: impl FnMut() -> bool) -> bool {
    let give_up = Instant::now() + limit;
    loop {
        if condition() {
            return true;
        }
        if Instant::now() >= give_up {
            return false;
        }
        std::thread::sleep(20 * MS);
    }
}

// ------------------------------------------------------ the address option

#[test]
fn etcd_layout_refuses_what_etcds_recipe_cannot_express_before_anything_is_sent() {
    // Nothing may connect here: a request sent would show as a connection.
    let silent = TcpListener::bind("127.0.0.1:0").unwrap();
    silent.set_nonblocking(true).unwrap();
    let member = silent.local_addr().unwrap().to_string();
    let server = format!("etcd://{member}?layout=etcd");
    let refused: &[(&[&str], &str)] = &[
        (
            &["run", "jobs", "--limit", "3", "--", "true"],
            EXCLUSIVE_ONLY,
        ),
        (
            &["run", "jobs", "--shared", "--wait", "5", "--", "true"],
            EXCLUSIVE_ONLY,
        ),
        (
            &["acquire", "jobs", "--limit", "3", "--take", "2"],
            EXCLUSIVE_ONLY,
        ),
        (
            &["acquire", "jobs", "--limit", "2", "--exclusive"],
            EXCLUSIVE_ONLY,
        ),
        (
            &["acquire", "jobs", "--shared", "--wait", "inf"],
            EXCLUSIVE_ONLY,
        ),
        (&["list"], NO_LISTING),
        (&["list", "jobs/", "--json"], NO_LISTING),
        // Where kunci's own layout keeps its entries (kunci/LEN:KEY/…).
        (&["run", "kunci", "--", "true"], RESERVED_NAME),
        (&["acquire", "kunci/4:jobs", "--wait", "5"], RESERVED_NAME),
        (&["query", "kunci/"], RESERVED_NAME),
        (&["leader", "kunci/db"], RESERVED_NAME),
    ];
    for (args, why) in refused {
        let started = Instant::now();
        let output = kunci_command(&server, args).output().unwrap();
        assert_eq!(output.status.code(), Some(2), "{args:?}: {output:?}");
        assert_eq!(
            text(&output.stderr),
            format!(
                "kunci {0}: invalid argument: {why} (see kunci {0} --help)\n",
                args[0]
            ),
            "{args:?}"
        );
        assert_eq!(text(&output.stdout), "", "{args:?}");
        assert!(started.elapsed() < 2 * S, "{args:?}");
    }
    // One cluster has one layout, however its members are given.
    let mixed = kunci_command(
        &server,
        &[
            "query",
            "jobs",
            "--server",
            &server,
            "--server",
            &format!("etcd://{member}"),
        ],
    )
    .output()
    .unwrap();
    assert_eq!(mixed.status.code(), Some(2), "{mixed:?}");
    assert_eq!(
        text(&mixed.stderr),
        "kunci query: the members of one etcd cluster have one layout: give ?layout=etcd \
         on every etcd:// address or on none\n(see kunci query --help)\n"
    );
    let unknown = kunci_command(&format!("etcd://{member}?layout=zk"), &["query", "jobs"])
        .output()
        .unwrap();
    assert_eq!(unknown.status.code(), Some(2), "{unknown:?}");
    assert_eq!(
        text(&unknown.stderr),
        format!(
            "kunci query: KUNCI_SERVER: invalid address \"etcd://{member}?layout=zk\": unknown \
             option \"layout=zk\" (etcd addresses take ?layout=kunci or ?layout=etcd)\n\
             (see kunci query --help)\n"
        )
    );
    // The library: the same refusals, the same mixed members.
    let client = client_of(&server);
    for permits in [
        Permits::limit(3),
        Permits::limit(3).take(0),
        Permits::shared(),
    ] {
        let options = AcquireOptions::new().permits(permits);
        assert_eq!(
            client.acquire_with("jobs", S, S, options).unwrap_err(),
            Error::InvalidArgument(EXCLUSIVE_ONLY)
        );
    }
    assert_eq!(
        client.list_keys("", 0, 10).unwrap_err(),
        Error::InvalidArgument(NO_LISTING)
    );
    let both = [
        server.parse().unwrap(),
        format!("etcd://{member}").parse().unwrap(),
    ];
    let error = Client::new(both, Config::default()).unwrap_err();
    assert_eq!(error.kind(), std::io::ErrorKind::InvalidInput);
    assert!(error.to_string().contains("one layout"), "{error}");
    match silent.accept() {
        Err(error) => assert_eq!(error.kind(), std::io::ErrorKind::WouldBlock),
        Ok((_, peer)) => panic!("a request was sent: {peer} connected"),
    }
}

#[test]
fn etcd_layout_writes_etcds_keys_and_values_and_names_nest_as_etcds() {
    if !tools() {
        return;
    }
    let cluster = Cluster::start(1);
    let client = client_of(&layout(&cluster));
    let options = AcquireOptions::new().label("rs@db1");
    let ticket = client
        .acquire_with("jobs/report", S, 10 * S, options)
        .unwrap();
    let found = entries(&cluster, "jobs/report");
    assert_eq!(found.len(), 1, "{found:?}");
    let entry = &found[0];
    // `NAME/` + the lease id, lowercase hex, unpadded (Go's `%x`).
    assert_eq!(entry.key, format!("jobs/report/{:x}", entry.lease));
    assert_eq!(
        (entry.create_revision, entry.value.as_str()),
        (ticket.token(), "rs@db1")
    );
    let status = client.query("jobs/report").unwrap();
    assert_eq!((status.token, status.owner), (ticket.token(), 0));
    // A name owns the names below it, as in Go's recipe: `jobs` waits for
    // `jobs/report`, while `jobs/report/x` has its own prefix.
    assert_eq!(
        client.acquire("jobs", Duration::ZERO, 10 * S).unwrap_err(),
        Error::Timeout
    );
    client
        .acquire("jobs/report/x", Duration::ZERO, 10 * S)
        .unwrap()
        .release()
        .unwrap();
    // kunci's layout keeps its own keys: the same name is another lock.
    let other = cluster
        .client()
        .acquire("jobs/report", Duration::ZERO, 10 * S)
        .unwrap();
    assert_eq!(entries(&cluster, "jobs/report"), found);
    other.release().unwrap();
    ticket.release().unwrap();
    assert_eq!(entries(&cluster, "jobs/report"), []);
    assert_eq!(entries(&cluster, "jobs"), []);
}

// ------------------------------------------------------- with etcdctl lock

/// A critical section: claims a marker file (`set -C`: it fails while
/// another holder is inside), logs its entry and exit with who it is
/// (`kunci`: its token; `etcdctl`: the key and revision etcdctl exports),
/// and holds for 50 ms.
const CRITICAL: &str = r#"
set -C
case $1 in
    kunci) id=$KUNCI_TOKEN ;;
    *) id="$ETCD_LOCK_KEY $ETCD_LOCK_REV" ;;
esac
if ! echo "$1" > "$MARKER" 2>/dev/null; then echo OVERLAP >> "$LOG"; fi
echo "enter $1 $id" >> "$LOG"
sleep 0.05
echo "leave $1 $id" >> "$LOG"
rm -f "$MARKER"
"#;

#[test]
fn etcd_layout_kunci_run_and_etcdctl_lock_never_overlap_and_hand_over_in_fifo_order() {
    if !tools() {
        return;
    }
    const ROUNDS: usize = 24;
    let cluster = Cluster::start(1);
    let server = layout(&cluster);
    let dir = TempDir::new("etcd-interop");
    let (marker, log) = (dir.join("marker"), dir.join("log"));
    let name = "fifo";
    let first = client_of(&server)
        .acquire(name, Duration::ZERO, 30 * S)
        .unwrap();
    // Alternating etcdctl and kunci waiters, each queued before the next
    // starts: their create revisions are the queue.
    let mut waiters = Vec::new();
    let mut queue = Vec::new();
    for index in 0..ROUNDS {
        let tag = if index % 2 == 0 { "etcdctl" } else { "kunci" };
        let mut command = if tag == "etcdctl" {
            etcdctl(
                &cluster,
                &["lock", name, "--", "sh", "-c", CRITICAL, "sh", tag],
            )
        } else {
            let args = [
                "run", name, "--wait", "60", "--lease", "10", "--", "sh", "-c",
            ];
            let mut command = kunci_command(&server, &args);
            command.args([CRITICAL, "sh", tag]);
            command
        };
        command
            .env("MARKER", &marker)
            .env("LOG", &log)
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        waiters.push((tag, Reaped::spawn(&mut command)));
        assert!(
            wait_for(10 * S, || entries(&cluster, name).len() == index + 2),
            "waiter {index} did not queue: {:?}",
            entries(&cluster, name)
        );
        let found = entries(&cluster, name);
        queue.push((tag, found[index + 1].clone()));
    }
    let started = Instant::now();
    first.release().unwrap();
    let by = Instant::now() + 60 * S;
    for (tag, waiter) in waiters {
        let output = waiter.finish(by);
        assert_eq!(output.status.code(), Some(0), "{tag}: {output:?}");
    }
    let elapsed = started.elapsed();
    let log = std::fs::read_to_string(&log).unwrap();
    let lines: Vec<&str> = log.lines().collect();
    assert!(!lines.contains(&"OVERLAP"), "{log}");
    assert_eq!(lines.len(), 2 * ROUNDS, "{log}");
    let mut last_lock_revision = 0;
    for (index, (tag, entry)) in queue.iter().enumerate() {
        let (enter, leave) = (lines[2 * index], lines[2 * index + 1]);
        let id = enter
            .strip_prefix(&format!("enter {tag} "))
            .unwrap_or_else(|| panic!("holder {index} should be {tag}:\n{log}"));
        assert_eq!(leave, format!("leave {tag} {id}"), "{log}");
        if *tag == "kunci" {
            // The fencing token is the entry's create revision.
            assert_eq!(id, entry.create_revision.to_string(), "{log}");
        } else {
            // etcdctl exports its key, and the revision at which it saw
            // the lock: after its own entry was created and after the
            // previous etcdctl holder's.
            let (key, revision) = id.split_once(' ').expect("key and revision");
            assert_eq!(key, entry.key, "{log}");
            let revision: u64 = revision.parse().expect("ETCD_LOCK_REV");
            assert!(revision > entry.create_revision, "{log}");
            assert!(revision > last_lock_revision, "{log}");
            last_lock_revision = revision;
        }
    }
    assert!(
        wait_for(5 * S, || entries(&cluster, name).is_empty()),
        "{:?}",
        entries(&cluster, name)
    );
    // One holder at a time, each inside for at least 50 ms.
    assert!(elapsed >= ROUNDS as u32 * 50 * MS, "{elapsed:?}");
    assert!(elapsed < 30 * S, "{elapsed:?}");
}

#[test]
fn etcd_layout_kunci_who_and_query_show_an_etcdctl_holder_and_a_kunci_waiter() {
    if !tools() {
        return;
    }
    let cluster = Cluster::start(1);
    let server = layout(&cluster);
    let name = "held-by-etcdctl";
    let mut holder = Reaped::spawn(etcdctl(&cluster, &["lock", name]).stdout(Stdio::piped()));
    let mut key = String::new();
    BufReader::new(holder.child().stdout.as_mut().unwrap())
        .read_line(&mut key)
        .unwrap();
    let found = entries(&cluster, name);
    assert_eq!(found.len(), 1, "{found:?}");
    assert_eq!(key.trim_end(), found[0].key);
    let revision = found[0].create_revision;

    // A try fails at once; a waiter queues behind etcdctl's holder.
    let tried = kunci_command(&server, &["acquire", name]).output().unwrap();
    assert_eq!(tried.status.code(), Some(1), "{tried:?}");
    let waiter = Reaped::spawn(
        kunci_command(
            &server,
            &["acquire", name, "--wait", "30", "--label", "ann@db2"],
        )
        .stdout(Stdio::piped())
        .stderr(Stdio::piped()),
    );
    assert!(wait_for(10 * S, || entries(&cluster, name).len() == 2));

    let who = kunci_command(&server, &["who", name, "--json"])
        .output()
        .unwrap();
    assert_eq!(who.status.code(), Some(0), "{who:?}");
    let json = text(&who.stdout);
    // etcdctl lock's session lease is 10 s, shown in whole seconds.
    let lease_ms = json
        .split_once(r#""lease_ms":"#)
        .and_then(|(_, rest)| rest.split_once(','))
        .map(|(ms, _)| ms.to_owned())
        .expect("lease_ms");
    assert!(["9000", "10000"].contains(&lease_ms.as_str()), "{json}");
    assert_eq!(
        json,
        format!(
            r#"{{"key":"{name}","limit":0,"left_out":0,"grants":[{{"token":"{revision}","owner":"0","lease_ms":{lease_ms},"held_ms":null,"take":0,"label":""}}],"waiters":[{{"owner":"0","wait_ms":null,"take":0,"label":"ann@db2"}}]}}"#
        ) + "\n"
    );
    let table = kunci_command(&server, &["who", name]).output().unwrap();
    let table = text(&table.stdout);
    let lines: Vec<&str> = table.lines().collect();
    assert_eq!(
        lines[0],
        format!("{name}: limit none, 1 grant, 1 waiter"),
        "{table}"
    );
    assert_eq!(lines.len(), 6, "{table}");
    let row: Vec<&str> = lines[2].split_whitespace().collect();
    assert_eq!(
        row[..3],
        [revision.to_string().as_str(), "0", "all"],
        "{table}"
    );
    assert_eq!(row[5], "unknown", "{table}");
    assert_eq!(
        lines[5].split_whitespace().collect::<Vec<_>>(),
        ["1", "0", "all", "unknown", "ann@db2"],
        "{table}"
    );
    let query = kunci_command(&server, &["query", name]).output().unwrap();
    let query = text(&query.stdout);
    assert!(
        query.starts_with(&format!("held token={revision} owner=0 lease_ms=")),
        "{query}"
    );
    assert!(query.ends_with(" waiters=1 grants=1\n"), "{query}");

    // etcdctl unlocks on SIGINT: the kunci waiter holds next, with the
    // create revision of the entry it queued.
    let queued = entries(&cluster, name)[1].create_revision;
    holder.interrupt();
    let output = waiter.finish(Instant::now() + 10 * S);
    assert_eq!(output.status.code(), Some(0), "{output:?}");
    assert_eq!(text(&output.stdout), format!("{queued}\n"));
    assert!(queued > revision);
    let found = entries(&cluster, name);
    assert_eq!(found.len(), 1, "{found:?}");
    assert_eq!(
        (found[0].create_revision, found[0].value.as_str()),
        (queued, "ann@db2")
    );
    let released = kunci_command(&server, &["release", name, &queued.to_string()])
        .output()
        .unwrap();
    assert_eq!(released.status.code(), Some(0), "{released:?}");
    assert_eq!(entries(&cluster, name), []);
    let holder = holder.finish(Instant::now() + 5 * S);
    assert!(holder.status.success(), "{holder:?}");
}

// ------------------------------------------------------ with etcdctl elect

/// The lines a child prints, read on a thread of their own so that a test
/// waits for each one for a bounded time.
struct Lines(std::sync::mpsc::Receiver<String>);

impl Lines {
    fn of(child: &mut Child) -> Lines {
        let stdout = child.stdout.take().expect("piped stdout");
        let (sender, receiver) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { return };
                if sender.send(line).is_err() {
                    return;
                }
            }
        });
        Lines(receiver)
    }

    fn next(&self, limit: Duration) -> String {
        self.0.recv_timeout(limit).expect("a line in time")
    }
}

#[test]
fn etcd_layout_etcdctl_elect_listen_sees_a_kunci_elect_leader_and_its_successor() {
    if !tools() {
        return;
    }
    let cluster = Cluster::start(1);
    let server = layout(&cluster);
    let dir = TempDir::new("etcd-elect");
    let leading = dir.join("leading");
    std::fs::write(&leading, "").unwrap();
    let name = "db-primary";
    // The command leads until the file is gone.
    let candidate = Reaped::spawn(
        kunci_command(&server, &["elect", name, "db1:5432", "--lease", "10", "--"])
            .args(["sh", "-c", "while [ -e \"$1\" ]; do sleep 0.05; done", "sh"])
            .arg(&leading)
            .stderr(Stdio::piped()),
    );
    assert!(wait_for(10 * S, || entries(&cluster, name).len() == 1));
    let leader = entries(&cluster, name).remove(0);
    assert_eq!(leader.value, "db1:5432");
    let mut listener =
        Reaped::spawn(etcdctl(&cluster, &["elect", "-l", name]).stdout(Stdio::piped()));
    let lines = Lines::of(listener.child());
    assert_eq!(lines.next(10 * S), leader.key);
    assert_eq!(lines.next(S), "db1:5432");

    // A Go candidate queues behind it and leads when it resigns.
    let mut standby = Reaped::spawn(
        etcdctl(&cluster, &["elect", name, "go-standby"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped()),
    );
    assert!(wait_for(10 * S, || entries(&cluster, name).len() == 2));
    let queued = entries(&cluster, name).remove(1);
    assert_eq!(queued.value, "go-standby");
    std::fs::remove_file(&leading).unwrap();
    let resigned = candidate.finish(Instant::now() + 10 * S);
    assert_eq!(resigned.status.code(), Some(0), "{resigned:?}");
    assert_eq!(lines.next(10 * S), queued.key);
    assert_eq!(lines.next(S), "go-standby");
    // `etcdctl elect` prints the key and value once it leads.
    let elected = Lines::of(standby.child());
    assert_eq!(elected.next(5 * S), queued.key);
    assert_eq!(elected.next(S), "go-standby");
    standby.interrupt();
    listener.interrupt();
    assert!(standby.finish(Instant::now() + 5 * S).status.success());
    let _ = listener.finish(Instant::now() + 5 * S);
    assert!(wait_for(5 * S, || entries(&cluster, name).is_empty()));
}

#[test]
fn etcd_layout_kunci_leader_watch_follows_an_etcdctl_elect_leader_and_its_kunci_successor() {
    if !tools() {
        return;
    }
    let cluster = Cluster::start(1);
    let server = layout(&cluster);
    let dir = TempDir::new("etcd-leader");
    let leading = dir.join("leading");
    std::fs::write(&leading, "").unwrap();
    let name = "db-primary";
    let mut watch =
        Reaped::spawn(kunci_command(&server, &["leader", name, "--watch"]).stdout(Stdio::piped()));
    let shown = Lines::of(watch.child());
    assert_eq!(shown.next(10 * S), "none");

    let mut go = Reaped::spawn(
        etcdctl(&cluster, &["elect", name, "go-primary:5432"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped()),
    );
    assert!(wait_for(10 * S, || entries(&cluster, name).len() == 1));
    let go_entry = entries(&cluster, name).remove(0);
    let go_term = go_entry.create_revision;
    // etcd's layout keeps no grant time: held_for is unknown.
    assert_eq!(
        shown.next(10 * S),
        format!("go-primary:5432 term={go_term} held_for=?")
    );
    let json = kunci_command(&server, &["leader", name, "--json"])
        .output()
        .unwrap();
    assert_eq!(json.status.code(), Some(0), "{json:?}");
    assert_eq!(
        text(&json.stdout),
        format!(
            "{{\"value\": \"go-primary:5432\", \"term\": \"{go_term}\", \"held_for\": null}}\n"
        )
    );
    let leader = client_of(&server).leader(name).unwrap();
    assert_eq!(
        leader,
        Some(kunci::client::Leader {
            value: Some("go-primary:5432".into()),
            term: go_term,
            held_for: None,
        })
    );

    // A kunci candidate queues behind it and leads when it resigns.
    let candidate = Reaped::spawn(
        kunci_command(
            &server,
            &["elect", name, "rs-standby", "--lease", "10", "--"],
        )
        .args(["sh", "-c", "while [ -e \"$1\" ]; do sleep 0.05; done", "sh"])
        .arg(&leading)
        .stderr(Stdio::piped()),
    );
    assert!(wait_for(10 * S, || entries(&cluster, name).len() == 2));
    let standby = entries(&cluster, name).remove(1);
    assert_eq!(standby.value, "rs-standby");
    go.interrupt();
    assert!(go.finish(Instant::now() + 5 * S).status.success());
    assert_eq!(
        shown.next(10 * S),
        format!("rs-standby term={} held_for=?", standby.create_revision)
    );
    assert!(standby.create_revision > go_term);
    // Its entry keeps etcd's layout once it leads: the value alone.
    assert_eq!(entries(&cluster, name), [standby]);
    std::fs::remove_file(&leading).unwrap();
    let resigned = candidate.finish(Instant::now() + 10 * S);
    assert_eq!(resigned.status.code(), Some(0), "{resigned:?}");
    assert_eq!(shown.next(10 * S), "none");
    watch.interrupt();
    let watched = watch.finish(Instant::now() + 5 * S);
    assert_eq!(watched.status.code(), Some(0), "{watched:?}");
}
