//! Exit codes of client commands (spec §9).

pub const DONE: u8 = 0;
pub const TIMEOUT: u8 = 1;
pub const USAGE: u8 = 2;
pub const BUSY: u8 = 3;
pub const UNAVAILABLE: u8 = 4;
pub const INDETERMINATE: u8 = 5;
pub const NOT_HELD: u8 = 6;
pub const PERMISSION_DENIED: u8 = 7;
