//! The optional state file (`--state-file`): the last sequence number per publisher whose
//! operations the server has acknowledged, so a restarted subscriber resumes from there (a gap
//! to the engine's next seq is replayed) instead of taking its first batch as a fresh start.
//!
//! Format, one publisher per line: `v1 <topic as hex> <dp_rank or -> <last seq>`. Small,
//! line-oriented and written atomically (temporary file + rename), so a crash mid-write leaves
//! the previous version. Unknown or malformed lines are ignored on load.

use std::collections::HashMap;
use std::io::Write;
use std::path::Path;

use bytes::Bytes;

/// One engine publisher: `(topic, dp_rank)` (docs/KV-EVENTS.md §1).
pub type PublisherKey = (Bytes, Option<i64>);

/// Last acknowledged seq per publisher.
pub type Resume = HashMap<PublisherKey, u64>;

/// Reads the state file; a missing file is an empty state, an unreadable one an error.
pub fn load(path: &Path) -> std::io::Result<Resume> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Resume::new()),
        Err(e) => return Err(e),
    };
    Ok(text.lines().filter_map(parse_line).collect())
}

fn parse_line(line: &str) -> Option<(PublisherKey, u64)> {
    let mut it = line.split(' ');
    if it.next()? != "v1" {
        return None;
    }
    let topic = unhex(it.next()?)?;
    let rank = match it.next()? {
        "-" => None,
        r => Some(r.parse().ok()?),
    };
    let seq = it.next()?.parse().ok()?;
    Some(((topic, rank), seq))
}

fn unhex(s: &str) -> Option<Bytes> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect::<Option<Vec<u8>>>()
        .map(Bytes::from)
}

/// Writes the state atomically (sorted lines, so equal states give equal files).
pub fn save(path: &Path, state: &Resume) -> std::io::Result<()> {
    let mut lines: Vec<String> = state
        .iter()
        .map(|((topic, rank), seq)| {
            let hex: String = topic.iter().map(|b| format!("{b:02x}")).collect();
            let rank = rank.map_or_else(|| "-".to_string(), |r| r.to_string());
            format!("v1 {hex} {rank} {seq}\n")
        })
        .collect();
    lines.sort();
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = std::path::PathBuf::from(tmp);
    {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(lines.concat().as_bytes())?;
        f.sync_all()?;
    }
    std::fs::rename(&tmp, path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_garbage() {
        let dir = std::env::temp_dir().join(format!("kvevent-state-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("state");
        assert!(load(&path).unwrap().is_empty());
        let mut s = Resume::new();
        s.insert((Bytes::from_static(b"kv"), Some(1)), 41);
        s.insert((Bytes::new(), None), u64::MAX - 1);
        save(&path, &s).unwrap();
        assert_eq!(load(&path).unwrap(), s);
        std::fs::write(&path, "v1 6b76 0 7\nv2 x\nv1 zz - 1\nv1 6b76 x 1\n").unwrap();
        let got = load(&path).unwrap();
        assert_eq!(got.len(), 1);
        assert_eq!(got[&(Bytes::from_static(b"kv"), Some(0))], 7);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
