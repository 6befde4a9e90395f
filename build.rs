//! Link options of the `kunci` binary, for its size (issue 28;
//! docs/BENCHMARKS.md, "Binary size"). Only the binary's final link
//! changes: no crate is compiled differently, so the code is the same.

use std::env;
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=CARGO_TARGET_X86_64_UNKNOWN_LINUX_GNU_LINKER");
    let target = env::var("TARGET").unwrap_or_default();
    if !target.ends_with("-linux-gnu") {
        return;
    }
    // The PIE's relative relocations packed as DT_RELR (glibc ≥ 2.36):
    // ~60 KB of `.rela.dyn` become ~1 KB of `.relr.dyn`. Still PIE with
    // full RELRO. lld and GNU ld ≥ 2.38 know the option; an older GNU ld
    // warns and ignores it.
    println!("cargo:rustc-link-arg-bins=-Wl,-z,pack-relative-relocs");
    if unwinds_never() {
        // No unwind tables (`.eh_frame`, ~185 KB, and the landing pads'
        // tables they point to, 7 KB): with `panic = "abort"` nothing unwinds, and in the stripped binary a panic's backtrace
        // has no names anyway; the panic message and its source location
        // are still printed. (`-C force-unwind-tables=no` leaves them under
        // fat LTO: std's code brings its own.) What it costs: debuggers and
        // profilers cannot walk this binary's stack from its own tables.
        let script = std::path::Path::new(&env::var("OUT_DIR").expect("OUT_DIR"))
            .join("discard-unwind-tables.ld");
        std::fs::write(
            &script,
            "SECTIONS { /DISCARD/ : { *(.eh_frame) *(.gcc_except_table .gcc_except_table.*) } }\n\
             INSERT AFTER .text;\n",
        )
        .expect("write the linker script");
        println!("cargo:rustc-link-arg-bins=-Wl,-T,{}", script.display());
    }
    // ring's P-256 table (148 KB) must start on a 4 KB boundary: in the
    // middle of `.rodata` that costs up to 4 KB of zeros before it (3 KB
    // when measured). As its own section just before `.rodata` it starts
    // where `.rodata` would have (page-aligned anyway), and the rest of the
    // read-only data follows it without a gap. Only the layout changes; a
    // build without ring matches nothing and the section is left out.
    let script =
        std::path::Path::new(&env::var("OUT_DIR").expect("OUT_DIR")).join("p256-table-first.ld");
    std::fs::write(
        &script,
        "SECTIONS { .rodata.p256_table : { *(.rodata.ecp_nistz256_precomputed*) } }\n\
         INSERT BEFORE .rodata;\n",
    )
    .expect("write the linker script");
    println!("cargo:rustc-link-arg-bins=-Wl,-T,{}", script.display());
    if links_with_lld(&target) {
        // Identical functions folded into one (generic instances that
        // compile to the same bytes): ~14 KB. Only lld (and gold) have it.
        println!("cargo:rustc-link-arg-bins=-Wl,--icf=all");
    }
}

/// Whether this build never unwinds: the release profile, `panic =
/// "abort"` in Cargo.toml (unless overridden to unwind).
fn unwinds_never() -> bool {
    println!("cargo:rerun-if-env-changed=CARGO_PROFILE_RELEASE_PANIC");
    env::var("PROFILE").as_deref() == Ok("release")
        && env::var("CARGO_PROFILE_RELEASE_PANIC").as_deref() != Ok("unwind")
}

/// Whether rustc links with its own lld: the default for
/// x86_64-unknown-linux-gnu since Rust 1.90, unless a linker is chosen.
fn links_with_lld(target: &str) -> bool {
    if target != "x86_64-unknown-linux-gnu"
        || env::var_os("CARGO_TARGET_X86_64_UNKNOWN_LINUX_GNU_LINKER").is_some()
    {
        return false;
    }
    let flags = env::var("CARGO_ENCODED_RUSTFLAGS").unwrap_or_default();
    if flags.contains("linker") {
        return false;
    }
    let rustc = env::var("RUSTC").unwrap_or_else(|_| "rustc".to_owned());
    let Ok(output) = Command::new(rustc).arg("--version").output() else {
        return false;
    };
    // "rustc 1.95.0 (...)"
    let version = String::from_utf8_lossy(&output.stdout);
    let minor = version
        .split_whitespace()
        .nth(1)
        .and_then(|v| v.split('.').nth(1))
        .and_then(|m| m.parse::<u32>().ok());
    minor.is_some_and(|minor| minor >= 90)
}
