//! `kunci who KEY` and `kunci list [PREFIX]` (spec §9, §11): who holds a
//! key and who waits for it, and which keys the server has, for a person
//! (a table) or a program (`--json`).

use std::fmt::Write as _;
use std::io::Write;
use std::time::Duration;

use super::bench::stats::json_string;
use crate::client::{Client, Error, Grant, Holders, KeySummary, Waiter};
use crate::protocol::LIST_COUNT_MAX;

/// `kunci who`: the key's grants, then its waiters. `etcd`: the servers
/// are etcd members, in etcd's own layout when `etcd_layout`.
pub(super) fn who(
    client: &Client,
    key: &str,
    json: bool,
    (etcd, etcd_layout): (bool, bool),
    out: &mut dyn Write,
) -> Result<(), Error> {
    let holders = client.holders(key)?;
    let times = if etcd { Times::LeaseOnly } else { Times::All };
    // etcd's layout has no limits, and no listing to ask for one.
    let limit = if holders.is_free() || etcd_layout {
        0
    } else {
        key_limit(client, key)?
    };
    let text = if json {
        who_json(key, limit, &holders, times)
    } else {
        who_table(key, limit, &holders, times)
    };
    // A closed stdout (`kunci who k | head -1`) is not an error.
    let _ = out.write_all(text.as_bytes());
    Ok(())
}

/// `kunci list`: one line per key, page by page as they come.
pub(super) fn list(
    client: &Client,
    prefix: &str,
    json: bool,
    out: &mut dyn Write,
) -> Result<(), Error> {
    for key in client.keys(prefix) {
        let key = key?;
        let line = if json { key_json(&key) } else { key_line(&key) };
        if writeln!(out, "{line}").is_err() {
            // Nobody reads any more: stop asking the server.
            return Ok(());
        }
    }
    Ok(())
}

/// The key's limit of permits (0: none), from the `L` pages that start
/// with the key: `H` does not carry it.
fn key_limit(client: &Client, key: &str) -> Result<u16, Error> {
    let mut cursor = 0;
    loop {
        let page = client.list_keys(key, cursor, LIST_COUNT_MAX)?;
        if let Some(found) = page.keys.iter().find(|found| found.key == key) {
            return Ok(found.limit);
        }
        if page.next == 0 {
            return Ok(0);
        }
        cursor = page.next;
    }
}

/// Which times a backend knows: etcd keeps no grant time and no wait
/// deadline (docs/ETCD.md).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Times {
    All,
    LeaseOnly,
}

/// A time in ms for JSON, `null` when the backend does not know it.
fn json_ms(duration: Duration, known: bool) -> String {
    if known {
        duration.as_millis().to_string()
    } else {
        "null".into()
    }
}

/// The JSON object of `kunci who --json` (times in ms, field names as in
/// spec §11), one line. Tokens and owners are 64-bit: they are strings, as
/// a JSON reader that keeps numbers as doubles (jq 1.6, JavaScript) would
/// round them above 2^53. `left_out` counts what the server did not list.
pub(super) fn who_json(key: &str, limit: u16, holders: &Holders, times: Times) -> String {
    let known = times == Times::All;
    let mut out = format!(
        "{{\"key\":{},\"limit\":{limit},\"left_out\":{},\"grants\":[",
        json_string(key),
        holders.left_out
    );
    for (index, grant) in holders.grants.iter().enumerate() {
        let comma = if index == 0 { "" } else { "," };
        let _ = write!(
            out,
            "{comma}{{\"token\":\"{}\",\"owner\":\"{}\",\"lease_ms\":{},\"held_ms\":{},\"take\":{},\"label\":{}}}",
            grant.token,
            grant.owner,
            grant.lease_left.as_millis(),
            json_ms(grant.held_for, known),
            grant.take,
            json_string(&grant.label)
        );
    }
    out.push_str("],\"waiters\":[");
    for (index, waiter) in holders.waiters.iter().enumerate() {
        let comma = if index == 0 { "" } else { "," };
        let _ = write!(
            out,
            "{comma}{{\"owner\":\"{}\",\"wait_ms\":{},\"take\":{},\"label\":{}}}",
            waiter.owner,
            json_ms(waiter.wait_left, known),
            waiter.take,
            json_string(&waiter.label)
        );
    }
    out.push_str("]}\n");
    out
}

/// One JSON line of `kunci list --json`.
pub(super) fn key_json(key: &KeySummary) -> String {
    format!(
        "{{\"key\":{},\"grants\":{},\"waiters\":{},\"limit\":{}}}",
        json_string(&key.key),
        key.grants,
        key.waiters,
        key.limit
    )
}

/// One line of `kunci list`: the key, then its counts.
pub(super) fn key_line(key: &KeySummary) -> String {
    format!(
        "{}  grants={} waiters={} limit={}",
        printable(&key.key),
        key.grants,
        key.waiters,
        limit_text(key.limit)
    )
}

fn limit_text(limit: u16) -> String {
    if limit == 0 {
        "none".into()
    } else {
        limit.to_string()
    }
}

/// The table of `kunci who`.
pub(super) fn who_table(key: &str, limit: u16, holders: &Holders, times: Times) -> String {
    let known = times == Times::All;
    let key = printable(key);
    if holders.is_free() {
        return format!("{key}: free (no grants, no waiters)\n");
    }
    let mut out = format!(
        "{key}: limit {}, {} {}, {} {}\n",
        limit_text(limit),
        holders.grants.len(),
        plural(holders.grants.len(), "grant", "grants"),
        holders.waiters.len(),
        plural(holders.waiters.len(), "waiter", "waiters"),
    );
    if holders.left_out > 0 {
        let _ = writeln!(
            out,
            "({} more left out by the server: it lists at most 1000 of each)",
            holders.left_out
        );
    }
    if !holders.grants.is_empty() {
        let rows: Vec<[String; 6]> = holders
            .grants
            .iter()
            .map(|grant| grant_row(grant, known))
            .collect();
        let header = ["TOKEN", "OWNER", "TAKE", "LEASE LEFT", "HELD FOR", "LABEL"];
        table(&mut out, header, &rows);
    }
    if !holders.waiters.is_empty() {
        out.push_str("waiting, next first:\n");
        let rows: Vec<[String; 5]> = holders
            .waiters
            .iter()
            .enumerate()
            .map(|(index, waiter)| waiter_row(index, waiter, known))
            .collect();
        let header = ["#", "OWNER", "TAKE", "WAIT LEFT", "LABEL"];
        table(&mut out, header, &rows);
    }
    out
}

fn grant_row(grant: &Grant, known: bool) -> [String; 6] {
    [
        grant.token.to_string(),
        grant.owner.to_string(),
        take_text(grant.take),
        duration_text(grant.lease_left),
        known_duration_text(grant.held_for, known),
        printable(&grant.label),
    ]
}

fn waiter_row(index: usize, waiter: &Waiter, known: bool) -> [String; 5] {
    [
        (index + 1).to_string(),
        waiter.owner.to_string(),
        take_text(waiter.take),
        known_duration_text(waiter.wait_left, known),
        printable(&waiter.label),
    ]
}

fn plural(n: usize, one: &'static str, many: &'static str) -> &'static str {
    if n == 1 { one } else { many }
}

/// Columns padded to their widest cell (in characters); the last column,
/// the label, is not padded.
fn table<const N: usize>(out: &mut String, header: [&str; N], rows: &[[String; N]]) {
    let mut widths = header.map(|title| title.chars().count());
    for row in rows {
        for (width, cell) in widths.iter_mut().zip(row) {
            *width = (*width).max(cell.chars().count());
        }
    }
    let mut line = |cells: &mut dyn Iterator<Item = &str>| {
        let mut text = String::new();
        for (index, cell) in cells.enumerate() {
            if index + 1 == N {
                text.push_str(cell);
            } else {
                let _ = write!(text, "{cell:<width$}  ", width = widths[index]);
            }
        }
        out.push_str(text.trim_end());
        out.push('\n');
    };
    line(&mut header.iter().copied());
    for row in rows {
        line(&mut row.iter().map(String::as_str));
    }
}

/// `all` for take 0 (every permit), else the count.
fn take_text(take: u16) -> String {
    if take == 0 {
        "all".into()
    } else {
        take.to_string()
    }
}

/// A duration for a person, in one unit whatever its size: seconds with
/// milliseconds (`0.250 s`, `42.000 s`, `3725.000 s`), as the server
/// counts them.
fn duration_text(duration: Duration) -> String {
    let ms = duration.as_millis();
    format!("{}.{:03} s", ms / 1000, ms % 1000)
}

/// [`duration_text`], or `unknown` when the backend keeps no such time.
fn known_duration_text(duration: Duration, known: bool) -> String {
    if known {
        duration_text(duration)
    } else {
        "unknown".into()
    }
}

/// Text from the server for a terminal: control characters (a label is
/// free text) are shown escaped, so that they cannot move the cursor or
/// change colours.
fn printable(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        if c.is_control() {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    fn sample() -> Holders {
        Holders {
            grants: vec![
                Grant {
                    token: 1_000_001,
                    owner: 77,
                    take: 0,
                    lease_left: 29_500 * MS,
                    held_for: 500 * MS,
                    label: "alice@db1 pid=42 make backup".into(),
                },
                Grant {
                    token: 1_000_002,
                    owner: 78,
                    take: 2,
                    lease_left: 3 * MS,
                    held_for: 3_725_000 * MS,
                    label: "é \"quoted\" \\ \u{1b}[31m".into(),
                },
            ],
            waiters: vec![Waiter {
                owner: 9,
                take: 1,
                wait_left: 61_000 * MS,
                label: String::new(),
            }],
            left_out: 0,
        }
    }

    #[test]
    fn who_json_is_one_object_with_times_in_ms_and_escaped_labels() {
        assert_eq!(
            who_json("k\"ey", 3, &sample(), Times::All),
            concat!(
                r#"{"key":"k\"ey","limit":3,"left_out":0,"grants":["#,
                r#"{"token":"1000001","owner":"77","lease_ms":29500,"held_ms":500,"take":0,"label":"alice@db1 pid=42 make backup"},"#,
                r#"{"token":"1000002","owner":"78","lease_ms":3,"held_ms":3725000,"take":2,"label":"é \"quoted\" \\ \u001b[31m"}],"#,
                r#""waiters":[{"owner":"9","wait_ms":61000,"take":1,"label":""}]}"#,
                "\n"
            )
        );
        assert_eq!(
            who_json("free", 0, &Holders::default(), Times::All),
            "{\"key\":\"free\",\"limit\":0,\"left_out\":0,\"grants\":[],\"waiters\":[]}\n"
        );
        // Above 2^53 a double cannot tell neighbours apart: strings can.
        let mut big = sample();
        big.grants[0].token = (1 << 53) + 1;
        big.left_out = 7;
        let json = who_json("k", 0, &big, Times::LeaseOnly);
        assert!(json.contains(r#""token":"9007199254740993""#), "{json}");
        assert!(json.contains(r#""left_out":7,"#), "{json}");
        assert!(json.contains(r#""held_ms":null,"#), "{json}");
        assert!(json.contains(r#""wait_ms":null,"#), "{json}");
    }

    #[test]
    fn who_table_lists_grants_then_waiters_in_order() {
        assert_eq!(
            who_table("jobs/nightly", 0, &sample(), Times::All),
            "\
jobs/nightly: limit none, 2 grants, 1 waiter
TOKEN    OWNER  TAKE  LEASE LEFT  HELD FOR    LABEL
1000001  77     all   29.500 s    0.500 s     alice@db1 pid=42 make backup
1000002  78     2     0.003 s     3725.000 s  é \"quoted\" \\ \\u{1b}[31m
waiting, next first:
#  OWNER  TAKE  WAIT LEFT  LABEL
1  9      1     61.000 s
"
        );
        // etcd keeps no grant time and no wait deadline.
        let etcd = who_table("k", 0, &sample(), Times::LeaseOnly);
        assert!(etcd.contains("29.500 s    unknown   alice"), "{etcd}");
        assert!(etcd.ends_with("1  9      1     unknown\n"), "{etcd}");
        assert_eq!(
            who_table("k", 0, &Holders::default(), Times::All),
            "k: free (no grants, no waiters)\n"
        );
    }

    #[test]
    fn list_lines_name_the_key_and_its_counts() {
        let key = KeySummary {
            key: "a b\u{7}é".into(),
            grants: 2,
            waiters: 5,
            limit: 65535,
        };
        assert_eq!(key_line(&key), "a b\\u{7}é  grants=2 waiters=5 limit=65535");
        assert_eq!(
            key_json(&key),
            r#"{"key":"a b\u0007é","grants":2,"waiters":5,"limit":65535}"#
        );
        let plain = KeySummary { limit: 0, ..key };
        assert!(key_line(&plain).ends_with("limit=none"));
    }

    #[test]
    fn durations_read_as_a_person_would_say_them() {
        for (ms, text) in [
            (0, "0.000 s"),
            (9_999, "9.999 s"),
            (10_000, "10.000 s"),
            (59_999, "59.999 s"),
            (60_000, "60.000 s"),
            (3_600_000, "3600.000 s"),
            (255_000, "255.000 s"),
        ] {
            assert_eq!(duration_text(ms * MS), text, "{ms}");
        }
    }
}
