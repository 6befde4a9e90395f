//! The wire codec: request and response frames, byte for byte, split at
//! every boundary, packed many to a buffer, and at every size limit.

use kunci::protocol::{
    Decoded, ErrorCode, REQUEST_FRAME_MAX, RESPONSE_TEXT_MAX, Request, RequestError, Response,
    ResponseError, decode_request, decode_response, encode_request, encode_response,
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
            },
        ),
        (
            b"A\x00\x01\x00\x00\x00\x00\x00\x00\x00\x0ak\n",
            Request::Acquire {
                wait_s: 0,
                lease_s: 1,
                owner: 10,
                key: "k",
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
    ]
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
    for op in (0..=255u8).filter(|op| !b"AREQPI".contains(op)) {
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
    assert_eq!(REQUEST_FRAME_MAX, 267);
    let mut largest = b"A\x01\x01\x00\x00\x00\x00\x00\x00\x00\x01".to_vec();
    largest.extend_from_slice(key_255.as_bytes());
    largest.push(b'\n');
    assert_eq!(largest.len(), REQUEST_FRAME_MAX);
    assert!(matches!(
        decode_request(&largest),
        Decoded::Request { len: 267, .. }
    ));
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
fn error_codes_are_fatal_exactly_for_1_2_7_8_9_and_have_short_ascii_texts() {
    for value in 0..=255u8 {
        let Some(code) = ErrorCode::from_u8(value) else {
            assert!(value == 0 || value > 9, "{value}");
            continue;
        };
        assert_eq!(code as u8, value);
        assert_eq!(
            code.is_fatal(),
            matches!(value, 1 | 2 | 7 | 8 | 9),
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
    for op in [b'Z', b'a', b'\n', b'W', 0] {
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
    // Text up to the limit is fine; one byte more without a newline is not.
    for op in [b'I', b'X'] {
        let mut frame = vec![op];
        if op == b'X' {
            frame.extend_from_slice(&[1, 0, 0, 0, 0, 0, 0, 0, 0]);
        }
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
    Release(u64, String),
    Extend(u8, u64, String),
    Query(String),
    Ping(u64),
    Info,
}

impl OwnedRequest {
    fn borrow(&self) -> Request<'_> {
        match self {
            OwnedRequest::Acquire(wait_s, lease_s, owner, key) => Request::Acquire {
                wait_s: *wait_s,
                lease_s: *lease_s,
                owner: *owner,
                key,
            },
            OwnedRequest::Release(token, key) => Request::Release { token: *token, key },
            OwnedRequest::Extend(lease_s, token, key) => Request::Extend {
                lease_s: *lease_s,
                token: *token,
                key,
            },
            OwnedRequest::Query(key) => Request::Query { key },
            OwnedRequest::Ping(nonce) => Request::Ping { nonce: *nonce },
            OwnedRequest::Info => Request::Info,
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
        (any::<u64>(), any::<u64>(), any::<u32>(), any::<u32>()).prop_map(
            |(token, owner, lease_ms, waiters)| Response::Query {
                token,
                owner,
                lease_ms,
                waiters
            }
        ),
        any::<u64>().prop_map(|nonce| Response::Pong { nonce }),
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
        prop_oneof![any::<u8>(), Just(b'\n'), Just(b'A'), Just(b'Q'), Just(b'k')], 0..400)
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
