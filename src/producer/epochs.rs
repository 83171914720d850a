//! Producer fencing (docs/BEHAVIOUR.md §4.3): the newest producer epoch seen per
//! `(tenant, replica)`. A producer sends `x-producer-epoch: <start unix ms>-<random id>` on every
//! ingest call; a message whose epoch is older than the newest one recorded for its replica is
//! refused (`FENCED`), so a zombie sidecar cannot re-add what the live one's engine evicted.
//!
//! The table is process-wide (a replica's messages reach several cores when it serves several
//! models), bounded by [`MAX_PRODUCER_EPOCHS`], keyed by a 128-bit hash of the names and part
//! of the `--state-dir` snapshot, so fencing survives a restart.

use std::collections::HashMap;
use std::sync::{LazyLock, Mutex};

use xxhash_rust::xxh3::{xxh3_64, xxh3_128};

use crate::limits::{MAX_PRODUCER_EPOCH_ID_BYTES, MAX_PRODUCER_EPOCHS};

/// The call metadata key carrying a producer's epoch.
pub const EPOCH_HEADER: &str = "x-producer-epoch";

/// A producer epoch: its start time, then (between producers started in the same millisecond)
/// the hash of its random id. Larger is newer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Epoch {
    /// Producer start, Unix milliseconds.
    pub ms: u64,
    /// XXH3-64 of the random id.
    pub id: u64,
}

/// Parses `<unix ms>-<id>`: decimal milliseconds, then 1 to [`MAX_PRODUCER_EPOCH_ID_BYTES`]
/// ASCII letters, digits, `-` or `_`.
pub fn parse(v: &str) -> Result<Epoch, &'static str> {
    let (ms, id) = v.split_once('-').ok_or("expected <unix ms>-<random id>")?;
    let ms: u64 = ms
        .parse()
        .map_err(|_| "the start time is not decimal milliseconds")?;
    let id_ok = (1..=MAX_PRODUCER_EPOCH_ID_BYTES).contains(&id.len())
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
    if !id_ok {
        return Err("the random id must be 1-64 letters, digits, '-' or '_'");
    }
    Ok(Epoch {
        ms,
        id: xxh3_64(id.as_bytes()),
    })
}

/// The table key of `(tenant, replica)`.
fn key(tenant: &str, replica: &str) -> u128 {
    let mut buf = Vec::with_capacity(tenant.len() + replica.len() + 1);
    buf.extend_from_slice(tenant.as_bytes());
    buf.push(0xff); // never inside UTF-8, so the split is unambiguous
    buf.extend_from_slice(replica.as_bytes());
    xxh3_128(&buf)
}

static TABLE: LazyLock<Mutex<HashMap<u128, Epoch>>> = LazyLock::new(Mutex::default);

fn table() -> std::sync::MutexGuard<'static, HashMap<u128, Epoch>> {
    TABLE.lock().unwrap_or_else(|e| e.into_inner())
}

/// Admits a message of `(tenant, replica)` sent under `epoch`: `Err` when a newer epoch was
/// seen for that replica. A newer epoch replaces the recorded one; a replica not yet recorded
/// is recorded while the table has room (else admitted unfenced and counted).
pub fn admit(tenant: &str, replica: &str, epoch: Epoch) -> Result<(), ()> {
    let k = key(tenant, replica);
    let mut t = table();
    let len = t.len();
    match t.get_mut(&k) {
        Some(newest) if epoch < *newest => Err(()),
        Some(newest) => {
            *newest = epoch;
            Ok(())
        }
        None if len >= MAX_PRODUCER_EPOCHS => {
            crate::metrics::record_limit_hit("producer_epochs");
            Ok(())
        }
        None => {
            t.insert(k, epoch);
            crate::metrics::producer::set_epochs(t.len());
            Ok(())
        }
    }
}

/// The newest epoch per `(tenant, replica)` this process published to the event log as its
/// writer and JetStream stored (`--nats-log-writer`), not yet necessarily applied: a message the
/// log holds is applied by every replica in stream order, so an older epoch arriving after it is
/// fenced by all of them, and the writer refuses it before it reaches the log. Apart from
/// [`TABLE`], which only the log's consumer moves (so every replica's stays alike).
static PUBLISHED: LazyLock<Mutex<HashMap<u128, Epoch>>> = LazyLock::new(Mutex::default);

/// Whether [`admit`] would admit `epoch` for `(tenant, replica)` now, without recording it: the
/// log writer's check before it publishes (the log's consumers record it, in stream order),
/// against what was applied and what this writer already had stored ([`note_published`]).
pub fn would_admit(tenant: &str, replica: &str, epoch: Epoch) -> bool {
    let k = key(tenant, replica);
    let not_older = |t: &HashMap<u128, Epoch>| t.get(&k).is_none_or(|newest| epoch >= *newest);
    not_older(&table()) && not_older(&PUBLISHED.lock().unwrap_or_else(|e| e.into_inner()))
}

/// Records that a message of `(tenant, replica)` under `epoch` is stored in the event log (its
/// writer's publish was acknowledged), for [`would_admit`]. At most [`MAX_PRODUCER_EPOCHS`]
/// replicas; past that a replica is not recorded here (its consumers still fence in order).
pub fn note_published(tenant: &str, replica: &str, epoch: Epoch) {
    let k = key(tenant, replica);
    let mut t = PUBLISHED.lock().unwrap_or_else(|e| e.into_inner());
    let len = t.len();
    match t.get_mut(&k) {
        Some(newest) => *newest = (*newest).max(epoch),
        None if len >= MAX_PRODUCER_EPOCHS => crate::metrics::record_limit_hit("producer_epochs"),
        None => {
            t.insert(k, epoch);
        }
    }
}

/// One table row: (replica key, start ms, id hash).
pub type Row = (u128, u64, u64);

/// The whole table, for a snapshot.
pub fn rows() -> Vec<Row> {
    table().iter().map(|(k, e)| (*k, e.ms, e.id)).collect()
}

/// Restores snapshot rows (start-up, before serving); at most [`MAX_PRODUCER_EPOCHS`], newer
/// epochs win over ones already present.
pub fn restore(rows: impl IntoIterator<Item = Row>) -> usize {
    let mut t = table();
    let mut n = 0;
    for (k, ms, id) in rows {
        if t.len() >= MAX_PRODUCER_EPOCHS && !t.contains_key(&k) {
            break;
        }
        let e = Epoch { ms, id };
        let slot = t.entry(k).or_insert(e);
        *slot = (*slot).max(e);
        n += 1;
    }
    crate::metrics::producer::set_epochs(t.len());
    n
}

/// Encodes rows as a snapshot section body: count × (key u128 | ms u64 | id u64), little-endian.
pub fn encode(rows: &[Row]) -> Vec<u8> {
    let mut out = Vec::with_capacity(rows.len() * 32);
    for (k, ms, id) in rows {
        out.extend_from_slice(&k.to_le_bytes());
        out.extend_from_slice(&ms.to_le_bytes());
        out.extend_from_slice(&id.to_le_bytes());
    }
    out
}

/// Decodes [`encode`]'s body; `None` when its length is not a whole number of rows.
pub fn decode(body: &[u8]) -> Option<Vec<Row>> {
    if !body.len().is_multiple_of(32) {
        return None;
    }
    let row = |c: &[u8]| {
        let k = u128::from_le_bytes(c[0..16].try_into().expect("16 bytes"));
        let ms = u64::from_le_bytes(c[16..24].try_into().expect("8 bytes"));
        let id = u64::from_le_bytes(c[24..32].try_into().expect("8 bytes"));
        (k, ms, id)
    };
    Some(body.chunks_exact(32).map(row).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_rules() {
        let e = parse("1700000000000-abc123").unwrap();
        assert_eq!(e.ms, 1_700_000_000_000);
        assert_eq!(e.id, xxh3_64(b"abc123"));
        assert_eq!(parse("1-a-b").unwrap().id, xxh3_64(b"a-b"));
        for bad in [
            "",
            "123",
            "x-abc",
            "12-",
            "-abc",
            "12-a b",
            &format!("1-{}", "a".repeat(65)),
        ] {
            assert!(parse(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn would_admit_checks_without_recording() {
        let old = Epoch { ms: 10, id: 5 };
        let new = Epoch { ms: 11, id: 1 };
        assert!(would_admit("peek-t", "r", new), "an unknown replica");
        assert!(would_admit("peek-t", "r", old), "nothing was recorded");
        assert!(admit("peek-t", "r", new).is_ok());
        assert!(would_admit("peek-t", "r", new), "the same epoch again");
        assert!(!would_admit("peek-t", "r", old), "older after newer");
        assert!(admit("peek-t", "r", old).is_err());
    }

    /// A writer refuses an epoch older than one it already had stored in the log, before its own
    /// consumer applied that one; the applied table is not moved by it.
    #[test]
    fn an_epoch_older_than_one_published_is_refused_before_it_is_applied() {
        let old = Epoch { ms: 1_000, id: 1 };
        let new = Epoch { ms: 2_000, id: 2 };
        assert!(would_admit("pub-t", "r", old));
        note_published("pub-t", "r", new);
        assert!(
            !would_admit("pub-t", "r", old),
            "older than what the log holds"
        );
        assert!(would_admit("pub-t", "r", new));
        assert!(
            admit("pub-t", "r", old).is_ok(),
            "the applied table did not move"
        );
    }

    #[test]
    fn newer_wins_older_is_fenced_and_rows_round_trip() {
        let old = Epoch { ms: 10, id: 5 };
        let new = Epoch { ms: 11, id: 1 };
        assert!(admit("fence-t", "r", old).is_ok());
        assert!(admit("fence-t", "r", old).is_ok(), "the same epoch again");
        assert!(admit("fence-t", "r", new).is_ok());
        assert!(admit("fence-t", "r", old).is_err(), "older after newer");
        assert!(admit("fence-t", "other", old).is_ok(), "per replica");
        assert!(admit("fence-u", "r", old).is_ok(), "per tenant");
        let rows = rows();
        assert_eq!(decode(&encode(&rows)).unwrap(), rows);
        assert!(decode(&[0u8; 31]).is_none());
        assert_ne!(key("ab", "c"), key("a", "bc"));
    }
}
