//! The errors of the `loadgen` subcommands. Their `Display` texts are what the binary prints
//! after `loadgen: `, so each names the flag or the address at fault.

use std::fmt;
use std::path::PathBuf;

/// A flag value, or a combination of flags, that cannot give a meaningful run.
#[derive(Clone, Debug, PartialEq)]
pub enum ConfigError {
    /// The flag must be a number above zero.
    NotPositive(&'static str),
    /// The flag must be finite and not negative.
    Negative(&'static str),
    /// The flag must lie within `range` (as printed).
    OutOfRange {
        /// The flag.
        flag: &'static str,
        /// The allowed range, e.g. `0..=1`.
        range: &'static str,
    },
    /// A `--budget-ms` value that is not a positive number.
    Budget(f64),
    /// A rule across flags, or a bound of one flag, stated in full.
    Rule(&'static str),
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ConfigError::NotPositive(flag) => write!(f, "{flag} must be > 0"),
            ConfigError::Negative(flag) => write!(f, "{flag} must be a finite value >= 0"),
            ConfigError::OutOfRange { flag, range } => write!(f, "{flag} must be within {range}"),
            ConfigError::Budget(b) => write!(f, "--budget-ms {b}: must be a positive number"),
            ConfigError::Rule(text) => f.write_str(text),
        }
    }
}

impl std::error::Error for ConfigError {}

/// Why a subcommand could not run or did not complete.
#[derive(Debug)]
pub enum Error {
    /// Invalid flags.
    Config(ConfigError),
    /// `--addr` is not a valid endpoint URI.
    InvalidAddr {
        /// The normalised address.
        addr: String,
        /// The parse failure.
        source: tonic::transport::Error,
    },
    /// A connection to the server could not be opened.
    Connect {
        /// The normalised address.
        addr: String,
        /// The transport failure.
        source: tonic::transport::Error,
    },
    /// The shard-aware connections could not be opened.
    ShardAware(inferencecache_gateway::ConnectError),
    /// A lean lookup connection (`--lookup-client lean`) could not be opened.
    LeanConnect {
        /// The normalised address.
        addr: String,
        /// The failure.
        source: tonic::Status,
    },
    /// The JSON report could not be written.
    WriteReport {
        /// The `--json` path.
        path: PathBuf,
        /// The I/O failure.
        source: std::io::Error,
    },
    /// `preload`: this many ReportCacheState streams failed, so the population is incomplete.
    StreamsFailed(u64),
    /// A trace replay could not run, or did not complete with every answer right.
    Trace(String),
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Config(e) => e.fmt(f),
            Error::InvalidAddr { addr, source } => write!(f, "invalid --addr {addr}: {source}"),
            Error::Connect { addr, source } => write!(f, "cannot connect to {addr}: {source}"),
            Error::ShardAware(e) => write!(f, "--shard-aware-addr: {e}"),
            Error::LeanConnect { addr, source } => {
                write!(f, "cannot connect to {addr}: {}", source.message())
            }
            Error::WriteReport { path, source } => {
                write!(f, "cannot write {}: {source}", path.display())
            }
            Error::StreamsFailed(n) => write!(f, "{n} ReportCacheState streams failed"),
            Error::Trace(why) => write!(f, "trace replay: {why}"),
        }
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Error::Config(e) => Some(e),
            Error::InvalidAddr { source, .. } | Error::Connect { source, .. } => Some(source),
            Error::WriteReport { source, .. } => Some(source),
            Error::ShardAware(e) => Some(e),
            Error::LeanConnect { source, .. } => Some(source),
            Error::StreamsFailed(_) | Error::Trace(_) => None,
        }
    }
}

impl From<ConfigError> for Error {
    fn from(e: ConfigError) -> Self {
        Error::Config(e)
    }
}
