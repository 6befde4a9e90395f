//! Frames written out byte by byte as spec §2 lays them out, not by the
//! library's encoder, so that the tests check the wire independently of it.

/// `O wait:u8 id:u64 since:u64 key \n` (§2.1).
pub fn observe(wait_s: u8, id: u64, since: u64, key: &str) -> Vec<u8> {
    let mut frame = vec![b'O', wait_s];
    frame.extend_from_slice(&id.to_be_bytes());
    frame.extend_from_slice(&since.to_be_bytes());
    frame.extend_from_slice(key.as_bytes());
    frame.push(b'\n');
    frame
}

/// `H id:u64 key \n` (§2.1).
pub fn holders(id: u64, key: &str) -> Vec<u8> {
    let mut frame = vec![b'H'];
    frame.extend_from_slice(&id.to_be_bytes());
    frame.extend_from_slice(key.as_bytes());
    frame.push(b'\n');
    frame
}

/// `V id:u64 token:u64 lease_ms:u32 held_ms:u32 grants:u16 waiters:u32
/// label \n` (§2.2).
pub fn v(
    id: u64,
    token: u64,
    lease_ms: u32,
    held_ms: u32,
    grants: u16,
    waiters: u32,
    label: &str,
) -> Vec<u8> {
    let mut frame = vec![b'V'];
    frame.extend_from_slice(&id.to_be_bytes());
    frame.extend_from_slice(&token.to_be_bytes());
    frame.extend_from_slice(&lease_ms.to_be_bytes());
    frame.extend_from_slice(&held_ms.to_be_bytes());
    frame.extend_from_slice(&grants.to_be_bytes());
    frame.extend_from_slice(&waiters.to_be_bytes());
    frame.extend_from_slice(label.as_bytes());
    frame.push(b'\n');
    frame
}

/// `X code:u8 id:u64 text \n` (§2.2).
pub fn x(code: u8, id: u64, text: &str) -> Vec<u8> {
    let mut frame = vec![b'X', code];
    frame.extend_from_slice(&id.to_be_bytes());
    frame.extend_from_slice(text.as_bytes());
    frame.push(b'\n');
    frame
}

/// `A owner:u64 token:u64 \n` (§2.2).
pub fn a(owner: u64, token: u64) -> Vec<u8> {
    let mut frame = vec![b'A'];
    frame.extend_from_slice(&owner.to_be_bytes());
    frame.extend_from_slice(&token.to_be_bytes());
    frame.push(b'\n');
    frame
}

/// Any answer that is an op and one u64 (`T B R E N P C`, §2.2).
pub fn op_u64(op: u8, value: u64) -> Vec<u8> {
    let mut frame = vec![op];
    frame.extend_from_slice(&value.to_be_bytes());
    frame.push(b'\n');
    frame
}
