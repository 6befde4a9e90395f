//! Labels (spec §11.1): who is asking, kept with a waiter and then with its
//! grant, never interpreted. Most requests carry none, so they live in one
//! side map, keyed by what they belong to, and cost nothing when empty:
//! no node grows, and without any label no lookup is made.

use std::collections::HashMap;

/// What a label belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LabelOf {
    /// The grant inline in a lock-table entry (a key without a limit).
    Entry(u32),
    /// A grant of a permit key.
    Grant(u32),
    /// A queued waiter.
    Waiter(u32),
}

impl LabelOf {
    /// The side maps' key for `self`.
    pub(super) fn id(self) -> u64 {
        match self {
            LabelOf::Entry(index) => u64::from(index),
            LabelOf::Grant(index) => 1 << 32 | u64::from(index),
            LabelOf::Waiter(index) => 2 << 32 | u64::from(index),
        }
    }
}

/// `label` to keep, or `None` when it is empty (nothing is allocated).
/// The test inline, the copy out of line: the `A` path without a label
/// pays one branch (callgrind_pairs, docs/BENCHMARKS.md).
#[inline(always)]
pub fn owned(label: &str) -> Option<Box<str>> {
    if label.is_empty() {
        None
    } else {
        Some(boxed(label))
    }
}

#[cold]
#[inline(never)]
fn boxed(label: &str) -> Box<str> {
    label.into()
}

#[derive(Default)]
pub struct Labels {
    map: HashMap<u64, Box<str>, foldhash::fast::RandomState>,
}

impl Labels {
    /// Keeps `label` for `of`; an empty label is not stored.
    #[inline]
    pub fn set(&mut self, of: LabelOf, label: &str) {
        if !label.is_empty() {
            self.map.insert(of.id(), label.into());
        }
    }

    /// Moves a label taken with [`take`](Self::take) to `of`.
    #[inline]
    pub fn put(&mut self, of: LabelOf, label: Option<Box<str>>) {
        if let Some(label) = label {
            self.map.insert(of.id(), label);
        }
    }

    /// Removes and returns the label of `of`.
    #[inline]
    pub fn take(&mut self, of: LabelOf) -> Option<Box<str>> {
        if self.map.is_empty() {
            return None;
        }
        self.remove(of)
    }

    #[inline(never)]
    fn remove(&mut self, of: LabelOf) -> Option<Box<str>> {
        let label = self.map.remove(&of.id());
        if self.map.is_empty() && self.map.capacity() > 64 {
            self.map = HashMap::default();
        }
        label
    }

    /// The label of `of`, or "".
    #[inline]
    pub fn get(&self, of: LabelOf) -> &str {
        if self.map.is_empty() {
            return "";
        }
        self.map.get(&of.id()).map_or("", |label| label)
    }

    #[inline]
    pub fn len(&self) -> usize {
        self.map.len()
    }

    #[inline]
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }
}
