//! The optional state directory (`--state-dir`): what makes a restart safe
//! even after a crash or a clock step.
//!
//! One small file records two promises:
//!
//! - a token **high-water mark**: no token at or above it has been shown to
//!   anyone, so the next run starts there (or at the clock, if higher);
//! - a **lease horizon** (wall-clock ms): no lease this server granted runs
//!   past it, so after an unclean stop the next run treats every key as held
//!   until then.
//!
//! Both are raised *before* any grant that needs them leaves the process
//! (the event loop calls [`StateDir::cover`] before every write), in coarse
//! steps — [`TOKEN_BLOCK`] tokens, [`HORIZON_STEP`] of lease time — so a
//! busy server writes and fsyncs the file about once a minute. A clean
//! shutdown records the exact horizon, or 0 when no lease is outstanding.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Tokens reserved per write of the high-water mark.
pub const TOKEN_BLOCK: u64 = 1 << 26;
/// How far past the latest lease deadline the horizon is pushed per write.
pub const HORIZON_STEP: Duration = Duration::from_secs(60);

const STATE_FILE: &str = "kunci.state";
const LOCK_FILE: &str = "kunci.lock";

/// What the previous run left behind.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Recorded {
    pub token_high_water: u64,
    /// Wall-clock milliseconds; 0 = no lease outstanding.
    pub lease_horizon_ms: u64,
}

/// An open, locked state directory.
pub struct StateDir {
    dir: PathBuf,
    /// Held for its `flock`: one server per directory.
    _lock: File,
    recorded: Recorded,
}

/// Milliseconds since the Unix epoch, by the wall clock.
pub fn wall_clock_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |elapsed| elapsed.as_millis() as u64)
}

impl StateDir {
    /// Opens (creating) `dir`, takes its lock, and reads what the previous
    /// run recorded.
    pub fn open(dir: &Path) -> io::Result<StateDir> {
        fs::create_dir_all(dir)?;
        let lock = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(dir.join(LOCK_FILE))?;
        // SAFETY: flock on a descriptor we own.
        if unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            return Err(io::Error::new(
                io::ErrorKind::WouldBlock,
                format!(
                    "{}: another kunci server uses this state directory",
                    dir.display()
                ),
            ));
        }
        let recorded = match fs::read_to_string(dir.join(STATE_FILE)) {
            Ok(text) => parse(&text).ok_or_else(|| {
                io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("{}: unreadable state file", dir.join(STATE_FILE).display()),
                )
            })?,
            Err(e) if e.kind() == io::ErrorKind::NotFound => Recorded::default(),
            Err(e) => return Err(e),
        };
        Ok(StateDir {
            dir: dir.to_owned(),
            _lock: lock,
            recorded,
        })
    }

    /// What is on disk now.
    pub fn recorded(&self) -> Recorded {
        self.recorded
    }

    /// Makes sure the file covers every token below `next_token` and every
    /// lease ending by `lease_deadline_ms`, writing it if not. Returns
    /// whether it wrote.
    pub fn cover(&mut self, next_token: u64, lease_deadline_ms: u64) -> io::Result<bool> {
        let mut wanted = self.recorded;
        if next_token > wanted.token_high_water {
            wanted.token_high_water = next_token.saturating_add(TOKEN_BLOCK);
        }
        if lease_deadline_ms > wanted.lease_horizon_ms {
            wanted.lease_horizon_ms = lease_deadline_ms + HORIZON_STEP.as_millis() as u64;
        }
        if wanted == self.recorded {
            return Ok(false);
        }
        self.write(wanted)?;
        Ok(true)
    }

    /// Records a clean stop: tokens from `next_token` on were never issued,
    /// and no lease of this run outlives `lease_horizon_ms` (0 = none
    /// outstanding).
    pub fn record_clean_stop(&mut self, next_token: u64, lease_horizon_ms: u64) -> io::Result<()> {
        self.write(Recorded {
            token_high_water: next_token,
            lease_horizon_ms,
        })
    }

    /// Replaces the file atomically and durably: write a temporary file,
    /// fsync it, rename it over the old one, fsync the directory.
    fn write(&mut self, recorded: Recorded) -> io::Result<()> {
        let temporary = self.dir.join(format!("{STATE_FILE}.tmp"));
        let mut file = File::create(&temporary)?;
        writeln!(
            file,
            "kunci-state 1 token_high_water={} lease_horizon_ms={}",
            recorded.token_high_water, recorded.lease_horizon_ms
        )?;
        file.sync_all()?;
        fs::rename(&temporary, self.dir.join(STATE_FILE))?;
        File::open(&self.dir)?.sync_all()?;
        self.recorded = recorded;
        Ok(())
    }
}

fn parse(text: &str) -> Option<Recorded> {
    let mut fields = text.split_whitespace();
    if fields.next()? != "kunci-state" || fields.next()? != "1" {
        return None;
    }
    let mut recorded = Recorded::default();
    for field in fields {
        let (name, value) = field.split_once('=')?;
        let value: u64 = value.parse().ok()?;
        match name {
            "token_high_water" => recorded.token_high_water = value,
            "lease_horizon_ms" => recorded.lease_horizon_ms = value,
            _ => {}
        }
    }
    Some(recorded)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cover_writes_in_coarse_steps_and_survives_reopen() {
        let dir = std::env::temp_dir().join(format!("kunci-state-unit-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        {
            let mut state = StateDir::open(&dir).unwrap();
            assert_eq!(state.recorded(), Recorded::default());
            assert!(state.cover(100, 5_000).unwrap());
            assert_eq!(state.recorded().token_high_water, 100 + TOKEN_BLOCK);
            assert_eq!(state.recorded().lease_horizon_ms, 65_000);
            // Inside the block and the step: no write.
            assert!(!state.cover(100 + TOKEN_BLOCK, 65_000).unwrap());
            assert!(state.cover(101 + TOKEN_BLOCK, 65_000).unwrap());
            assert!(StateDir::open(&dir).is_err(), "second server got the lock");
        }
        let mut state = StateDir::open(&dir).unwrap();
        assert_eq!(state.recorded().lease_horizon_ms, 65_000);
        state.record_clean_stop(7, 0).unwrap();
        drop(state);
        let state = StateDir::open(&dir).unwrap();
        assert_eq!(
            state.recorded(),
            Recorded {
                token_high_water: 7,
                lease_horizon_ms: 0
            }
        );
        let _ = fs::remove_dir_all(&dir);
    }
}
