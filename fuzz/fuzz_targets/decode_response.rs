//! Raw bytes through the client's response decoder: no panic, progress on
//! every frame, and the same frames however the bytes are split.
#![no_main]

use kunci::protocol::{
    RESPONSE_TEXT_MAX, decode_response, encode_response, response_has_text, response_header_len,
};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let mut frames = Vec::new();
    let mut at = 0;
    while let Ok(Some((response, len))) = decode_response(&data[at..]) {
        assert!(len >= 2 && at + len <= data.len());
        // What decodes re-encodes to the same bytes, unless its text was
        // not UTF-8 (then it was replaced, and may even have grown).
        let mut encoded = Vec::new();
        encode_response(&response, &mut encoded);
        let op = data[at];
        let text_start = response_has_text(op)
            .then(|| response_header_len(op).map(|header| 1 + header))
            .flatten();
        let text_is_utf8 = text_start
            .is_none_or(|start| std::str::from_utf8(&data[at + start..at + len - 1]).is_ok());
        if text_is_utf8 {
            assert_eq!(encoded, &data[at..at + len]);
            assert_eq!(decode_response(&encoded), Ok(Some((response.clone(), len))));
        }
        frames.push(response);
        at += len;
    }
    if let Ok(None) = decode_response(&data[at..]) {
        // The longest fixed header of a text frame is `G`'s 34 bytes.
        assert!(data.len() - at <= 1 + 34 + RESPONSE_TEXT_MAX + 1);
    }
    // Byte at a time.
    let mut buffer = Vec::new();
    let mut split_frames = Vec::new();
    for &byte in data {
        buffer.push(byte);
        match decode_response(&buffer) {
            Ok(Some((response, len))) => {
                assert_eq!(len, buffer.len());
                split_frames.push(response);
                buffer.clear();
            }
            Ok(None) => {}
            Err(_) => break,
        }
    }
    assert_eq!(frames, split_frames);
});
