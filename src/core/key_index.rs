//! The lock table's index: hash → entry index, open addressing with tag
//! bytes, one cache line per bucket.
//!
//! A bucket is 64 bytes: 12 tag bytes, an overflow count, and the 12 entry
//! indices the tags describe. A lookup loads its home bucket — tags and
//! indices in the same line — compares the 12 tags at once, and reads only
//! the entries whose tag matches; it goes on to the next bucket only while
//! the overflow count says some value that started here was placed further
//! on. So a lookup costs one line of index (the next line, rarely) plus the
//! entry, where a SwissTable (`hashbrown`) touches its control bytes and
//! its separate value array: two lines. docs/BENCHMARKS.md has the measured
//! comparison.
//!
//! The overflow count (after folly's F14) is the number of values whose
//! probe passed this bucket because it was full; removing such a value
//! decrements the counts on its path, so deletions leave no tombstones. A
//! count that reaches 255 stays there: lookups past it are then merely
//! longer, never wrong.

use std::cell::Cell;

/// Values per bucket.
const SLOTS: usize = 12;
/// `tags[i] == EMPTY` marks a free slot; used tags have their top bit set.
const EMPTY: u8 = 0;
const OVERFLOW_STUCK: u8 = u8::MAX;
/// Slots fill to at most 4/5 before the bucket array doubles.
const LOAD_NUMERATOR: usize = 4;
const LOAD_DENOMINATOR: usize = 5;
const BUCKETS_MIN: usize = 4;

#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Bucket {
    tags: [u8; SLOTS],
    overflow: u8,
    _unused: [u8; 3],
    values: [u32; SLOTS],
}

impl Bucket {
    const EMPTY: Bucket = Bucket {
        tags: [EMPTY; SLOTS],
        overflow: 0,
        _unused: [0; 3],
        values: [0; SLOTS],
    };

    /// Bit `i` set where `tags[i] == tag`.
    #[inline]
    fn matches(&self, tag: u8) -> u32 {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::x86_64::{
                __m128i, _mm_cmpeq_epi8, _mm_load_si128, _mm_movemask_epi8, _mm_set1_epi8,
            };
            // SAFETY: SSE2 is part of the x86_64 baseline; the 16 bytes
            // read (tags, overflow, unused) are inside the bucket, which is
            // 64-byte aligned.
            let mask = unsafe {
                let group = _mm_load_si128(std::ptr::from_ref(self).cast::<__m128i>());
                _mm_movemask_epi8(_mm_cmpeq_epi8(group, _mm_set1_epi8(tag as i8)))
            };
            (mask as u32) & ((1 << SLOTS) - 1)
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            let mut mask = 0;
            for (slot, &stored) in self.tags.iter().enumerate() {
                mask |= u32::from(stored == tag) << slot;
            }
            mask
        }
    }
}

/// The bits of `mask`, lowest first.
fn slots_of(mut mask: u32) -> impl Iterator<Item = usize> {
    std::iter::from_fn(move || {
        let slot = mask.trailing_zeros() as usize;
        mask &= mask.wrapping_sub(1);
        (slot < SLOTS).then_some(slot)
    })
}

fn tag_of(hash: u64) -> u8 {
    // The top bits (the bucket comes from the low ones), top bit set.
    (hash >> 57) as u8 | 0x80
}

/// A walk through this many buckets (a lookup past full buckets with
/// overflow, or an insert past full buckets) marks the index as probed
/// suspiciously long. With random hashes at the 4/5 load limit the
/// longest walk among ~600,000 keys is about 20 buckets, and each bucket
/// more is ~1.5× rarer: 64 comes from keys chosen to collide.
pub const LONG_WALK: usize = 64;

/// A set of `u32` values found by a caller-supplied hash and equality.
pub struct KeyIndex {
    buckets: Vec<Bucket>,
    len: usize,
    /// Set by any walk of [`LONG_WALK`] buckets or more.
    long_walk_seen: Cell<bool>,
}

impl Default for KeyIndex {
    fn default() -> Self {
        Self::new()
    }
}

impl KeyIndex {
    pub const fn new() -> KeyIndex {
        KeyIndex {
            buckets: Vec::new(),
            len: 0,
            long_walk_seen: Cell::new(false),
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes of memory the bucket array takes.
    pub fn allocated_bytes(&self) -> usize {
        self.buckets.len() * size_of::<Bucket>()
    }

    fn mask(&self) -> usize {
        self.buckets.len().wrapping_sub(1)
    }

    /// The first value with this hash for which `eq` is true.
    #[inline]
    pub fn find(&self, hash: u64, eq: impl FnMut(u32) -> bool) -> Option<u32> {
        self.position(hash, eq)
            .map(|(bucket, slot, _)| self.buckets[bucket].values[slot])
    }

    /// Starts loading the bucket a lookup of `hash` reads first.
    #[inline]
    pub fn prefetch(&self, hash: u64) {
        if let Some(bucket) = self.buckets.get(hash as usize & self.mask()) {
            super::memory::prefetch_read(std::ptr::from_ref(bucket).cast());
        }
    }

    /// Adds `value` under `hash` (the caller knows it is not there) and
    /// returns how many full buckets its probe passed. `rehash` gives the
    /// hash of any value already stored, for growing.
    pub fn insert(&mut self, hash: u64, value: u32, rehash: impl Fn(u32) -> u64) -> usize {
        if (self.len + 1) * LOAD_DENOMINATOR > self.buckets.len() * SLOTS * LOAD_NUMERATOR {
            self.grow(rehash);
        }
        self.len += 1;
        let probes = Self::place(&mut self.buckets, hash, value);
        if probes >= LONG_WALK {
            self.long_walk_seen.set(true);
        }
        probes
    }

    /// Whether some lookup or insert walked [`LONG_WALK`] buckets or more
    /// since the index was built.
    pub fn long_walk_seen(&self) -> bool {
        self.long_walk_seen.get()
    }

    /// Removes `value`, stored under `hash`; false if it is not there.
    pub fn remove(&mut self, hash: u64, value: u32) -> bool {
        let Some((bucket, slot, probes)) = self.position(hash, |stored| stored == value) else {
            return false;
        };
        self.buckets[bucket].tags[slot] = EMPTY;
        let mask = self.mask();
        let mut passed = hash as usize & mask;
        for _ in 0..probes {
            let overflow = &mut self.buckets[passed].overflow;
            if *overflow != OVERFLOW_STUCK {
                *overflow -= 1;
            }
            passed = (passed + 1) & mask;
        }
        self.len -= 1;
        true
    }

    /// Drops every value and the bucket array.
    pub fn clear_and_release(&mut self) {
        self.buckets = Vec::new();
        self.len = 0;
        self.long_walk_seen.set(false);
    }

    /// The bucket and slot of the first value `eq` accepts, and how many
    /// full buckets the probe passed before it.
    #[inline]
    fn position(
        &self,
        hash: u64,
        mut eq: impl FnMut(u32) -> bool,
    ) -> Option<(usize, usize, usize)> {
        let mask = self.mask();
        let tag = tag_of(hash);
        let mut at = hash as usize & mask;
        for probes in 0..self.buckets.len() {
            let bucket = &self.buckets[at];
            for slot in slots_of(bucket.matches(tag)) {
                if eq(bucket.values[slot]) {
                    return Some((at, slot, probes));
                }
            }
            if bucket.overflow == 0 {
                return None;
            }
            if probes + 1 == LONG_WALK {
                self.long_walk_seen.set(true);
            }
            at = (at + 1) & mask;
        }
        None
    }

    /// Puts `value` in the first free slot on its probe path, counting it
    /// as overflow on each full bucket it passes; returns how many it
    /// passed.
    fn place(buckets: &mut [Bucket], hash: u64, value: u32) -> usize {
        let mask = buckets.len() - 1;
        let tag = tag_of(hash);
        let mut at = hash as usize & mask;
        // The load limit keeps free slots, so this ends within one lap.
        for probes in 0..buckets.len() {
            let bucket = &mut buckets[at];
            if let Some(slot) = slots_of(bucket.matches(EMPTY)).next() {
                bucket.tags[slot] = tag;
                bucket.values[slot] = value;
                return probes;
            }
            bucket.overflow = bucket.overflow.saturating_add(1);
            at = (at + 1) & mask;
        }
        buckets.len()
    }

    fn grow(&mut self, rehash: impl Fn(u32) -> u64) {
        let count = (self.buckets.len() * 2).max(BUCKETS_MIN);
        let mut buckets = Vec::with_capacity(count);
        super::memory::advise_huge_pages(buckets.as_ptr(), count);
        buckets.resize(count, Bucket::EMPTY);
        for bucket in &self.buckets {
            for slot in 0..SLOTS {
                if bucket.tags[slot] != EMPTY {
                    let value = bucket.values[slot];
                    Self::place(&mut buckets, rehash(value), value);
                }
            }
        }
        self.buckets = buckets;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A deliberately bad hash: many values share a bucket and a tag, so
    /// overflow chains and tag collisions are exercised.
    fn clumped(value: u32) -> u64 {
        u64::from(value % 7) | (u64::from(value % 3) << 57)
    }

    #[test]
    fn bucket_is_one_cache_line() {
        assert_eq!(size_of::<Bucket>(), 64);
        assert_eq!(align_of::<Bucket>(), 64);
    }

    /// Inserts `count` clumped values, removes the even ones, then the
    /// odd ones, checking every lookup on the way.
    fn churn(count: u32) -> KeyIndex {
        let mut index = KeyIndex::new();
        let mut longest = 0;
        for value in 0..count {
            longest = longest.max(index.insert(clumped(value), value, clumped));
        }
        // Seven home buckets for all values: later ones probe far.
        assert!(longest >= count as usize / SLOTS / 2);
        assert_eq!(index.long_walk_seen(), longest >= LONG_WALK);
        assert_eq!(index.len(), count as usize);
        for value in 0..count {
            assert_eq!(index.find(clumped(value), |v| v == value), Some(value));
        }
        for value in (0..count).filter(|v| v % 2 == 0) {
            assert!(index.remove(clumped(value), value));
        }
        assert!(!index.remove(clumped(0), 0));
        for value in 0..count {
            let expected = (value % 2 == 1).then_some(value);
            assert_eq!(index.find(clumped(value), |v| v == value), expected);
        }
        for value in (0..count).filter(|v| v % 2 == 1) {
            assert!(index.remove(clumped(value), value));
        }
        assert!(index.is_empty());
        index
    }

    #[test]
    fn removals_return_overflow_counts_to_zero() {
        let index = churn(300);
        assert!(index.buckets.iter().all(|bucket| bucket.overflow == 0));
    }

    #[test]
    fn stuck_overflow_counts_stay_correct() {
        let index = churn(3000);
        assert!(
            index
                .buckets
                .iter()
                .any(|bucket| bucket.overflow == OVERFLOW_STUCK)
        );
        assert!(
            index
                .buckets
                .iter()
                .all(|bucket| bucket.overflow == 0 || bucket.overflow == OVERFLOW_STUCK)
        );
    }

    #[test]
    fn matches_sees_only_the_twelve_tags() {
        let mut bucket = Bucket::EMPTY;
        bucket.tags[3] = 0x85;
        bucket.tags[11] = 0x85;
        bucket.overflow = 0x85;
        assert_eq!(bucket.matches(0x85), (1 << 3) | (1 << 11));
        assert_eq!(bucket.matches(EMPTY).count_ones(), 10);
    }
}
