//! Raw bytes through the client's response decoder: no panic, progress on
//! every frame, and the same frames however the bytes are split.
#![no_main]

use kunci::protocol::{RESPONSE_TEXT_MAX, decode_response, encode_response};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let mut frames = Vec::new();
    let mut at = 0;
    while let Ok(Some((response, len))) = decode_response(&data[at..]) {
        assert!(len >= 2 && at + len <= data.len());
        // What decodes re-encodes to the same bytes, except text that was
        // not valid UTF-8.
        let mut encoded = Vec::new();
        encode_response(&response, &mut encoded);
        if std::str::from_utf8(&data[at..at + len]).is_ok() {
            assert_eq!(encoded, &data[at..at + len]);
        }
        frames.push(response);
        at += len;
    }
    if let Ok(None) = decode_response(&data[at..]) {
        assert!(data.len() - at <= 1 + 9 + RESPONSE_TEXT_MAX + 1);
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
