//! Run-time settings: the deadline of every wait across devices, interrupts,
//! and how GPU ranks of one process exchange data.
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
    setting(&TIMEOUT_OVERRIDE, TIMEOUT_VAR, parse_seconds, "a positive number of seconds", DEFAULT_TIMEOUT)
}

/// A setting: `overridden`'s value (set from Python), else the variable
/// `var` as it is now, parsed by `parse` (an error saying it must be
/// `expected`), else `default`.
fn setting<T: Copy>(
    overridden: &Mutex<Option<T>>,
    var: &str,
    parse: fn(&str) -> Option<T>,
    expected: &str,
    default: T,
) -> Result<T> {
    if let Some(v) = *crate::sync::lock(overridden) {
        return Ok(v);
    }
    match std::env::var(var) {
        Ok(text) => {
            parse(&text).ok_or_else(|| Error::InvalidArgument(format!("{var} must be {expected}, got {text:?}")))
        }
        Err(_) => Ok(default),
    }
}

/// `None` clears the override.
pub fn set_timeout(timeout: Option<Duration>) {
    *crate::sync::lock(&TIMEOUT_OVERRIDE) = timeout;
}

/// How a group's transfers go on GPUs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transport {
    /// Copy engines where every rank is a device of this process and each
    /// pair can reach the other's memory, else NCCL.
    Auto,
    /// Copy engines (`backend::cuda::copies`); refused where they cannot serve.
    Copies,
    /// NCCL send/receive.
    Nccl,
}

impl Transport {
    pub const NAMES: [(&'static str, Transport); 3] =
        [("auto", Transport::Auto), ("copies", Transport::Copies), ("nccl", Transport::Nccl)];

    pub fn parse(text: &str) -> Option<Transport> {
        Self::NAMES.iter().find(|(n, _)| *n == text.trim()).map(|&(_, t)| t)
    }
}

const TRANSPORT_VAR: &str = "COMMFUSE_TRANSPORT";

/// Set from Python by `commfuse.configure(transport=...)`; overrides the variable.
static TRANSPORT_OVERRIDE: Mutex<Option<Transport>> = Mutex::new(None);

/// The GPU transport: `configure`'s, else `COMMFUSE_TRANSPORT` as it is when
/// the program runs (`auto`, `copies` or `nccl`), else `auto`.
pub fn transport() -> Result<Transport> {
    setting(&TRANSPORT_OVERRIDE, TRANSPORT_VAR, Transport::parse, "auto, copies or nccl", Transport::Auto)
}

/// `None` clears the override.
pub fn set_transport(transport: Option<Transport>) {
    *crate::sync::lock(&TRANSPORT_OVERRIDE) = transport;
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
    fn transports_parse_by_name_only() {
        assert_eq!(Transport::parse("copies"), Some(Transport::Copies));
        assert_eq!(Transport::parse(" nccl "), Some(Transport::Nccl));
        assert_eq!(Transport::parse("auto"), Some(Transport::Auto));
        for bad in ["", "NCCL", "copy", "p2p"] {
            assert_eq!(Transport::parse(bad), None, "{bad}");
        }
    }

    #[test]
    fn parses_positive_seconds_only() {
        assert_eq!(parse_seconds("2.5"), Some(Duration::from_millis(2500)));
        assert_eq!(parse_seconds(" 60 "), Some(Duration::from_secs(60)));
        for bad in ["0", "-1", "abc", "inf", ""] {
            assert_eq!(parse_seconds(bad), None, "{bad}");
        }
    }
}
