//! One module per request: each is the handler for that request,
//! operating on the core's state (as mini-redis has one file per command).
//! What several handlers share — granting, handing a key on, timers,
//! answers — stays in `core/mod.rs`; restart adoption is `core/adoption.rs`.

mod acquire;
mod extend;
mod holders;
mod info;
mod list;
mod observe;
mod proclaim;
mod query;
mod release;

pub(super) use acquire::Ask;
pub(super) use observe::KeyState;

/// The most bytes of `G`/`W`/`K` frames one `H` or `L` answer carries
/// (spec §4): an answer never takes a connection far past its output
/// high-water mark, so a peer that does not read holds at most this much
/// on top of it. `L` ends its page early (the cursor goes on from there);
/// `H` counts the frames left out in its `Z`. 1,000 `G` and 1,000 `W`
/// without labels (60,000 B) fit.
pub const ANSWER_BYTES_MAX: usize = 64 * 1024;

/// The bytes of a `G`, `W` and `K` frame besides its text (label or key):
/// op, fixed fields and `\n`.
pub(super) const GRANT_FRAME_FIXED: usize = 36;
pub(super) const WAITER_FRAME_FIXED: usize = 24;
pub(super) const KEY_FRAME_FIXED: usize = 20;
