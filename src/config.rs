//! Run-time settings: the deadline of every wait across devices, and interrupts.
#![forbid(unsafe_code)]

use crate::error::{Error, Result};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

/// Below XLA's own rendezvous timeout on CPU (40 s, after which it aborts
/// the process), so that a commfuse wait that cannot finish reports its
/// error first.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30);
const TIMEOUT_VAR: &str = "COMMFUSE_TIMEOUT_S";

/// Set from Python by `commfuse.configure(timeout_s=...)`; overrides the variable.
static TIMEOUT_OVERRIDE: Mutex<Option<Duration>> = Mutex::new(None);

/// The deadline of every wait across devices: `configure`'s value, else
/// `COMMFUSE_TIMEOUT_S` as it is when the program runs, else 30 s.
pub fn timeout() -> Result<Duration> {
    if let Some(t) = *crate::sync::lock(&TIMEOUT_OVERRIDE) {
        return Ok(t);
    }
    match std::env::var(TIMEOUT_VAR) {
        Ok(text) => parse_seconds(&text).ok_or_else(|| {
            Error::InvalidArgument(format!("{TIMEOUT_VAR} must be a positive number of seconds, got {text:?}"))
        }),
        Err(_) => Ok(DEFAULT_TIMEOUT),
    }
}

/// `None` clears the override.
pub fn set_timeout(timeout: Option<Duration>) {
    *crate::sync::lock(&TIMEOUT_OVERRIDE) = timeout;
}

/// Interrupts (Ctrl-C) seen so far. A call notes the count when it begins
/// and stops waiting for its peers once it changes; calls begun after an
/// interrupt are not affected by it.
static INTERRUPTS: AtomicU64 = AtomicU64::new(0);

/// Ends every wait across devices under way now (Python's SIGINT handler
/// calls this through `commfuse_interrupt`).
pub fn interrupt() {
    INTERRUPTS.fetch_add(1, Ordering::AcqRel);
}

pub fn interrupts() -> u64 {
    INTERRUPTS.load(Ordering::Acquire)
}

fn parse_seconds(text: &str) -> Option<Duration> {
    let seconds: f64 = text.trim().parse().ok()?;
    (seconds.is_finite() && seconds > 0.0).then(|| Duration::from_secs_f64(seconds))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_positive_seconds_only() {
        assert_eq!(parse_seconds("2.5"), Some(Duration::from_millis(2500)));
        assert_eq!(parse_seconds(" 60 "), Some(Duration::from_secs(60)));
        for bad in ["0", "-1", "abc", "inf", ""] {
            assert_eq!(parse_seconds(bad), None, "{bad}");
        }
    }
}
