//! `H` and `L` (spec §11) on the wire against a real server on port 0:
//! raw request frames, answers read byte by byte; labels round-trip
//! byte-exact in UTF-8; answers keep request order (§11.4).

use std::time::Duration;

use kunci::protocol::Response;

use crate::util::frames::holders;
use crate::util::{Peer, TestServer, granted, s_frame};

/// An `S` frame with a 30 s lease (spec §2.1).
fn permits(wait_s: u8, owner: u64, limit: u16, take: u16, key: &str, label: &str) -> Vec<u8> {
    s_frame(
        wait_s,
        30,
        owner,
        limit,
        take,
        key.as_bytes(),
        label.as_bytes(),
    )
}

/// `L id cursor count prefix \n`.
fn list(id: u64, cursor: u64, count: u16, prefix: &str) -> Vec<u8> {
    let mut frame = vec![b'L'];
    frame.extend_from_slice(&id.to_be_bytes());
    frame.extend_from_slice(&cursor.to_be_bytes());
    frame.extend_from_slice(&count.to_be_bytes());
    frame.extend_from_slice(prefix.as_bytes());
    frame.push(b'\n');
    frame
}

fn be_u32(bytes: &[u8]) -> u32 {
    u32::from_be_bytes(bytes.try_into().expect("4 bytes"))
}

/// Reads one `G` frame of `label` byte by byte and checks every field;
/// returns (lease_ms, held_ms).
fn expect_grant(
    peer: &mut Peer,
    id: u64,
    token: u64,
    owner: u64,
    take: u16,
    label: &str,
) -> (u32, u32) {
    let frame = peer.recv_bytes(1 + 8 + 8 + 8 + 4 + 4 + 2 + label.len() + 1);
    assert_eq!(frame[0], b'G');
    assert_eq!(&frame[1..9], &id.to_be_bytes());
    assert_eq!(&frame[9..17], &token.to_be_bytes());
    assert_eq!(&frame[17..25], &owner.to_be_bytes());
    assert_eq!(&frame[33..35], &take.to_be_bytes());
    assert_eq!(&frame[35..], [label.as_bytes(), b"\n"].concat());
    (be_u32(&frame[25..29]), be_u32(&frame[29..33]))
}

/// `Z id count next \n`, exactly.
fn end(id: u64, count: u32, next: u64) -> Vec<u8> {
    let mut frame = vec![b'Z'];
    frame.extend_from_slice(&id.to_be_bytes());
    frame.extend_from_slice(&count.to_be_bytes());
    frame.extend_from_slice(&next.to_be_bytes());
    frame.push(b'\n');
    frame
}

#[test]
fn holders_answers_grants_then_waiters_with_their_labels_byte_exact() {
    let server = TestServer::start(&[]);
    let mut holder = server.peer();
    let mut waiter = server.peer();
    let mut asker = server.peer();
    let label = "ünïcødé ✓ root@host pid=42 make -j8";
    holder.send(&permits(0, 1, 3, 2, "wire/ключ", label));
    let first = granted(holder.recv(), 1);
    holder.send(&permits(0, 2, 3, 1, "wire/ключ", ""));
    let second = granted(holder.recv(), 2);
    let waiter_label = "日本語 waiter";
    waiter.send(&permits(20, 3, 3, 0, "wire/ключ", waiter_label));
    assert!(waiter.is_silent_for(Duration::from_millis(100)));
    asker.send(&holders(0x0A0A_0A0A_0A0A_0A0A, "wire/ключ"));
    let id = 0x0A0A_0A0A_0A0A_0A0A;
    let (lease_ms, held_ms) = expect_grant(&mut asker, id, first, 1, 2, label);
    assert!((25_000..=30_000).contains(&lease_ms), "lease_ms {lease_ms}");
    assert!((100..5_000).contains(&held_ms), "held_ms {held_ms}");
    let (lease_ms, held_ms) = expect_grant(&mut asker, id, second, 2, 1, "");
    assert!((25_000..=30_000).contains(&lease_ms), "lease_ms {lease_ms}");
    assert!(held_ms < 5_000, "held_ms {held_ms}");
    let frame = asker.recv_bytes(1 + 8 + 8 + 4 + 2 + waiter_label.len() + 1);
    assert_eq!(frame[0], b'W');
    assert_eq!(&frame[1..9], &id.to_be_bytes());
    assert_eq!(&frame[9..17], &3u64.to_be_bytes());
    let wait_ms = be_u32(&frame[17..21]);
    assert!((15_000..=20_000).contains(&wait_ms), "wait_ms {wait_ms}");
    assert_eq!(&frame[21..23], &0u16.to_be_bytes());
    assert_eq!(&frame[23..], [waiter_label.as_bytes(), b"\n"].concat());
    assert_eq!(asker.recv_bytes(22), end(id, 3, 0));
    // A key not in the table, then a ping: answers in request order.
    asker.send(&[holders(7, "wire/none"), b"P\0\0\0\0\0\0\0\x09\n".to_vec()].concat());
    assert_eq!(asker.recv_bytes(22), end(7, 0, 0));
    assert_eq!(asker.recv(), Response::Pong { nonce: 9 });
    // An empty key is `X 3` with the id.
    asker.send(&holders(8, ""));
    assert!(matches!(
        asker.recv(),
        Response::Error { code: 3, id: 8, .. }
    ));
}

#[test]
fn list_pages_through_the_keys_with_a_prefix_and_refuses_bad_counts() {
    let server = TestServer::start(&[]);
    let mut holder = server.peer();
    let mut asker = server.peer();
    for (owner, key) in ["wire/b", "wire/ä", "elsewhere"].iter().enumerate() {
        holder.send(&permits(0, owner as u64, 0, 0, key, ""));
        granted(holder.recv(), owner as u64);
    }
    holder.send(&permits(0, 10, 5, 2, "wire/c", ""));
    granted(holder.recv(), 10);
    holder.send(&permits(10, 11, 5, 4, "wire/c", ""));
    assert!(holder.is_silent_for(Duration::from_millis(100)));
    // One key per page: follow the cursor to 0.
    let mut keys = Vec::new();
    let mut cursor = 0;
    loop {
        asker.send(&list(4, cursor, 1, "wire/"));
        match asker.recv() {
            Response::Key {
                id: 4,
                grants,
                waiters,
                limit,
                key,
            } => {
                keys.push((key, grants, waiters, limit));
                match asker.recv() {
                    Response::End {
                        id: 4,
                        count: 1,
                        next,
                    } => cursor = next,
                    other => panic!("not the end of a page: {other:?}"),
                }
            }
            Response::End {
                id: 4,
                count: 0,
                next,
            } => cursor = next,
            other => panic!("not a page: {other:?}"),
        }
        if cursor == 0 {
            break;
        }
    }
    keys.sort();
    assert_eq!(
        keys,
        vec![
            ("wire/b".to_string(), 1, 0, 0),
            ("wire/c".to_string(), 1, 1, 5),
            ("wire/ä".to_string(), 1, 0, 0),
        ]
    );
    // The K frame, byte by byte.
    asker.send(&list(5, 0, 1000, "wire/ä"));
    let mut expected = vec![b'K'];
    expected.extend_from_slice(&5u64.to_be_bytes());
    expected.extend_from_slice(&1u32.to_be_bytes());
    expected.extend_from_slice(&0u32.to_be_bytes());
    expected.extend_from_slice(&0u16.to_be_bytes());
    expected.extend_from_slice("wire/ä\n".as_bytes());
    assert_eq!(asker.recv_bytes(expected.len()), expected);
    assert_eq!(asker.recv_bytes(22), end(5, 1, 0));
    // Count 0 or over 1,000: `X 11` with the id; the session goes on.
    for count in [0, 1001] {
        asker.send(&list(6, 0, count, ""));
        assert!(matches!(
            asker.recv(),
            Response::Error {
                code: 11,
                id: 6,
                ..
            }
        ));
    }
    asker.send(&list(7, 0, 1000, ""));
    let mut count = 0;
    while let Response::Key { id: 7, .. } = asker.recv() {
        count += 1;
    }
    assert_eq!(count, 4);
}
