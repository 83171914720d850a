//! Parsing the Mooncake trace format: one JSON object per line with `timestamp` (ms),
//! `input_length`, `output_length` and `hash_ids` (512-token prefix block ids).

use serde_json::Value;

/// One request of the trace.
#[derive(Clone, Debug, PartialEq)]
pub struct TraceRequest {
    /// Arrival time in milliseconds from the start of the trace.
    pub timestamp_ms: f64,
    /// Prompt tokens.
    pub input_length: u64,
    /// Generated tokens.
    pub output_length: u64,
    /// The prompt's prefix block ids (512 tokens each); equal ids at the same position share a
    /// prefix.
    pub hash_ids: Vec<u64>,
}

/// Parses a whole trace; blank lines are skipped. The error names the line (1-based).
pub fn parse_trace(text: &str) -> Result<Vec<TraceRequest>, String> {
    text.lines()
        .enumerate()
        .filter(|(_, line)| !line.trim().is_empty())
        .map(|(i, line)| parse_line(line).map_err(|e| format!("trace line {}: {e}", i + 1)))
        .collect()
}

fn parse_line(line: &str) -> Result<TraceRequest, String> {
    let v: Value = serde_json::from_str(line).map_err(|e| e.to_string())?;
    let number = |name: &str| -> Result<f64, String> {
        v.get(name)
            .and_then(Value::as_f64)
            .ok_or_else(|| format!("`{name}` missing or not a number"))
    };
    let ids = v
        .get("hash_ids")
        .and_then(Value::as_array)
        .ok_or("`hash_ids` missing or not an array")?;
    let hash_ids = ids
        .iter()
        .map(|id| id.as_u64().ok_or("`hash_ids` holds a non-integer"))
        .collect::<Result<Vec<u64>, _>>()?;
    Ok(TraceRequest {
        timestamp_ms: number("timestamp")?,
        input_length: number("input_length")? as u64,
        output_length: number("output_length")? as u64,
        hash_ids,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_mooncake_fields_and_names_a_bad_line() {
        let text = "{\"timestamp\": 0, \"input_length\": 600, \"output_length\": 5, \"hash_ids\": [0, 1]}\n\n\
                    {\"timestamp\": 12.5, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": []}\n";
        let reqs = parse_trace(text).unwrap();
        assert_eq!(reqs.len(), 2);
        assert_eq!(reqs[0].hash_ids, vec![0, 1]);
        assert_eq!(reqs[1].timestamp_ms, 12.5);
        let err = parse_trace("{\"timestamp\": 0}\nnot json").unwrap_err();
        assert!(err.starts_with("trace line 1:"), "{err}");
    }
}
