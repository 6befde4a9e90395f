//! Semaphores and shared locks (spec §10) against a real server on port 0,
//! with `S` frames written byte by byte: a semaphore of 2 among 3 clients,
//! readers sharing while a writer waits, and a writer queued behind readers
//! granted before the readers that came after it.

use std::time::Duration;

use kunci::protocol::Response;

use crate::util::{Peer, TestServer, granted, release, s_frame};

/// An `S` frame (spec §2.1).
fn permits(
    wait_s: u8,
    lease_s: u8,
    owner: u64,
    limit: u16,
    take: u16,
    key: &str,
    label: &str,
) -> Vec<u8> {
    s_frame(
        wait_s,
        lease_s,
        owner,
        limit,
        take,
        key.as_bytes(),
        label.as_bytes(),
    )
}

/// Nothing arrives on `peer` for a while (it is queued, not answered).
fn assert_waiting(peer: &mut Peer) {
    assert!(
        peer.is_silent_for(Duration::from_millis(200)),
        "an answer came"
    );
}

#[test]
fn a_semaphore_of_2_grants_2_of_3_clients_and_the_third_when_one_leaves() {
    let server = TestServer::start(&[]);
    let mut clients: Vec<Peer> = (0..3).map(|_| server.peer()).collect();
    clients[0].send(&permits(0, 30, 1, 2, 1, "backup", "first"));
    let first = granted(clients[0].recv(), 1);
    clients[1].send(&permits(0, 30, 2, 2, 1, "backup", ""));
    let second = granted(clients[1].recv(), 2);
    assert_eq!(second, first + 1);
    // Both permits are taken: a try fails at once, a wait queues.
    clients[2].send(&permits(0, 30, 3, 2, 1, "backup", ""));
    assert_eq!(clients[2].recv(), Response::Timeout { owner: 3 });
    clients[2].send(&permits(10, 30, 4, 2, 1, "backup", "third"));
    assert_waiting(&mut clients[2]);
    // Another limit for the same key is refused, naming the key's.
    clients[2].send(&permits(0, 30, 5, 3, 1, "backup", ""));
    assert_eq!(clients[2].recv(), Response::limit_mismatch(5, 2));
    clients[0].send(&release(first, "backup"));
    assert_eq!(clients[0].recv(), Response::Released { token: first });
    assert_eq!(granted(clients[2].recv(), 4), second + 1);
    let info = server.info();
    assert_eq!(info["grants_held"], "2");
    assert_eq!(info["held"], "1");
}

#[test]
fn readers_share_while_a_writer_waits_then_the_writer_holds_alone() {
    let server = TestServer::start(&[]);
    let mut reader_a = server.peer();
    let mut reader_b = server.peer();
    let mut writer = server.peer();
    // Shared = limit 65535, take 1; exclusive = take 0 (spec §10.6).
    reader_a.send(&permits(0, 30, 1, 65535, 1, "doc", ""));
    let a = granted(reader_a.recv(), 1);
    reader_b.send(&permits(0, 30, 2, 65535, 1, "doc", ""));
    let b = granted(reader_b.recv(), 2);
    writer.send(&permits(10, 30, 3, 65535, 0, "doc", "writer"));
    assert_waiting(&mut writer);
    reader_a.send(&release(a, "doc"));
    assert_eq!(reader_a.recv(), Response::Released { token: a });
    assert_waiting(&mut writer);
    reader_b.send(&release(b, "doc"));
    assert_eq!(reader_b.recv(), Response::Released { token: b });
    let w = granted(writer.recv(), 3);
    // The writer's token is greater than every reader's before it.
    assert!(w > b && b > a);
    // Alone: a reader now waits.
    reader_a.send(&permits(0, 30, 4, 65535, 1, "doc", ""));
    assert_eq!(reader_a.recv(), Response::Timeout { owner: 4 });
}

#[test]
fn a_writer_queued_behind_readers_is_granted_before_readers_that_came_after_it() {
    let server = TestServer::start(&[]);
    let mut early = server.peer();
    let mut writer = server.peer();
    let mut late = server.peer();
    early.send(&permits(0, 30, 1, 65535, 1, "rw", ""));
    let early_token = granted(early.recv(), 1);
    writer.send(&permits(10, 30, 2, 65535, 0, "rw", ""));
    assert_waiting(&mut writer);
    // A reader after the writer would fit beside the early reader, but it
    // may not overtake the writer (strict FIFO, spec §10.4).
    late.send(&permits(10, 30, 3, 65535, 1, "rw", ""));
    late.send(&permits(10, 30, 4, 65535, 1, "rw", ""));
    assert_waiting(&mut late);
    early.send(&release(early_token, "rw"));
    assert_eq!(early.recv(), Response::Released { token: early_token });
    let writer_token = granted(writer.recv(), 2);
    assert_eq!(writer_token, early_token + 1);
    assert_waiting(&mut late);
    writer.send(&release(writer_token, "rw"));
    assert_eq!(
        writer.recv(),
        Response::Released {
            token: writer_token
        }
    );
    // Both late readers at once, in queue order.
    assert_eq!(granted(late.recv(), 3), writer_token + 1);
    assert_eq!(granted(late.recv(), 4), writer_token + 2);
}
