//! A temporary directory for a test. Its own file so that the crate's
//! own etcd tests (src/client/etcd/cluster_tests.rs) can include it with
//! `tests/util/etcd.rs`.

use std::path::PathBuf;
use std::time::Instant;

/// A temporary directory removed when dropped.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(name: &str) -> TempDir {
        let path = std::env::temp_dir().join(format!(
            "kunci-test-{name}-{}-{:?}",
            std::process::id(),
            Instant::now()
        ));
        let path = PathBuf::from(
            path.to_string_lossy()
                .replace([' ', '{', '}', ':', ','], "_"),
        );
        // Private, as a state directory must be (whatever the umask).
        std::os::unix::fs::DirBuilderExt::mode(std::fs::DirBuilder::new().recursive(true), 0o700)
            .create(&path)
            .expect("create temp dir");
        TempDir(path)
    }

    pub fn join(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
