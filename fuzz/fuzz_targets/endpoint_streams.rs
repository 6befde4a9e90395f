//! The sans-IO endpoint (connections + core) driven by a script decoded
//! from the input, as the shell drives it: accepts (some refused), reads
//! split anywhere, floods, end-of-file, resets, partial writes, time steps
//! and a shutdown. The script and its checks live in
//! `kunci::core::script`, which a seeded test also runs on stable.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| kunci::core::script::run(data));
