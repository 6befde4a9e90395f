//! `kunci serve`.

use std::ffi::OsString;

pub fn main(_args: Vec<OsString>) -> u8 {
    eprintln!("kunci serve: not built yet");
    super::exit::USAGE
}
