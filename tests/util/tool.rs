//! External tools a test drives: present, skipped outside CI, or a failure under CI.

/// Whether `program`, an external tool a test drives, is on `PATH`. When
/// it is not, the calling test is skipped with a note on stderr naming the
/// tool and its Debian package; under CI (`CI` set, and not to `false` or
/// `0`) the test fails instead, so that CI never passes a test it did not
/// run. A test calls this first and returns at once on `false`.
pub fn require_tool(program: &str, debian_package: &str) -> bool {
    let path = std::env::var_os("PATH").unwrap_or_default();
    let ci = std::env::var("CI").ok();
    require_tool_in(program, debian_package, &path, ci.as_deref())
}

/// [`require_tool`] with the `PATH` and `CI` values given.
fn require_tool_in(
    program: &str,
    debian_package: &str,
    path: &std::ffi::OsStr,
    ci: Option<&str>,
) -> bool {
    use std::os::unix::fs::PermissionsExt as _;
    let found = std::env::split_paths(path).any(|dir| {
        std::fs::metadata(dir.join(program))
            .is_ok_and(|meta| meta.is_file() && meta.permissions().mode() & 0o111 != 0)
    });
    if found {
        return true;
    }
    let missing = format!("`{program}` is not installed (Debian package {debian_package})");
    if ci.is_some_and(|value| !matches!(value, "" | "false" | "0")) {
        panic!("{missing}: under CI=true a missing tool fails the test");
    }
    let test = std::thread::current().name().unwrap_or("a test").to_owned();
    eprintln!("SKIPPED {test}: {missing}");
    false
}

#[test]
fn a_missing_tool_fails_the_test_under_ci_and_skips_it_outside() {
    let path = std::ffi::OsString::from("/nonexistent-kunci-dir");
    for ci in ["true", "1", "yes"] {
        let outcome = std::panic::catch_unwind(|| require_tool_in("sh", "dash", &path, Some(ci)));
        let message = outcome.expect_err("CI with a missing tool must fail");
        let message = message
            .downcast_ref::<String>()
            .expect("a formatted message");
        assert_eq!(
            message,
            "`sh` is not installed (Debian package dash): under CI=true a missing tool fails the test"
        );
    }
    for ci in [None, Some(""), Some("false"), Some("0")] {
        assert!(!require_tool_in("sh", "dash", &path, ci), "{ci:?}");
    }
    let path = std::ffi::OsString::from("/nonexistent-kunci-dir:/bin:/usr/bin");
    assert!(require_tool_in("sh", "dash", &path, Some("true")));
}
