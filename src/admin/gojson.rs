//! JSON text exactly as Go's `encoding/json` Encoder writes it, for the hand-rendered bodies
//! (`/snapshot`, `/probe`) whose byte shape clients depend on: HTML-safe string escaping,
//! float32 formatting, RFC 3339 timestamps with trimmed nanoseconds.

/// Go's zero `time.Time` rendered as RFC 3339.
pub const ZERO_TIME: &str = "0001-01-01T00:00:00Z";

/// Appends `s` as a JSON string literal with Go's escaping (`<`, `>`, `&`, U+2028, U+2029
/// escaped; `\b`, `\f`, `\n`, `\r`, `\t` short forms; other control bytes as `\u00XX`).
pub fn push_str(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            '<' | '>' | '&' | '\u{2028}' | '\u{2029}' => {
                out.push_str(&format!("\\u{:04x}", c as u32));
            }
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Appends a float32 as Go renders it (`0`, `0.75`, `1e-7`); NaN/Inf (never stored: ingest
/// sanitises them) render as 0 rather than producing invalid JSON.
pub fn push_f32(out: &mut String, v: f32) {
    match inferencecache_index::policy::go_json_f32(v) {
        Some(t) => out.push_str(&t),
        None => out.push('0'),
    }
}

/// Unix nanoseconds as RFC 3339 in UTC with trailing zeros of the fraction trimmed (Go's
/// `time.RFC3339Nano`); `None` is Go's zero time.
pub fn rfc3339_nano(ns: Option<i64>) -> String {
    let Some(ns) = ns else {
        return ZERO_TIME.to_string();
    };
    let secs = ns.div_euclid(1_000_000_000);
    let frac = ns.rem_euclid(1_000_000_000);
    let (y, mo, d) = crate::sys::civil::civil_from_days(secs.div_euclid(86_400));
    let sod = secs.rem_euclid(86_400);
    let mut out = format!(
        "{y:04}-{mo:02}-{d:02}T{:02}:{:02}:{:02}",
        sod / 3600,
        (sod / 60) % 60,
        sod % 60
    );
    if frac != 0 {
        let digits = format!("{frac:09}");
        out.push('.');
        out.push_str(digits.trim_end_matches('0'));
    }
    out.push('Z');
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strings_escape_like_go() {
        let mut s = String::new();
        push_str(&mut s, "a\"b\\<x>&\n\u{1}\u{2028}é");
        assert_eq!(s, r#""a\"b\\\u003cx\u003e\u0026\n\u0001\u2028é""#);
    }

    #[test]
    fn times() {
        assert_eq!(rfc3339_nano(None), ZERO_TIME);
        assert_eq!(rfc3339_nano(Some(0)), "1970-01-01T00:00:00Z");
        assert_eq!(
            rfc3339_nano(Some(1_700_000_000_123_456_000)),
            "2023-11-14T22:13:20.123456Z"
        );
        assert_eq!(
            rfc3339_nano(Some(951_782_400_000_000_001)),
            "2000-02-29T00:00:00.000000001Z"
        );
        assert_eq!(rfc3339_nano(Some(-1_000_000_000)), "1969-12-31T23:59:59Z");
    }

    #[test]
    fn floats() {
        let mut s = String::new();
        push_f32(&mut s, 0.75);
        s.push(',');
        push_f32(&mut s, 0.0);
        s.push(',');
        push_f32(&mut s, 0.8);
        assert_eq!(s, "0.75,0,0.8");
    }
}
