//! Structured logs on stderr: JSON by default, one event name per line in `msg`, as the
//! reference's slog output (`startup`, `graceful_shutdown_started`, ...). Never prompt text.

use std::str::FromStr;

use tracing::Level;
use tracing_subscriber::EnvFilter;
use tracing_subscriber::filter::{Directive, LevelFilter};

/// A `--log-format` or `--log-level` value the server does not know (exit 2).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InvalidLogFlag {
    flag: &'static str,
    value: String,
    want: &'static str,
}

impl std::fmt::Display for InvalidLogFlag {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "invalid {} {:?}: want {}",
            self.flag, self.value, self.want
        )
    }
}

impl std::error::Error for InvalidLogFlag {}

/// Parses `--log-format` (json|text, case-insensitive, empty = json): `true` for JSON.
pub fn parse_format(s: &str) -> Result<bool, InvalidLogFlag> {
    match s.trim().to_ascii_lowercase().as_str() {
        "" | "json" => Ok(true),
        "text" => Ok(false),
        other => Err(InvalidLogFlag {
            flag: "--log-format",
            value: other.to_string(),
            want: "json or text",
        }),
    }
}

/// Parses `--log-level` (debug|info|warn|warning|error, case-insensitive, empty = info).
pub fn parse_level(s: &str) -> Result<Level, InvalidLogFlag> {
    match s.trim().to_ascii_lowercase().as_str() {
        "" | "info" => Ok(Level::INFO),
        "debug" => Ok(Level::DEBUG),
        "warn" | "warning" => Ok(Level::WARN),
        "error" => Ok(Level::ERROR),
        other => Err(InvalidLogFlag {
            flag: "--log-level",
            value: other.to_string(),
            want: "debug, info, warn or error",
        }),
    }
}

/// The target of the events that report the addresses actually bound (`listening_http`,
/// `listening_grpc`).
pub const LISTENING: &str = "listening";

/// Installs the global subscriber. With `always_log_listening` (a bind address asked for port
/// 0), the [`LISTENING`] events are written whatever `level` says: nothing else tells the caller
/// which port it got.
pub fn init(json: bool, level: Level, always_log_listening: bool) {
    let mut filter = EnvFilter::builder()
        .with_default_directive(LevelFilter::from_level(level).into())
        .parse_lossy("");
    if always_log_listening {
        filter = filter.add_directive(
            Directive::from_str(&format!("{LISTENING}=info")).expect("a valid directive"),
        );
    }
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_target(false);
    if json {
        builder
            .json()
            .flatten_event(true)
            .with_current_span(false)
            .init();
    } else {
        builder.init();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_and_levels() {
        assert_eq!(parse_format(" JSON "), Ok(true));
        assert_eq!(parse_format(""), Ok(true));
        assert_eq!(parse_format("Text"), Ok(false));
        assert!(parse_format("xml").is_err());
        assert_eq!(parse_level("WARNING"), Ok(Level::WARN));
        assert_eq!(parse_level(""), Ok(Level::INFO));
        assert!(parse_level("trace").is_err());
    }
}
