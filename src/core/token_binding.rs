//! Adoption bound to the key (spec §7.3, v5): a token carries, in its low
//! 16 bits, a MAC of its key and of the grant counter in its high bits,
//! keyed with a secret that only the state directory holds. The next run,
//! during a crash grace, accepts an `E`/`R` of an earlier token only if
//! that MAC checks out for the key named: a token made up, or granted on
//! another key, passes with probability 2^-16 per try. No disk write per
//! grant: the token itself is the record (docs/DESIGN.md, "Adoption bound
//! to the key").
//!
//! ```text
//! token = counter << 16 | mac16(secret, key, counter)
//! mac16 = the low 16 bits of SipHash-1-3(secret; key ‖ counter as u64 BE)
//! ```
//!
//! SipHash is a PRF: the MACs of every token a session has seen (`Q`, `H`,
//! `V` show them) say nothing of the MAC of another (key, counter).

use std::hash::Hasher;

use siphasher::sip::SipHasher13;

/// The bits of a token that hold its MAC.
pub const MAC_BITS: u32 = 16;
/// How far apart two consecutive grants' tokens start: one counter step.
pub const STEP: u64 = 1 << MAC_BITS;
const MAC_MASK: u64 = STEP - 1;
/// Keys up to this long are hashed from a buffer on the stack this size
/// (+ 8); longer ones out of line.
const SHORT_KEY: usize = 56;
/// The secret's length: 128 bits.
pub const SECRET_BYTES: usize = 16;
/// How far the next token may run above the clock's first token
/// (`unix_time_ms × 2^20`) before the server stops binding tokens and
/// issues them +1 apart without a MAC: half of the 2^52 at which spec
/// §7.6 calls a state file implausible, so a busy server never reaches
/// that mark (it would need 2^51 more +1 grants: 35 years at 2 M/s).
pub const MAC_AHEAD_MAX: u64 = 1 << 51;

/// The secret a server's tokens are bound with. Its `Debug` shows
/// nothing of it: it must never reach a log.
#[derive(Clone, Copy)]
pub struct TokenBinding {
    /// SipHash-1-3 keyed with the secret, before any input: cloned per
    /// MAC, so the key schedule is not redone for every grant.
    keyed: SipHasher13,
}

impl std::fmt::Debug for TokenBinding {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TokenBinding(<secret>)")
    }
}

impl TokenBinding {
    pub fn new(secret: &[u8; SECRET_BYTES]) -> TokenBinding {
        TokenBinding {
            keyed: SipHasher13::new_with_key(secret),
        }
    }

    /// The 16-bit MAC of `key` and `counter`.
    #[inline]
    pub fn mac16(&self, key: &[u8], counter: u64) -> u16 {
        // One contiguous message hashed in one pass: `Hasher::write` in
        // two parts buffers the tail between them, and a buffer for the
        // longest key costs a memset per grant (docs/BENCHMARKS.md,
        // "Binding tokens to their keys").
        if key.len() > SHORT_KEY {
            return self.mac16_long(key, counter);
        }
        let mut message = [0u8; SHORT_KEY + 8];
        message[..key.len()].copy_from_slice(key);
        message[key.len()..key.len() + 8].copy_from_slice(&counter.to_be_bytes());
        self.keyed.hash(&message[..key.len() + 8]) as u16
    }

    /// [`mac16`](Self::mac16) of a key longer than [`SHORT_KEY`]: rare,
    /// so streamed into the hasher rather than copied.
    #[cold]
    #[inline(never)]
    fn mac16_long(&self, key: &[u8], counter: u64) -> u16 {
        let mut hasher = self.keyed;
        hasher.write(key);
        hasher.write(&counter.to_be_bytes());
        hasher.finish() as u16
    }

    /// The token of grant number `counter` on `key`. `counter` must be
    /// below 2^48.
    #[inline]
    pub fn token(&self, key: &[u8], counter: u64) -> u64 {
        counter << MAC_BITS | u64::from(self.mac16(key, counter))
    }

    /// Whether `token`'s low bits are the MAC of `key` and its counter:
    /// whether this secret could have bound it to `key`.
    pub fn verify(&self, key: &[u8], token: u64) -> bool {
        u64::from(self.mac16(key, token >> MAC_BITS)) == token & MAC_MASK
    }
}

/// The first token that starts a counter step at or above `token`.
pub fn step_at_or_above(token: u64) -> u64 {
    token.div_ceil(STEP).saturating_mul(STEP)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// SipHash-1-3 as its paper describes it, written out: the crate must
    /// agree with it.
    fn reference_siphash13(key: &[u8; 16], message: &[u8]) -> u64 {
        fn round(v: &mut [u64; 4]) {
            v[0] = v[0].wrapping_add(v[1]);
            v[1] = v[1].rotate_left(13) ^ v[0];
            v[0] = v[0].rotate_left(32);
            v[2] = v[2].wrapping_add(v[3]);
            v[3] = v[3].rotate_left(16) ^ v[2];
            v[0] = v[0].wrapping_add(v[3]);
            v[3] = v[3].rotate_left(21) ^ v[0];
            v[2] = v[2].wrapping_add(v[1]);
            v[1] = v[1].rotate_left(17) ^ v[2];
            v[2] = v[2].rotate_left(32);
        }
        let k0 = u64::from_le_bytes(key[..8].try_into().unwrap());
        let k1 = u64::from_le_bytes(key[8..].try_into().unwrap());
        let mut v = [
            k0 ^ 0x736f_6d65_7073_6575,
            k1 ^ 0x646f_7261_6e64_6f6d,
            k0 ^ 0x6c79_6765_6e65_7261,
            k1 ^ 0x7465_6462_7974_6573,
        ];
        let mut padded = message.to_vec();
        padded.resize(message.len() / 8 * 8 + 7, 0);
        padded.push(message.len() as u8);
        for block in padded.chunks(8) {
            let m = u64::from_le_bytes(block.try_into().unwrap());
            v[3] ^= m;
            round(&mut v);
            v[0] ^= m;
        }
        v[2] ^= 0xff;
        round(&mut v);
        round(&mut v);
        round(&mut v);
        v[0] ^ v[1] ^ v[2] ^ v[3]
    }

    const SECRET: [u8; 16] = *b"0123456789abcdef";

    #[test]
    fn the_mac_is_the_low_16_bits_of_siphash_1_3_over_key_and_big_endian_counter() {
        let binding = TokenBinding::new(&SECRET);
        let long = "k".repeat(300);
        for (key, counter) in [
            ("db", 1u64),
            ("", 0),
            ("a-much-longer-key/x", 1 << 40),
            (&long[..56], 9),
            (&long[..57], 9),
            (&long[..255], 9),
            (&long, 9),
        ] {
            let mut message = key.as_bytes().to_vec();
            message.extend_from_slice(&counter.to_be_bytes());
            assert_eq!(
                binding.mac16(key.as_bytes(), counter),
                reference_siphash13(&SECRET, &message) as u16,
                "{key:?} {counter}"
            );
        }
    }

    #[test]
    fn fixed_vectors() {
        // Pinned: a change here breaks adoption across an upgrade.
        let binding = TokenBinding::new(&SECRET);
        let vectors = [
            ("db", 1u64, 0x0001_0000_u64),
            ("db", 2, 0x0002_0000),
            ("queue/7", 0x0012_3456_789a, 0x0012_3456_789a_0000),
        ];
        let mut got = Vec::new();
        for (key, counter, high) in vectors {
            let token = binding.token(key.as_bytes(), counter);
            assert_eq!(token & !MAC_MASK, high);
            got.push(token & MAC_MASK);
        }
        assert_eq!(got, FIXED_MACS, "{got:#06x?}");
    }

    const FIXED_MACS: [u64; 3] = [0xfe4d, 0x5df4, 0xc065];

    #[test]
    fn a_token_verifies_for_its_key_only_and_its_neighbours_do_not() {
        let binding = TokenBinding::new(&SECRET);
        let token = binding.token(b"db", 77);
        assert!(binding.verify(b"db", token));
        assert!(!binding.verify(b"dc", token));
        assert!(!binding.verify(b"db", token + 1));
        assert!(!binding.verify(b"db", token - 1));
        // Another secret binds differently.
        let other = TokenBinding::new(b"fedcba9876543210");
        assert!(!other.verify(b"db", token));
        // Of 65,536 made-up tokens of one counter exactly one verifies.
        let counter = 78u64 << MAC_BITS;
        let passing = (0..STEP)
            .filter(|&mac| binding.verify(b"db", counter | mac))
            .count();
        assert_eq!(passing, 1);
        assert_eq!(format!("{binding:?}"), "TokenBinding(<secret>)");
    }

    #[test]
    fn steps_start_on_multiples_of_2_to_the_16() {
        assert_eq!(step_at_or_above(0), 0);
        assert_eq!(step_at_or_above(1), STEP);
        assert_eq!(step_at_or_above(STEP), STEP);
        assert_eq!(step_at_or_above(STEP + 1), 2 * STEP);
        assert_eq!(step_at_or_above(u64::MAX), u64::MAX, "none left");
    }
}
