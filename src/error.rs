//! The one error type of the library, mapped to XLA FFI error codes at the edge.

use std::fmt;

/// Every failure a handler can report. The variant decides the XLA error code.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Error {
    /// Bad operands or attributes: the message names the argument and what was expected.
    InvalidArgument(String),
    /// A library or feature that is not available in this build or on this machine.
    Unimplemented(String),
    /// A wait across devices passed its deadline.
    DeadlineExceeded(String),
    /// A driver or internal failure (with the raw code where there is one).
    Internal(String),
    /// The process was interrupted (Ctrl-C) while the call waited.
    Interrupted(String),
}

pub type Result<T> = std::result::Result<T, Error>;

/// A duration as messages say it: seconds to a tenth, milliseconds below a
/// second (a deadline of a few milliseconds is not "0.0 s").
pub fn duration_text(seconds: f64) -> String {
    if seconds >= 1.0 {
        format!("{seconds:.1} s")
    } else {
        format!("{:.1} ms", seconds * 1e3)
    }
}

impl Error {
    /// The same kind of error with `prefix` before its message (a peer's
    /// error as another rank reports it).
    pub fn prefixed(&self, prefix: &str) -> Error {
        let m = format!("{prefix}{}", self.message());
        match self {
            Error::InvalidArgument(_) => Error::InvalidArgument(m),
            Error::Unimplemented(_) => Error::Unimplemented(m),
            Error::DeadlineExceeded(_) => Error::DeadlineExceeded(m),
            Error::Interrupted(_) => Error::Interrupted(m),
            Error::Internal(_) => Error::Internal(m),
        }
    }

    pub fn message(&self) -> &str {
        match self {
            Error::InvalidArgument(m)
            | Error::Unimplemented(m)
            | Error::DeadlineExceeded(m)
            | Error::Internal(m)
            | Error::Interrupted(m) => m,
        }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match self {
            Error::InvalidArgument(_) => "invalid argument",
            Error::Unimplemented(_) => "unimplemented",
            Error::DeadlineExceeded(_) => "deadline exceeded",
            Error::Internal(_) => "internal error",
            Error::Interrupted(_) => "interrupted",
        };
        write!(f, "commfuse: {kind}: {}", self.message())
    }
}

impl std::error::Error for Error {}

/// `bail!(InvalidArgument, "x must be ...")` returns early with that error.
#[macro_export]
macro_rules! bail {
    ($kind:ident, $($fmt:tt)+) => {
        return Err($crate::error::Error::$kind(format!($($fmt)+)))
    };
}

#[cfg(test)]
mod tests {
    use super::duration_text;

    #[test]
    fn durations_read_in_seconds_or_milliseconds() {
        assert_eq!(duration_text(30.0), "30.0 s");
        assert_eq!(duration_text(1.0), "1.0 s");
        assert_eq!(duration_text(0.2), "200.0 ms");
        assert_eq!(duration_text(0.001), "1.0 ms");
    }
}
