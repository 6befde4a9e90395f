//! The wire codec: request and response frames, byte for byte, split at
//! every boundary, packed many to a buffer, and at every size limit.

use crate::util::s_frame;
use kunci::protocol::{
    Correlation, Decoded, ErrorCode, REQUEST_FRAME_MAX, RESPONSE_TEXT_MAX, Request, RequestError,
    Response, ResponseError, decode_request, decode_response, encode_request, encode_response,
    parse_limit_mismatch,
};
use proptest::prelude::*;

/// One frame of every request op, written out byte for byte, with the
/// request it decodes to.
fn request_samples() -> Vec<(&'static [u8], Request<'static>)> {
    vec![
        (
            b"A\x05\x1e\x00\x00\x00\x00\x00\x00\x00\x07key\n",
            Request::Acquire {
                wait_s: 5,
                lease_s: 30,
                owner: 7,
                key: "key",
                limit: 0,
                take: 0,
                label: "",
            },
        ),
        (
            b"R\x00\x00\x00\x00\x00\x00\x01\x02key\n",
            Request::Release {
                token: 0x0102,
                key: "key",
            },
        ),
        (
            b"E\xff\x01\x02\x03\x04\x05\x06\x07\x08k\xc3\xa9y\n",
            Request::Extend {
                lease_s: 255,
                token: 0x0102_0304_0506_0708,
                key: "kéy",
            },
        ),
        (b"Qkey\n", Request::Query { key: "key" }),
        (
            b"P\xde\xad\xbe\xef\x00\x00\x00\x2a\n",
            Request::Ping {
                nonce: 0xdead_beef_0000_002a,
            },
        ),
        (b"I\n", Request::Info),
        // `S`: a semaphore permit with a label; a shared lock; an exclusive
        // request that names a limit; an exclusive request with a label
        // (not an `A`, which cannot carry one); take == limit.
        (
            b"S\x05\x1e\x00\x00\x00\x00\x00\x00\x00\x07\x00\x03\x00\x01\x03keybob@h pid=1\n",
            Request::Acquire {
                wait_s: 5,
                lease_s: 30,
                owner: 7,
                key: "key",
                limit: 3,
                take: 1,
                label: "bob@h pid=1",
            },
        ),
        (
            b"S\x00\x01\x00\x00\x00\x00\x00\x00\x00\x08\xff\xff\x00\x01\x01k\n",
            Request::Acquire {
                wait_s: 0,
                lease_s: 1,
                owner: 8,
                key: "k",
                limit: 65535,
                take: 1,
                label: "",
            },
        ),
        (
            b"S\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x00\x05\x00\x00\x03k\xc3\xa9\n",
            Request::Acquire {
                wait_s: 255,
                lease_s: 255,
                owner: u64::MAX,
                key: "k\u{e9}",
                limit: 5,
                take: 0,
                label: "",
            },
        ),
        (
            b"S\x00\x01\x00\x00\x00\x00\x00\x00\x00\x09\x00\x00\x00\x00\x01kw \xc3\xa9\n",
            Request::Acquire {
                wait_s: 0,
                lease_s: 1,
                owner: 9,
                key: "k",
                limit: 0,
                take: 0,
                label: "w \u{e9}",
            },
        ),
        (
            b"S\x00\x01\x00\x00\x00\x00\x00\x00\x00\x09\x00\x02\x00\x02\x01k\n",
            Request::Acquire {
                wait_s: 0,
                lease_s: 1,
                owner: 9,
                key: "k",
                limit: 2,
                take: 2,
                label: "",
            },
        ),
        (
            b"H\x00\x00\x00\x00\x00\x00\x00\x2akey\n",
            Request::Holders { id: 42, key: "key" },
        ),
        (
            b"L\x00\x00\x00\x00\x00\x00\x00\x2b\x00\x00\x00\x00\x00\x00\x01\x02\x03\xe8jobs/\n",
            Request::List {
                id: 43,
                cursor: 0x0102,
                count: 1000,
                prefix: "jobs/",
            },
        ),
        (
            b"L\x00\x00\x00\x00\x00\x00\x00\x2c\x00\x00\x00\x00\x00\x00\x00\x00\x00\x01\n",
            Request::List {
                id: 44,
                cursor: 0,
                count: 1,
                prefix: "",
            },
        ),
        (
            b"Us3cret\xff\x00\n",
            Request::Authenticate {
                secret: b"s3cret\xff\x00",
            },
        ),
        (b"U\n", Request::Authenticate { secret: b"" }),
    ]
}

/// Requests whose fixed headers are full of 0x0A, which a decoder that
/// looked for the newline first would cut short.
fn newline_header_samples() -> Vec<(&'static [u8], Request<'static>)> {
    const NL: u64 = 0x0a0a_0a0a_0a0a_0a0a;
    vec![
        (
            b"A\x0a\x0a\x0a\x0a\x0a\x0a\x0a\x0a\x0a\x0ak\n",
            Request::Acquire {
                wait_s: 10,
                lease_s: 10,
                owner: NL,
                key: "k",
                limit: 0,
                take: 0,
                label: "",
            },
        ),
        (
            b"A\x00\x01\x00\x00\x00\x00\x00\x00\x00\x0ak\n",
            Request::Acquire {
                wait_s: 0,
                lease_s: 1,
                owner: 10,
                key: "k",
                limit: 0,
                take: 0,
                label: "",
            },
        ),
        (
            b"R\x0a\x0a\x0a\x0a\x0a\x0a\x0a\x0ak\n",
            Request::Release {
                token: NL,
                key: "k",
            },
        ),
        (
            b"E\x0a\x0a\x0a\x0a\x0a\x0a\x0a\x0a\x0ak\n",
            Request::Extend {
                lease_s: 10,
                token: NL,
                key: "k",
            },
        ),
        (
            b"P\x0a\x0a\x0a\x0a\x0a\x0a\x0a\x0a\n",
            Request::Ping { nonce: NL },
        ),
        // Every header byte 0x0A, `klen` included: the 10-byte key is taken
        // by count even though the label search would stop early.
        (
            b"S\x0a\x0a\x0a\x0a\x0a\x0a\x0a\x0a\x0a\x0a\x0a\x0a\x0a\x0a\x0a0123456789l\n",
            Request::Acquire {
                wait_s: 10,
                lease_s: 10,
                owner: NL,
                key: "0123456789",
                limit: 0x0a0a,
                take: 0x0a0a,
                label: "l",
            },
        ),
        (
            b"H\x0a\x0a\x0a\x0a\x0a\x0a\x0a\x0ak\n",
            Request::Holders { id: NL, key: "k" },
        ),
        (
            b"L\x0a\x0a\x0a\x0a\x0a\x0a\x0a\x0a\x0a\x0a\x0a\x0a\x0a\x0a\x0a\x0a\x00\x0a\n",
            Request::List {
                id: NL,
                cursor: NL,
                count: 10,
                prefix: "",
            },
        ),
        (
            b"P\x00\x00\x00\x00\x00\x00\x00\x0a\n",
            Request::Ping { nonce: 10 },
        ),
    ]
}

/// Well-framed invalid requests: the frame, the error it gets, and whether
/// the decoder reports it as fatal. Fatal frames have no length.
fn invalid_samples() -> Vec<(Vec<u8>, RequestError)> {
    let error = |code, id| RequestError { code, id };
    vec![
        // 3: empty key, for every op that takes one; the id is the owner
        // (A), the token (R, E) or 0 (Q).
        (
            b"A\x01\x01\x00\x00\x00\x00\x00\x00\x00\x09\n".to_vec(),
            error(ErrorCode::EmptyKey, 9),
        ),
        (
            b"A\x0a\x0a\x0a\x0a\x0a\x0a\x0a\x0a\x0a\x0a\n".to_vec(),
            error(ErrorCode::EmptyKey, 0x0a0a_0a0a_0a0a_0a0a),
        ),
        (
            b"R\x00\x00\x00\x00\x00\x00\x00\x0b\n".to_vec(),
            error(ErrorCode::EmptyKey, 11),
        ),
        (
            b"E\x01\x00\x00\x00\x00\x00\x00\x00\x0c\n".to_vec(),
            error(ErrorCode::EmptyKey, 12),
        ),
        (b"Q\n".to_vec(), error(ErrorCode::EmptyKey, 0)),
        // 4: not UTF-8: a stray continuation byte, a truncated sequence, an
        // overlong encoding, a surrogate.
        (
            b"A\x01\x01\x00\x00\x00\x00\x00\x00\x00\x0d\xff\n".to_vec(),
            error(ErrorCode::KeyNotUtf8, 13),
        ),
        (
            b"R\x00\x00\x00\x00\x00\x00\x00\x0eab\xc3\n".to_vec(),
            error(ErrorCode::KeyNotUtf8, 14),
        ),
        (
            b"E\x01\x00\x00\x00\x00\x00\x00\x00\x0f\xc0\x80\n".to_vec(),
            error(ErrorCode::KeyNotUtf8, 15),
        ),
        (b"Q\xed\xa0\x80\n".to_vec(), error(ErrorCode::KeyNotUtf8, 0)),
        // 5: lease 0 in A and E.
        (
            b"A\x01\x00\x00\x00\x00\x00\x00\x00\x00\x10k\n".to_vec(),
            error(ErrorCode::ZeroLease, 16),
        ),
        (
            b"E\x00\x00\x00\x00\x00\x00\x00\x00\x11k\n".to_vec(),
            error(ErrorCode::ZeroLease, 17),
        ),
        // 6: a payload where the op takes none; the id of P is its nonce.
        (
            b"P\x00\x00\x00\x00\x00\x00\x00\x12x\n".to_vec(),
            error(ErrorCode::UnexpectedPayload, 18),
        ),
        (b"Ixyz\n".to_vec(), error(ErrorCode::UnexpectedPayload, 0)),
        (b"I \n".to_vec(), error(ErrorCode::UnexpectedPayload, 0)),
        // `S`: the id is the owner. 3 for klen 0, even with a label.
        (
            s_frame(1, 1, 0x31, 0, 0, b"", b""),
            error(ErrorCode::EmptyKey, 0x31),
        ),
        (
            s_frame(1, 1, 0x32, 0, 0, b"", b"label"),
            error(ErrorCode::EmptyKey, 0x32),
        ),
        // 4 for a key that is not UTF-8, a key that holds a newline (the
        // key is taken by count, so the frame is still whole), a label that
        // is not UTF-8.
        (
            s_frame(1, 1, 0x33, 0, 0, b"\xff", b""),
            error(ErrorCode::KeyNotUtf8, 0x33),
        ),
        (
            s_frame(1, 1, 0x34, 0, 0, b"k\nk", b"l"),
            error(ErrorCode::KeyNotUtf8, 0x34),
        ),
        (
            s_frame(1, 1, 0x35, 0, 0, b"k", b"\xc3"),
            error(ErrorCode::KeyNotUtf8, 0x35),
        ),
        // 5 for lease 0.
        (
            s_frame(1, 0, 0x36, 3, 1, b"k", b""),
            error(ErrorCode::ZeroLease, 0x36),
        ),
        // 11: take without a limit, take above the limit.
        (
            s_frame(1, 1, 0x37, 0, 1, b"k", b""),
            error(ErrorCode::InvalidCount, 0x37),
        ),
        (
            s_frame(1, 1, 0x38, 3, 4, b"k", b""),
            error(ErrorCode::InvalidCount, 0x38),
        ),
        (
            s_frame(1, 1, 0x39, 1, 65535, b"k", b""),
            error(ErrorCode::InvalidCount, 0x39),
        ),
        // Several faults: the lowest code of the request's own fields wins
        // (spec §6: 3, 4, 5, then 11).
        (
            s_frame(1, 0, 0x3a, 0, 9, b"", b"\xff"),
            error(ErrorCode::EmptyKey, 0x3a),
        ),
        (
            s_frame(1, 0, 0x3b, 0, 9, b"k", b"\xff"),
            error(ErrorCode::KeyNotUtf8, 0x3b),
        ),
        (
            s_frame(1, 0, 0x3c, 0, 9, b"k", b""),
            error(ErrorCode::ZeroLease, 0x3c),
        ),
        // `H`: the id is its id.
        (
            b"H\x00\x00\x00\x00\x00\x00\x00\x41\n".to_vec(),
            error(ErrorCode::EmptyKey, 0x41),
        ),
        (
            b"H\x00\x00\x00\x00\x00\x00\x00\x42\xc0\x80\n".to_vec(),
            error(ErrorCode::KeyNotUtf8, 0x42),
        ),
        // `L`: count 0, 1001 and 65535 are out of range; a prefix that is
        // not UTF-8 is 4, also when the count is bad too.
        (l_frame(0x51, 0, b""), error(ErrorCode::InvalidCount, 0x51)),
        (
            l_frame(0x52, 1001, b"p"),
            error(ErrorCode::InvalidCount, 0x52),
        ),
        (
            l_frame(0x53, 65535, b"p"),
            error(ErrorCode::InvalidCount, 0x53),
        ),
        (
            l_frame(0x54, 10, b"\xff"),
            error(ErrorCode::KeyNotUtf8, 0x54),
        ),
        (
            l_frame(0x55, 0, b"\xff"),
            error(ErrorCode::KeyNotUtf8, 0x55),
        ),
    ]
}

/// An `L` frame with cursor 7.
fn l_frame(id: u64, count: u16, prefix: &[u8]) -> Vec<u8> {
    let mut frame = vec![b'L'];
    frame.extend_from_slice(&id.to_be_bytes());
    frame.extend_from_slice(&7u64.to_be_bytes());
    frame.extend_from_slice(&count.to_be_bytes());
    frame.extend_from_slice(prefix);
    frame.push(b'\n');
    frame
}

fn encoded_request(request: &Request<'_>) -> Vec<u8> {
    let mut out = Vec::new();
    encode_request(request, &mut out);
    out
}

fn encoded_response(response: &Response) -> Vec<u8> {
    let mut out = Vec::new();
    encode_response(response, &mut out);
    out
}

/// Feeds `frame` one byte at a time: every proper prefix is incomplete, the
/// whole frame decodes to `expected`.
fn assert_incomplete_until_last_byte(frame: &[u8], expected: Decoded<'_>) {
    for end in 0..frame.len() {
        assert_eq!(
            decode_request(&frame[..end]),
            Decoded::Incomplete,
            "prefix of {end} bytes of {frame:?}"
        );
    }
    assert_eq!(decode_request(frame), expected, "whole frame {frame:?}");
}

#[test]
fn every_request_decodes_from_its_literal_bytes() {
    for (frame, request) in request_samples() {
        assert_eq!(
            decode_request(frame),
            Decoded::Request {
                request,
                len: frame.len()
            }
        );
    }
}

#[test]
fn every_request_encodes_to_its_literal_bytes() {
    for (frame, request) in request_samples()
        .into_iter()
        .chain(newline_header_samples())
    {
        assert_eq!(encoded_request(&request), frame, "{request:?}");
    }
}

#[test]
fn every_request_split_at_every_byte_is_incomplete_until_its_last_byte() {
    for (frame, request) in request_samples()
        .into_iter()
        .chain(newline_header_samples())
    {
        assert_incomplete_until_last_byte(
            frame,
            Decoded::Request {
                request,
                len: frame.len(),
            },
        );
    }
}

#[test]
fn every_invalid_request_split_at_every_byte_is_incomplete_until_its_last_byte() {
    for (frame, error) in invalid_samples() {
        assert_incomplete_until_last_byte(
            &frame,
            Decoded::Invalid {
                error,
                len: frame.len(),
            },
        );
        assert!(!error.code.is_fatal());
    }
}

#[test]
fn fixed_headers_full_of_newlines_decode_by_byte_count() {
    for (frame, request) in newline_header_samples() {
        assert_eq!(
            decode_request(frame),
            Decoded::Request {
                request,
                len: frame.len()
            },
            "{frame:?}"
        );
    }
}

#[test]
fn a_decoded_frame_is_not_affected_by_the_bytes_after_it() {
    let next = b"P\x00\x00\x00\x00\x00\x00\x00\x01\nA\x00";
    for (frame, request) in request_samples() {
        let mut buf = frame.to_vec();
        buf.extend_from_slice(next);
        assert_eq!(
            decode_request(&buf),
            Decoded::Request {
                request,
                len: frame.len()
            }
        );
    }
}

#[test]
fn many_frames_in_one_buffer_decode_in_order_including_invalid_ones() {
    let mut buf = Vec::new();
    let mut expected = Vec::new();
    for round in 0..3 {
        for (frame, request) in request_samples()
            .into_iter()
            .chain(newline_header_samples())
        {
            buf.extend_from_slice(frame);
            expected.push(Ok(request));
        }
        for (frame, error) in invalid_samples().into_iter().skip(round) {
            buf.extend_from_slice(&frame);
            expected.push(Err(error));
        }
    }
    let mut at = 0;
    let mut decoded = Vec::new();
    while at < buf.len() {
        match decode_request(&buf[at..]) {
            Decoded::Request { request, len } => {
                decoded.push(Ok(request));
                at += len;
            }
            Decoded::Invalid { error, len } => {
                decoded.push(Err(error));
                at += len;
            }
            other => panic!("at byte {at}: {other:?}"),
        }
    }
    assert_eq!(at, buf.len());
    assert_eq!(decoded, expected);
    assert_eq!(decode_request(&buf[at..]), Decoded::Incomplete);
}

#[test]
fn error_codes_carry_the_right_id_and_consume_the_whole_frame() {
    // One frame for each non-fatal code, then a valid ping: the decoder goes
    // on right after each invalid frame.
    for (frame, error) in invalid_samples() {
        let mut buf = frame.clone();
        buf.extend_from_slice(b"P\x00\x00\x00\x00\x00\x00\x00\x05\n");
        let Decoded::Invalid { error: got, len } = decode_request(&buf) else {
            panic!("{frame:?}: {:?}", decode_request(&buf));
        };
        assert_eq!((got, len), (error, frame.len()), "{frame:?}");
        assert_eq!(
            decode_request(&buf[len..]),
            Decoded::Request {
                request: Request::Ping { nonce: 5 },
                len: 10
            }
        );
    }
}

#[test]
fn unknown_op_is_fatal_error_1_with_id_0() {
    for op in (0..=255u8).filter(|op| !b"AREQPISHLUOC".contains(op)) {
        let fatal = Decoded::Fatal(RequestError {
            code: ErrorCode::UnknownOp,
            id: 0,
        });
        assert_eq!(decode_request(&[op]), fatal, "op {op:#04x}");
        assert_eq!(decode_request(&[op, b'k', b'\n']), fatal, "op {op:#04x}");
    }
    // A stray newline and the response-only ops are not requests either.
    assert_eq!(
        decode_request(b"\nI\n"),
        Decoded::Fatal(RequestError {
            code: ErrorCode::UnknownOp,
            id: 0
        })
    );
}

/// The header of each op that may carry a variable part, with the id an
/// error on it carries.
fn headers_with_ids() -> Vec<(Vec<u8>, u64)> {
    vec![
        (b"A\x01\x01\x00\x00\x00\x00\x00\x00\x00\x21".to_vec(), 0x21),
        (b"R\x00\x00\x00\x00\x00\x00\x00\x22".to_vec(), 0x22),
        (b"E\x01\x00\x00\x00\x00\x00\x00\x00\x23".to_vec(), 0x23),
        (b"Q".to_vec(), 0),
        (b"P\x00\x00\x00\x00\x00\x00\x00\x24".to_vec(), 0x24),
        (b"I".to_vec(), 0),
        (b"H\x00\x00\x00\x00\x00\x00\x00\x25".to_vec(), 0x25),
        (
            b"L\x00\x00\x00\x00\x00\x00\x00\x26\x00\x00\x00\x00\x00\x00\x00\x00\x00\x01".to_vec(),
            0x26,
        ),
        (b"U".to_vec(), 0),
    ]
}

#[test]
fn a_255_byte_key_is_accepted_and_256_bytes_is_fatal_error_2() {
    let key_255 = "k".repeat(255);
    for (header, id) in headers_with_ids() {
        // 255 bytes and the newline as the 256th byte after the header.
        let mut frame = header.clone();
        frame.extend_from_slice(key_255.as_bytes());
        frame.push(b'\n');
        let decoded = decode_request(&frame);
        match header[0] {
            b'P' | b'I' => assert_eq!(
                decoded,
                Decoded::Invalid {
                    error: RequestError {
                        code: ErrorCode::UnexpectedPayload,
                        id
                    },
                    len: frame.len()
                }
            ),
            _ => {
                let Decoded::Request { request, len } = decoded else {
                    panic!("{decoded:?}");
                };
                assert_eq!(len, frame.len());
                assert_eq!(encoded_request(&request), frame);
            }
        }
        // 255 bytes without the newline yet: still incomplete.
        assert_eq!(
            decode_request(&frame[..frame.len() - 1]),
            Decoded::Incomplete
        );
        // A 256th byte that is not a newline: too long, whatever follows.
        let mut too_long = header.clone();
        too_long.extend_from_slice(key_255.as_bytes());
        too_long.push(b'k');
        let fatal = Decoded::Fatal(RequestError {
            code: ErrorCode::FrameTooLong,
            id,
        });
        assert_eq!(decode_request(&too_long), fatal, "op {}", header[0] as char);
        too_long.extend_from_slice(b"\nI\n");
        assert_eq!(decode_request(&too_long), fatal);
    }
    let mut largest_a = b"A\x01\x01\x00\x00\x00\x00\x00\x00\x00\x01".to_vec();
    largest_a.extend_from_slice(key_255.as_bytes());
    largest_a.push(b'\n');
    assert!(matches!(
        decode_request(&largest_a),
        Decoded::Request { len: 267, .. }
    ));
}

#[test]
fn s_takes_its_key_by_klen_then_allows_a_128_byte_label_and_no_more() {
    let key_255 = "k".repeat(255);
    let label_128 = "l".repeat(128);
    for key in ["k", key_255.as_str()] {
        // A 128-byte label: the newline is the 129th byte after the key.
        let frame = s_frame(2, 3, 0x61, 4, 4, key.as_bytes(), label_128.as_bytes());
        let request = Request::Acquire {
            wait_s: 2,
            lease_s: 3,
            owner: 0x61,
            key,
            limit: 4,
            take: 4,
            label: &label_128,
        };
        assert_incomplete_until_last_byte(
            &frame,
            Decoded::Request {
                request,
                len: frame.len(),
            },
        );
        assert_eq!(encoded_request(&request), frame);
        // A 129th label byte that is not the newline: too long, id = owner.
        let mut too_long = frame[..frame.len() - 1].to_vec();
        too_long.push(b'l');
        let fatal = Decoded::Fatal(RequestError {
            code: ErrorCode::FrameTooLong,
            id: 0x61,
        });
        assert_eq!(decode_request(&too_long), fatal);
        assert_eq!(
            decode_request(&too_long[..too_long.len() - 1]),
            Decoded::Incomplete
        );
        too_long.extend_from_slice(b"\nI\n");
        assert_eq!(decode_request(&too_long), fatal);
    }
    // The largest request frame of all: klen 255 and a 128-byte label.
    let largest = s_frame(1, 1, 1, 0, 0, key_255.as_bytes(), label_128.as_bytes());
    assert_eq!(largest.len(), 400);
    assert_eq!(REQUEST_FRAME_MAX, 400);
    assert!(matches!(
        decode_request(&largest),
        Decoded::Request { len: 400, .. }
    ));
    // 128 bytes of multibyte label round-trip; 129 bytes of them do not fit.
    let label_euro = "\u{20ac}".repeat(42) + "ab";
    assert_eq!(label_euro.len(), 128);
    let frame = s_frame(1, 1, 1, 0, 0, b"k", label_euro.as_bytes());
    assert!(matches!(decode_request(&frame), Decoded::Request { .. }));
    let frame = s_frame(1, 1, 1, 0, 0, b"k", (label_euro + "c").as_bytes());
    assert_eq!(
        decode_request(&frame),
        Decoded::Fatal(RequestError {
            code: ErrorCode::FrameTooLong,
            id: 1
        })
    );
    // klen 0 is a whole (invalid) frame whose bound starts at the header.
    let frame = s_frame(1, 1, 5, 0, 0, b"", label_128.as_bytes());
    assert_eq!(
        decode_request(&frame),
        Decoded::Invalid {
            error: RequestError {
                code: ErrorCode::EmptyKey,
                id: 5
            },
            len: 1 + 15 + 128 + 1
        }
    );
    // Newlines inside the key's klen bytes never end the frame early.
    let frame = s_frame(1, 1, 6, 0, 0, b"\n\n\n", b"");
    assert_incomplete_until_last_byte(
        &frame,
        Decoded::Invalid {
            error: RequestError {
                code: ErrorCode::KeyNotUtf8,
                id: 6,
            },
            len: frame.len(),
        },
    );
}

#[test]
fn s_counts_at_their_bounds() {
    let decode = |limit, take| match decode_request(&s_frame(1, 1, 9, limit, take, b"k", b"")) {
        Decoded::Request { .. } => Ok(()),
        Decoded::Invalid { error, .. } => Err(error.code),
        other => panic!("{other:?}"),
    };
    let invalid = Err(ErrorCode::InvalidCount);
    assert_eq!(decode(0, 0), Ok(()));
    assert_eq!(decode(65535, 0), Ok(()));
    assert_eq!(decode(1, 1), Ok(()));
    assert_eq!(decode(65535, 65535), Ok(()));
    assert_eq!(decode(65535, 1), Ok(()));
    assert_eq!(decode(0, 1), invalid);
    assert_eq!(decode(0, 65535), invalid);
    assert_eq!(decode(1, 2), invalid);
    assert_eq!(decode(65534, 65535), invalid);
}

#[test]
fn l_counts_at_their_bounds() {
    let decode = |count| match decode_request(&l_frame(9, count, b"")) {
        Decoded::Request { .. } => Ok(()),
        Decoded::Invalid { error, .. } => Err(error.code),
        other => panic!("{other:?}"),
    };
    for count in [1, 2, 999, 1000] {
        assert_eq!(decode(count), Ok(()), "{count}");
    }
    for count in [0, 1001, 1002, 65535] {
        assert_eq!(decode(count), Err(ErrorCode::InvalidCount), "{count}");
    }
}

#[test]
fn a_plain_acquire_is_written_as_a_and_s_without_permits_or_label_is_the_same_request() {
    let a_frame: &[u8] = b"A\x05\x1e\x00\x00\x00\x00\x00\x00\x00\x07key\n";
    let request = Request::Acquire {
        wait_s: 5,
        lease_s: 30,
        owner: 7,
        key: "key",
        limit: 0,
        take: 0,
        label: "",
    };
    assert!(request.is_plain_acquire());
    assert_eq!(encoded_request(&request), a_frame);
    // The same request sent as `S` decodes to the same value (spec §10.1).
    let s = s_frame(5, 30, 7, 0, 0, b"key", b"");
    assert_eq!(
        decode_request(&s),
        Decoded::Request {
            request,
            len: s.len()
        }
    );
    // Anything that `A` cannot say is written as `S`.
    for (limit, take, label) in [(0, 0, "x"), (1, 0, ""), (2, 1, ""), (65535, 1, "r")] {
        let request = Request::Acquire {
            wait_s: 5,
            lease_s: 30,
            owner: 7,
            key: "key",
            limit,
            take,
            label,
        };
        assert!(!request.is_plain_acquire());
        assert_eq!(
            encoded_request(&request),
            s_frame(5, 30, 7, limit, take, b"key", label.as_bytes())
        );
    }
}

#[test]
fn a_secret_never_shows_in_debug_output() {
    let request = Request::Authenticate {
        secret: b"hunter2-hunter2-hunter2-hunter2!",
    };
    assert_eq!(
        format!("{request:?}"),
        "Authenticate { secret: <32 bytes> }"
    );
}

#[test]
fn new_requests_correlate_by_owner_or_id_and_their_answers_end_with_z() {
    let (frame, _) = request_samples()[6];
    let Decoded::Request { request: s, .. } = decode_request(frame) else {
        panic!()
    };
    assert_eq!(s.correlation(), Correlation::Acquire { owner: 7 });
    assert_eq!(s.error_id(), 7);
    let holders = Request::Holders { id: 5, key: "k" };
    let list = Request::List {
        id: 6,
        cursor: 0,
        count: 1,
        prefix: "",
    };
    let auth = Request::Authenticate { secret: b"s" };
    assert_eq!(holders.error_id(), 5);
    assert_eq!(list.error_id(), 6);
    assert_eq!(auth.error_id(), 0);
    let grant = |id| Response::Grant {
        id,
        token: 1,
        owner: 2,
        lease_ms: 3,
        held_ms: 4,
        take: 0,
        label: String::new(),
    };
    let waiter = |id| Response::Waiter {
        id,
        owner: 2,
        wait_ms: 3,
        take: 1,
        label: "w".into(),
    };
    let key = |id| Response::Key {
        id,
        grants: 1,
        waiters: 0,
        limit: 0,
        key: "k".into(),
    };
    let end = |id| Response::End {
        id,
        count: 1,
        next: 0,
    };
    let h = holders.correlation();
    let l = list.correlation();
    let u = auth.correlation();
    for (response, by_h, by_l, by_u) in [
        (grant(5), true, false, false),
        (waiter(5), true, false, false),
        (end(5), true, false, false),
        (key(5), false, false, false),
        (grant(6), false, false, false),
        (key(6), false, true, false),
        (end(6), false, true, false),
        (ErrorCode::NotPermitted.response(5), true, false, false),
        (ErrorCode::InvalidCount.response(6), false, true, false),
        (
            Response::Authenticated { name: "ci".into() },
            false,
            false,
            true,
        ),
        (ErrorCode::NotPermitted.response(0), false, false, true),
        (
            Response::Query {
                token: 0,
                owner: 0,
                lease_ms: 0,
                waiters: 0,
            },
            false,
            false,
            false,
        ),
    ] {
        assert_eq!(h.is_answered_by(&response), by_h, "{response:?}");
        assert_eq!(l.is_answered_by(&response), by_l, "{response:?}");
        assert_eq!(u.is_answered_by(&response), by_u, "{response:?}");
    }
    assert!(!grant(5).ends_answer() && !waiter(5).ends_answer() && !key(6).ends_answer());
    assert!(end(5).ends_answer());
    assert!(Response::limit_mismatch(7, 3).ends_answer());
    assert!(
        s.correlation()
            .is_answered_by(&Response::limit_mismatch(7, 3))
    );
    assert!(
        !s.correlation()
            .is_answered_by(&Response::limit_mismatch(8, 3))
    );
}

#[test]
fn limit_mismatch_names_the_keys_limit_exactly_and_parses_back() {
    for limit in [1u16, 7, 65535] {
        let response = Response::limit_mismatch(0x77, limit);
        let mut expected = b"X\x0a\x00\x00\x00\x00\x00\x00\x00\x77".to_vec();
        expected.extend_from_slice(format!("limit mismatch: key limit {limit}\n").as_bytes());
        assert_eq!(encoded_response(&response), expected);
        let Response::Error { code, text, .. } = response else {
            panic!()
        };
        assert_eq!(ErrorCode::from_u8(code), Some(ErrorCode::LimitMismatch));
        assert_eq!(parse_limit_mismatch(&text), Some(limit));
    }
    for text in [
        "",
        "limit mismatch: key limit ",
        "limit mismatch: key limit 65536",
        "limit mismatch: key limit -1",
        "limit mismatch: key limit +1",
        "limit mismatch: key limit 3 ",
        "limit mismatch",
        ErrorCode::LimitMismatch.text(),
    ] {
        assert_eq!(parse_limit_mismatch(text), None, "{text:?}");
    }
}

#[test]
fn a_255_byte_multibyte_key_round_trips() {
    // 85 three-byte characters: exactly 255 bytes.
    let key = "€".repeat(85);
    assert_eq!(key.len(), 255);
    let request = Request::Query { key: &key };
    let frame = encoded_request(&request);
    assert_eq!(
        decode_request(&frame),
        Decoded::Request { request, len: 257 }
    );
}

#[test]
fn error_codes_are_fatal_exactly_for_1_2_7_8_9_12_and_have_short_ascii_texts() {
    for value in 0..=255u8 {
        let Some(code) = ErrorCode::from_u8(value) else {
            assert!(value == 0 || value > 13, "{value}");
            continue;
        };
        assert_eq!(code as u8, value);
        assert_eq!(
            code.is_fatal(),
            matches!(value, 1 | 2 | 7 | 8 | 9 | 12),
            "{code:?}"
        );
        let text = code.text();
        assert!(!text.is_empty() && text.len() <= 80, "{text:?}");
        assert!(text.bytes().all(|b| b.is_ascii() && b != b'\n'), "{text:?}");
        assert_eq!(
            code.response(42),
            Response::Error {
                code: value,
                id: 42,
                text: text.into()
            }
        );
    }
}

/// Every response op once, written out byte for byte.
fn response_samples() -> Vec<(Vec<u8>, Response)> {
    vec![
        (
            b"A\x00\x00\x00\x00\x00\x00\x00\x07\x00\x00\x00\x00\x00\x00\x01\x00\n".to_vec(),
            Response::Acquired {
                owner: 7,
                token: 256,
            },
        ),
        (
            b"T\x00\x00\x00\x00\x00\x00\x00\x07\n".to_vec(),
            Response::Timeout { owner: 7 },
        ),
        (
            b"B\x0a\x0a\x0a\x0a\x0a\x0a\x0a\x0a\n".to_vec(),
            Response::Busy {
                owner: 0x0a0a_0a0a_0a0a_0a0a,
            },
        ),
        (
            b"R\x00\x00\x00\x00\x00\x00\x00\x0a\n".to_vec(),
            Response::Released { token: 10 },
        ),
        (
            b"E\xff\xff\xff\xff\xff\xff\xff\xff\n".to_vec(),
            Response::Extended { token: u64::MAX },
        ),
        (
            b"N\x00\x00\x00\x00\x00\x00\x00\x00\n".to_vec(),
            Response::NotHeld { token: 0 },
        ),
        (
            b"Q\x00\x00\x00\x00\x00\x00\x00\x05\x00\x00\x00\x00\x00\x00\x00\x07\x00\x00\x75\x30\x00\x00\x00\x02\n".to_vec(),
            Response::Query {
                token: 5,
                owner: 7,
                lease_ms: 30_000,
                waiters: 2,
            },
        ),
        (
            b"Q\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\n".to_vec(),
            Response::Query {
                token: 0,
                owner: 0,
                lease_ms: 0,
                waiters: 0,
            },
        ),
        (
            b"P\x0a\x00\x00\x00\x00\x00\x00\x0a\n".to_vec(),
            Response::Pong {
                nonce: 0x0a00_0000_0000_000a,
            },
        ),
        (
            b"Iversion=0.1.0 keys=3\n".to_vec(),
            Response::Info("version=0.1.0 keys=3".to_owned()),
        ),
        (b"I\n".to_vec(), Response::Info(String::new())),
        (
            b"X\x03\x00\x00\x00\x00\x00\x00\x00\x09key is empty\n".to_vec(),
            Response::Error {
                code: 3,
                id: 9,
                text: "key is empty".into(),
            },
        ),
        (
            b"X\x0a\x0a\x0a\x0a\x0a\x0a\x0a\x0a\x0a\n".to_vec(),
            Response::Error {
                code: 10,
                id: 0x0a0a_0a0a_0a0a_0a0a,
                text: "".into(),
            },
        ),
        (
            b"X\x0a\x00\x00\x00\x00\x00\x00\x00\x07limit mismatch: key limit 3\n".to_vec(),
            Response::limit_mismatch(7, 3),
        ),
        (
            b"G\x00\x00\x00\x00\x00\x00\x00\x2a\x00\x00\x00\x00\x00\x00\x01\x00\x00\x00\x00\x00\x00\x00\x00\x07\x00\x00\x75\x30\x00\x00\x00\x0a\x00\x01bob@h pid=1\n".to_vec(),
            Response::Grant {
                id: 42,
                token: 256,
                owner: 7,
                lease_ms: 30_000,
                held_ms: 10,
                take: 1,
                label: "bob@h pid=1".into(),
            },
        ),
        (
            b"G\x0a\x0a\x0a\x0a\x0a\x0a\x0a\x0a\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x0a\x0a\x0a\x0a\x0a\x0a\x0a\x0a\x00\x00\n".to_vec(),
            Response::Grant {
                id: 0x0a0a_0a0a_0a0a_0a0a,
                token: 0,
                owner: 0,
                lease_ms: 0x0a0a_0a0a,
                held_ms: 0x0a0a_0a0a,
                take: 0,
                label: String::new(),
            },
        ),
        (
            b"W\x00\x00\x00\x00\x00\x00\x00\x2a\x00\x00\x00\x00\x00\x00\x00\x08\x00\x00\x13\x88\xff\xffw\n".to_vec(),
            Response::Waiter {
                id: 42,
                owner: 8,
                wait_ms: 5000,
                take: 65535,
                label: "w".into(),
            },
        ),
        (
            b"K\x00\x00\x00\x00\x00\x00\x00\x2b\x00\x00\x00\x03\x00\x00\x00\x02\xff\xffjobs/a\n".to_vec(),
            Response::Key {
                id: 43,
                grants: 3,
                waiters: 2,
                limit: 65535,
                key: "jobs/a".into(),
            },
        ),
        (
            b"Z\x00\x00\x00\x00\x00\x00\x00\x2b\x00\x00\x03\xe8\x00\x00\x00\x00\x00\x00\x01\x02\n".to_vec(),
            Response::End {
                id: 43,
                count: 1000,
                next: 0x0102,
            },
        ),
        (
            b"Z\x0a\x0a\x0a\x0a\x0a\x0a\x0a\x0a\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\n".to_vec(),
            Response::End {
                id: 0x0a0a_0a0a_0a0a_0a0a,
                count: 0,
                next: 0,
            },
        ),
        (
            b"Uci-runner\n".to_vec(),
            Response::Authenticated {
                name: "ci-runner".into(),
            },
        ),
        (
            b"U\n".to_vec(),
            Response::Authenticated {
                name: String::new(),
            },
        ),
    ]
}

#[test]
fn every_response_encodes_to_and_decodes_from_its_literal_bytes() {
    for (frame, response) in response_samples() {
        assert_eq!(encoded_response(&response), frame, "{response:?}");
        assert_eq!(
            decode_response(&frame),
            Ok(Some((response, frame.len()))),
            "{frame:?}"
        );
    }
}

#[test]
fn every_response_split_at_every_byte_is_incomplete_until_its_last_byte() {
    for (frame, response) in response_samples() {
        for end in 0..frame.len() {
            assert_eq!(
                decode_response(&frame[..end]),
                Ok(None),
                "{end} of {frame:?}"
            );
        }
        assert_eq!(decode_response(&frame), Ok(Some((response, frame.len()))));
    }
}

#[test]
fn many_responses_in_one_buffer_decode_in_order() {
    let samples = response_samples();
    let mut buf = Vec::new();
    for (frame, _) in samples.iter().chain(samples.iter().rev()) {
        buf.extend_from_slice(frame);
    }
    let mut at = 0;
    let mut decoded = Vec::new();
    while let Some((response, len)) = decode_response(&buf[at..]).unwrap() {
        decoded.push(response);
        at += len;
    }
    assert_eq!(at, buf.len());
    let expected: Vec<Response> = samples
        .iter()
        .chain(samples.iter().rev())
        .map(|(_, response)| response.clone())
        .collect();
    assert_eq!(decoded, expected);
}

#[test]
fn response_decoder_errors() {
    for op in [b'S', b'a', b'\n', b'H', b'L', 0] {
        assert_eq!(
            decode_response(&[op, 0, 0]),
            Err(ResponseError::UnknownOp(op))
        );
    }
    // A fixed-size frame must end right after its header.
    assert_eq!(
        decode_response(b"T\x00\x00\x00\x00\x00\x00\x00\x07x\n"),
        Err(ResponseError::MissingNewline(b'T'))
    );
    assert_eq!(
        decode_response(b"A\x00\x00\x00\x00\x00\x00\x00\x07\x00\x00\x00\x00\x00\x00\x00\x01\x00"),
        Err(ResponseError::MissingNewline(b'A'))
    );
    let mut z = vec![b'Z'];
    z.extend_from_slice(&[0; 20]);
    z.push(b'x');
    assert_eq!(
        decode_response(&z),
        Err(ResponseError::MissingNewline(b'Z'))
    );
    // Text up to the limit is fine; one byte more without a newline is not.
    for (op, header_len) in [
        (b'I', 0),
        (b'X', 9),
        (b'G', 34),
        (b'W', 22),
        (b'K', 18),
        (b'U', 0),
    ] {
        let mut frame = vec![op];
        frame.extend(std::iter::repeat_n(1, header_len));
        let header = frame.len();
        frame.extend(std::iter::repeat_n(b't', RESPONSE_TEXT_MAX));
        assert_eq!(decode_response(&frame), Ok(None));
        let mut ok = frame.clone();
        ok.push(b'\n');
        let (response, len) = decode_response(&ok).unwrap().unwrap();
        assert_eq!(len, header + RESPONSE_TEXT_MAX + 1);
        assert_eq!(encoded_response(&response), ok);
        frame.push(b't');
        assert_eq!(decode_response(&frame), Err(ResponseError::TextTooLong(op)));
    }
}

#[test]
fn response_text_with_a_newline_cannot_end_the_frame_early() {
    let frame = encoded_response(&Response::Info("a=1\nb=2".to_owned()));
    assert_eq!(frame, b"Ia=1 b=2\n");
}

fn key_strategy() -> impl Strategy<Value = String> {
    prop_oneof![
        "[a-z0-9:/._-]{1,40}",
        "\\PC{1,60}".prop_filter("fits", |key: &String| key.len() <= 255
            && !key.contains('\n')),
        Just("k".repeat(255)),
    ]
}

#[derive(Clone, Debug)]
enum OwnedRequest {
    Acquire(u8, u8, u64, String),
    Permits(u8, u8, u64, u16, u16, String, String),
    Holders(u64, String),
    List(u64, u64, u16, String),
    Authenticate(Vec<u8>),
    Release(u64, String),
    Extend(u8, u64, String),
    Query(String),
    Ping(u64),
    Info,
    Proclaim(u64, String, String),
}

impl OwnedRequest {
    fn borrow(&self) -> Request<'_> {
        match self {
            OwnedRequest::Acquire(wait_s, lease_s, owner, key) => Request::Acquire {
                wait_s: *wait_s,
                lease_s: *lease_s,
                owner: *owner,
                key,
                limit: 0,
                take: 0,
                label: "",
            },
            OwnedRequest::Permits(wait_s, lease_s, owner, limit, take, key, label) => {
                Request::Acquire {
                    wait_s: *wait_s,
                    lease_s: *lease_s,
                    owner: *owner,
                    key,
                    limit: *limit,
                    take: *take,
                    label,
                }
            }
            OwnedRequest::Holders(id, key) => Request::Holders { id: *id, key },
            OwnedRequest::List(id, cursor, count, prefix) => Request::List {
                id: *id,
                cursor: *cursor,
                count: *count,
                prefix,
            },
            OwnedRequest::Authenticate(secret) => Request::Authenticate { secret },
            OwnedRequest::Release(token, key) => Request::Release { token: *token, key },
            OwnedRequest::Extend(lease_s, token, key) => Request::Extend {
                lease_s: *lease_s,
                token: *token,
                key,
            },
            OwnedRequest::Query(key) => Request::Query { key },
            OwnedRequest::Ping(nonce) => Request::Ping { nonce: *nonce },
            OwnedRequest::Info => Request::Info,
            OwnedRequest::Proclaim(token, key, label) => Request::Proclaim {
                token: *token,
                key,
                label,
            },
        }
    }
}

fn request_strategy() -> impl Strategy<Value = OwnedRequest> {
    prop_oneof![
        (any::<u8>(), 1..=255u8, any::<u64>(), key_strategy())
            .prop_map(|(w, l, o, k)| OwnedRequest::Acquire(w, l, o, k)),
        (any::<u64>(), key_strategy()).prop_map(|(t, k)| OwnedRequest::Release(t, k)),
        (1..=255u8, any::<u64>(), key_strategy())
            .prop_map(|(l, t, k)| OwnedRequest::Extend(l, t, k)),
        key_strategy().prop_map(OwnedRequest::Query),
        any::<u64>().prop_map(OwnedRequest::Ping),
        Just(OwnedRequest::Info),
        (
            any::<u8>(),
            1..=255u8,
            any::<u64>(),
            (1..=65535u16).prop_flat_map(|limit| (Just(limit), 0..=limit)),
            key_strategy(),
            label_strategy(),
        )
            .prop_map(|(w, l, o, (limit, take), k, label)| OwnedRequest::Permits(
                w, l, o, limit, take, k, label
            )),
        (
            any::<u8>(),
            1..=255u8,
            any::<u64>(),
            key_strategy(),
            label_strategy()
        )
            .prop_map(|(w, l, o, k, label)| OwnedRequest::Permits(w, l, o, 0, 0, k, label)),
        (any::<u64>(), key_strategy()).prop_map(|(id, k)| OwnedRequest::Holders(id, k)),
        (
            any::<u64>(),
            any::<u64>(),
            1..=1000u16,
            prop_oneof![Just(String::new()), key_strategy()]
        )
            .prop_map(|(id, cursor, count, prefix)| OwnedRequest::List(id, cursor, count, prefix)),
        prop::collection::vec(
            any::<u8>().prop_filter("no newline", |b| *b != b'\n'),
            0..=255
        )
        .prop_map(OwnedRequest::Authenticate),
        (any::<u64>(), key_strategy(), label_strategy())
            .prop_map(|(t, k, label)| OwnedRequest::Proclaim(t, k, label)),
    ]
}

fn label_strategy() -> impl Strategy<Value = String> {
    prop_oneof![
        Just(String::new()),
        "[ -~]{0,128}",
        "\\PC{0,40}".prop_filter("fits", |label: &String| label.len() <= 128
            && !label.contains('\n')),
        Just("l".repeat(128)),
    ]
}

fn response_strategy() -> impl Strategy<Value = Response> {
    let text = "[ -~]{0,100}".prop_map(String::from);
    prop_oneof![
        (any::<u64>(), any::<u64>()).prop_map(|(owner, token)| Response::Acquired { owner, token }),
        any::<u64>().prop_map(|owner| Response::Timeout { owner }),
        any::<u64>().prop_map(|owner| Response::Busy { owner }),
        any::<u64>().prop_map(|token| Response::Released { token }),
        any::<u64>().prop_map(|token| Response::Extended { token }),
        any::<u64>().prop_map(|token| Response::NotHeld { token }),
        any::<u64>().prop_map(|token| Response::Proclaimed { token }),
        (any::<u64>(), any::<u64>(), any::<u32>(), any::<u32>()).prop_map(
            |(token, owner, lease_ms, waiters)| Response::Query {
                token,
                owner,
                lease_ms,
                waiters
            }
        ),
        any::<u64>().prop_map(|nonce| Response::Pong { nonce }),
        (
            any::<u64>(),
            any::<u64>(),
            any::<u64>(),
            any::<u32>(),
            any::<u32>(),
            any::<u16>(),
            text.clone()
        )
            .prop_map(|(id, token, owner, lease_ms, held_ms, take, label)| {
                Response::Grant {
                    id,
                    token,
                    owner,
                    lease_ms,
                    held_ms,
                    take,
                    label,
                }
            }),
        (
            any::<u64>(),
            any::<u64>(),
            any::<u32>(),
            any::<u16>(),
            text.clone()
        )
            .prop_map(|(id, owner, wait_ms, take, label)| Response::Waiter {
                id,
                owner,
                wait_ms,
                take,
                label
            }),
        (
            any::<u64>(),
            any::<u32>(),
            any::<u32>(),
            any::<u16>(),
            text.clone()
        )
            .prop_map(|(id, grants, waiters, limit, key)| Response::Key {
                id,
                grants,
                waiters,
                limit,
                key
            }),
        (any::<u64>(), any::<u32>(), any::<u64>()).prop_map(|(id, count, next)| Response::End {
            id,
            count,
            next
        }),
        text.clone()
            .prop_map(|name| Response::Authenticated { name }),
        text.clone().prop_map(Response::Info),
        (any::<u8>(), any::<u64>(), text).prop_map(|(code, id, text)| Response::Error {
            code,
            id,
            text: text.into()
        }),
    ]
}

proptest! {
    #[test]
    fn requests_round_trip_through_any_split(
        requests in prop::collection::vec(request_strategy(), 1..8),
        cuts in prop::collection::vec(any::<prop::sample::Index>(), 0..6),
    ) {
        let mut wire = Vec::new();
        for request in &requests {
            encode_request(&request.borrow(), &mut wire);
        }
        // Deliver the bytes in chunks cut at random places, decoding like a
        // reader that keeps the unconsumed rest of its buffer.
        let mut cuts: Vec<usize> = cuts.iter().map(|cut| cut.index(wire.len() + 1)).collect();
        cuts.push(wire.len());
        cuts.sort();
        let mut buffer = Vec::new();
        let mut decoded = Vec::new();
        let mut delivered = 0;
        for cut in cuts {
            buffer.extend_from_slice(&wire[delivered..cut]);
            delivered = cut;
            loop {
                match decode_request(&buffer) {
                    Decoded::Incomplete => break,
                    Decoded::Request { request, len } => {
                        prop_assert!(len <= REQUEST_FRAME_MAX);
                        decoded.push(format!("{request:?}"));
                        buffer.drain(..len);
                    }
                    other => prop_assert!(false, "{:?}", other),
                }
            }
        }
        prop_assert!(buffer.is_empty());
        let expected: Vec<String> = requests.iter().map(|r| format!("{:?}", r.borrow())).collect();
        prop_assert_eq!(decoded, expected);
    }

    #[test]
    fn responses_round_trip_through_any_split(
        responses in prop::collection::vec(response_strategy(), 1..8),
        cut in any::<prop::sample::Index>(),
    ) {
        let mut wire = Vec::new();
        for response in &responses {
            encode_response(response, &mut wire);
        }
        let cut = cut.index(wire.len() + 1);
        let mut buffer = wire[..cut].to_vec();
        let mut decoded = Vec::new();
        while let Some((response, len)) = decode_response(&buffer).unwrap() {
            decoded.push(response);
            buffer.drain(..len);
        }
        buffer.extend_from_slice(&wire[cut..]);
        while let Some((response, len)) = decode_response(&buffer).unwrap() {
            decoded.push(response);
            buffer.drain(..len);
        }
        prop_assert!(buffer.is_empty());
        prop_assert_eq!(decoded, responses);
    }

    /// Whatever a peer sends, the decoder decides within one maximal frame,
    /// never claims more bytes than it was given, and gives the same answer
    /// for the frame alone as for the frame with more bytes behind it.
    #[test]
    fn decoder_on_arbitrary_bytes(bytes in prop::collection::vec(
        prop_oneof![any::<u8>(), Just(b'\n'), Just(b'A'), Just(b'Q'), Just(b'k'), Just(b'S'),
            Just(b'H'), Just(b'L'), Just(b'U'), Just(0u8), Just(1u8)], 0..500)
    ) {
        let decoded = decode_request(&bytes);
        if bytes.len() >= REQUEST_FRAME_MAX {
            prop_assert_ne!(decoded, Decoded::Incomplete);
        }
        match decoded {
            Decoded::Request { len, .. } | Decoded::Invalid { len, .. } => {
                prop_assert!(len <= bytes.len() && len <= REQUEST_FRAME_MAX);
                prop_assert_eq!(bytes[len - 1], b'\n');
                prop_assert_eq!(decode_request(&bytes[..len]), decoded);
                for end in 0..len {
                    prop_assert_eq!(decode_request(&bytes[..end]), Decoded::Incomplete);
                }
            }
            Decoded::Fatal(error) => {
                prop_assert!(error.code.is_fatal());
                let mut longer = bytes.clone();
                longer.extend_from_slice(b"\nI\n");
                prop_assert_eq!(decode_request(&longer), decoded);
            }
            Decoded::Incomplete => {
                prop_assert!(bytes.len() < REQUEST_FRAME_MAX);
            }
        }
    }
}

/// `Response`'s `Debug` is written by hand (for the binary's size): it
/// prints what `#[derive(Debug)]` printed.
#[test]
fn response_debug_is_the_derived_text() {
    let cases = [
        (
            Response::Acquired { owner: 1, token: 2 },
            "Acquired { owner: 1, token: 2 }",
        ),
        (Response::Timeout { owner: 3 }, "Timeout { owner: 3 }"),
        (Response::Busy { owner: 4 }, "Busy { owner: 4 }"),
        (Response::Released { token: 5 }, "Released { token: 5 }"),
        (Response::Extended { token: 6 }, "Extended { token: 6 }"),
        (Response::NotHeld { token: 7 }, "NotHeld { token: 7 }"),
        (Response::Proclaimed { token: 8 }, "Proclaimed { token: 8 }"),
        (
            Response::Query {
                token: 1,
                owner: 2,
                lease_ms: 3,
                waiters: 4,
            },
            "Query { token: 1, owner: 2, lease_ms: 3, waiters: 4 }",
        ),
        (Response::Pong { nonce: 9 }, "Pong { nonce: 9 }"),
        (Response::Info("a\"b".to_owned()), r#"Info("a\"b")"#),
        (
            Response::Error {
                code: 4,
                id: 0,
                text: "bad\n".into(),
            },
            r#"Error { code: 4, id: 0, text: "bad\n" }"#,
        ),
        (
            Response::Grant {
                id: 1,
                token: 2,
                owner: 3,
                lease_ms: 4,
                held_ms: 5,
                take: 6,
                label: "l".to_owned(),
            },
            r#"Grant { id: 1, token: 2, owner: 3, lease_ms: 4, held_ms: 5, take: 6, label: "l" }"#,
        ),
        (
            Response::Waiter {
                id: 1,
                owner: 2,
                wait_ms: 3,
                take: 4,
                label: String::new(),
            },
            r#"Waiter { id: 1, owner: 2, wait_ms: 3, take: 4, label: "" }"#,
        ),
        (
            Response::Key {
                id: 1,
                grants: 2,
                waiters: 3,
                limit: 4,
                key: "k".to_owned(),
            },
            r#"Key { id: 1, grants: 2, waiters: 3, limit: 4, key: "k" }"#,
        ),
        (
            Response::End {
                id: 1,
                count: 2,
                next: 3,
            },
            "End { id: 1, count: 2, next: 3 }",
        ),
        (
            Response::Authenticated {
                name: "n".to_owned(),
            },
            r#"Authenticated { name: "n" }"#,
        ),
        (
            Response::KeyState {
                id: 1,
                token: 2,
                lease_ms: 3,
                held_ms: 4,
                grants: 5,
                waiters: 6,
                label: "x".to_owned(),
            },
            r#"KeyState { id: 1, token: 2, lease_ms: 3, held_ms: 4, grants: 5, waiters: 6, label: "x" }"#,
        ),
    ];
    for (response, text) in cases {
        assert_eq!(format!("{response:?}"), text);
    }
}
