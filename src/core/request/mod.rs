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
mod query;
mod release;

pub(super) use acquire::Ask;
