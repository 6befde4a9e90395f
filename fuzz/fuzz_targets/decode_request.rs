//! Raw bytes through the request decoder: it must never panic, never ask
//! for more than one frame's worth of bytes, and give the same frames
//! however the bytes are split into reads.
#![no_main]

use kunci::protocol::{Decoded, REQUEST_FRAME_MAX, decode_request};
use libfuzzer_sys::fuzz_target;

/// What a reader sees, as owned values, stopping at the first fatal error.
#[derive(Debug, PartialEq)]
enum Outcome {
    Frame(String, usize),
    Invalid(u8, u64, usize),
    Fatal(u8, u64),
}

fn decode_all(bytes: &[u8]) -> Vec<Outcome> {
    let mut outcomes = Vec::new();
    let mut at = 0;
    loop {
        match decode_request(&bytes[at..]) {
            Decoded::Incomplete => {
                assert!(
                    bytes.len() - at < REQUEST_FRAME_MAX,
                    "incomplete with a full frame buffered"
                );
                return outcomes;
            }
            Decoded::Request { request, len } => {
                assert!(len >= 2 && len <= REQUEST_FRAME_MAX && at + len <= bytes.len());
                outcomes.push(Outcome::Frame(format!("{request:?}"), len));
                at += len;
            }
            Decoded::Invalid { error, len } => {
                assert!(!error.code.is_fatal());
                assert!(len >= 2 && len <= REQUEST_FRAME_MAX && at + len <= bytes.len());
                outcomes.push(Outcome::Invalid(error.code as u8, error.id, len));
                at += len;
            }
            Decoded::Fatal(error) => {
                assert!(error.code.is_fatal());
                outcomes.push(Outcome::Fatal(error.code as u8, error.id));
                return outcomes;
            }
        }
    }
}

/// Feeds `bytes` in reads whose sizes come from `split`, keeping leftovers
/// in a buffer, as the server does.
fn decode_split(bytes: &[u8], split: &[u8]) -> Vec<Outcome> {
    let mut outcomes = Vec::new();
    let mut buffer: Vec<u8> = Vec::new();
    let mut at = 0;
    let mut sizes = split.iter().cycle();
    while at < bytes.len() {
        let size = sizes.next().map_or(bytes.len(), |&s| usize::from(s) + 1);
        let end = (at + size).min(bytes.len());
        buffer.extend_from_slice(&bytes[at..end]);
        at = end;
        let mut consumed = 0;
        loop {
            match decode_request(&buffer[consumed..]) {
                Decoded::Incomplete => break,
                Decoded::Request { request, len } => {
                    outcomes.push(Outcome::Frame(format!("{request:?}"), len));
                    consumed += len;
                }
                Decoded::Invalid { error, len } => {
                    outcomes.push(Outcome::Invalid(error.code as u8, error.id, len));
                    consumed += len;
                }
                Decoded::Fatal(error) => {
                    outcomes.push(Outcome::Fatal(error.code as u8, error.id));
                    return outcomes;
                }
            }
        }
        buffer.drain(..consumed);
        assert!(buffer.len() < REQUEST_FRAME_MAX);
    }
    outcomes
}

fuzz_target!(|data: &[u8]| {
    let (split, bytes) = match data.split_first() {
        Some((&n, rest)) => rest.split_at(usize::from(n).min(rest.len()).min(16)),
        None => return,
    };
    let whole = decode_all(bytes);
    if split.is_empty() {
        assert_eq!(whole, decode_split(bytes, &[0]));
    } else {
        assert_eq!(whole, decode_split(bytes, split));
    }
});
