//! The start-up restore: runs before the runtime starts (so before `/readyz` can turn 200), on
//! the start-up thread, into the cores' states that the runtime then installs. Whatever goes
//! wrong with the files is logged in one line and the server starts empty: a half-restored
//! index is never served.

use std::io::BufReader;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use inferencecache_index::index::{RestoreCache, RestoreOutcome};
use inferencecache_index::policy::{PolicyStore, parse_policy_body};

use super::format::{Decoder, FileKind, FormatError, SectionKind};
use super::{MANIFEST_FILE, POLICY_FILE, PRODUCERS_FILE, core_file};
use crate::limits::{MAX_POLICY_BODY_BYTES, MAX_SNAPSHOT_FILE_BYTES};
use crate::metrics::snapshot as m;
use crate::shard::{self, CoreState};
use crate::sys::clock::unix_now_ns;

/// The outcome of the restore.
pub struct Restored {
    /// One state per core, restored or empty.
    pub states: Vec<CoreState>,
    /// The generation the next snapshot writes.
    pub next_generation: u64,
    /// The last event-log sequence the restored snapshot includes (0: none restored); the
    /// consumer resumes after it.
    pub stream_sequence: u64,
}

/// Why the snapshot was skipped.
struct Skip {
    reason: &'static str,
    file: String,
    detail: String,
}

impl Skip {
    fn format(file: &str, e: FormatError) -> Skip {
        Skip {
            reason: e.reason(),
            file: file.to_string(),
            detail: e.to_string(),
        }
    }
    fn mismatch(file: &str, detail: &str) -> Skip {
        Skip {
            reason: "mismatch",
            file: file.to_string(),
            detail: detail.to_string(),
        }
    }
}

/// Counts of one restore.
#[derive(Default)]
struct Counts {
    entries: u64,
    expired: u64,
    refused: u64,
    stats: u64,
    bytes: u64,
}

/// Opens `dir/name` with its size checked: `None` when it does not exist.
fn open(dir: &Path, name: &str, max: u64) -> Result<Option<(BufReader<std::fs::File>, u64)>, Skip> {
    let file = match std::fs::File::open(dir.join(name)) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(Skip::format(name, e.into())),
    };
    let len = file
        .metadata()
        .map_err(|e| Skip::format(name, e.into()))?
        .len();
    if len > max {
        return Err(Skip::format(name, FormatError::TooLarge));
    }
    Ok(Some((BufReader::with_capacity(1 << 20, file), len)))
}

/// Reads the policy file, if any.
fn read_policy(dir: &Path) -> Result<Option<(PolicyStore, u64)>, Skip> {
    let max = (MAX_POLICY_BODY_BYTES + 4096) as u64;
    let Some((r, len)) = open(dir, POLICY_FILE, max)? else {
        return Ok(None);
    };
    let err = |e| Skip::format(POLICY_FILE, e);
    let (mut d, header) = Decoder::open(r, max).map_err(err)?;
    if header.kind != FileKind::Policy {
        return Err(Skip::mismatch(POLICY_FILE, "not a policy file"));
    }
    let body = match d.next_section().map_err(err)? {
        Some(s) if s.kind == SectionKind::Policy => s.body.to_vec(),
        _ => return Err(err(FormatError::Corrupt("no policy section"))),
    };
    if d.next_section().map_err(err)?.is_some() {
        return Err(err(FormatError::Corrupt("extra section")));
    }
    // The body was accepted when it was installed; one this build refuses (a version it no
    // longer reads) is incompatible.
    let store = parse_policy_body(&body).map_err(|e| Skip {
        reason: "incompatible",
        file: POLICY_FILE.into(),
        detail: e.to_string(),
    })?;
    Ok(Some((store, len)))
}

/// Restores the producer epoch table, if the snapshot has one (an older snapshot has none: the
/// table starts empty). Independent of the index restore: a bad file is logged and skipped.
fn restore_producers(dir: &Path) {
    let max = (crate::limits::MAX_PRODUCER_EPOCHS * 32 + 4096) as u64;
    let read = || -> Result<Option<Vec<crate::producer::epochs::Row>>, Skip> {
        let Some((r, _)) = open(dir, PRODUCERS_FILE, max)? else {
            return Ok(None);
        };
        let err = |e| Skip::format(PRODUCERS_FILE, e);
        let (mut d, header) = Decoder::open(r, max).map_err(err)?;
        if header.kind != FileKind::Producers {
            return Err(Skip::mismatch(PRODUCERS_FILE, "not a producers file"));
        }
        match d.next_section().map_err(err)? {
            Some(s) if s.kind == SectionKind::Epochs => crate::producer::epochs::decode(s.body)
                .map(Some)
                .ok_or_else(|| err(FormatError::Corrupt("epoch rows"))),
            _ => Err(err(FormatError::Corrupt("no epochs section"))),
        }
    };
    match read() {
        Ok(Some(rows)) => {
            let n = crate::producer::epochs::restore(rows);
            tracing::info!(epochs = n, "snapshot_producers_restored");
        }
        Ok(None) => {}
        Err(skip) => tracing::error!(
            file = %skip.file,
            reason = skip.reason,
            detail = %skip.detail,
            "snapshot_producers_skipped"
        ),
    }
}

/// The manifest's generation, writer core count, creation time, `(core, len, xxh3)` rows and
/// the stream sequence the snapshot includes.
type Manifest = (u64, usize, i64, Vec<(u32, u64, u64)>, u64);

fn read_manifest(dir: &Path) -> Result<Option<(Manifest, u64)>, Skip> {
    let max = 1 << 20;
    let Some((r, len)) = open(dir, MANIFEST_FILE, max)? else {
        return Ok(None);
    };
    let err = |e| Skip::format(MANIFEST_FILE, e);
    let (mut d, header) = Decoder::open(r, max).map_err(err)?;
    if header.kind != FileKind::Manifest {
        return Err(Skip::mismatch(MANIFEST_FILE, "not a manifest"));
    }
    let (rows, stream_sequence) = match d.next_section().map_err(err)? {
        Some(s) if s.kind == SectionKind::Manifest => s.manifest().map_err(err)?,
        _ => return Err(err(FormatError::Corrupt("no manifest section"))),
    };
    if d.next_section().map_err(err)?.is_some() {
        return Err(err(FormatError::Corrupt("extra section")));
    }
    let cores = header.cores as usize;
    let in_order = rows.iter().enumerate().all(|(i, r)| r.0 as usize == i);
    if cores == 0 || cores > crate::limits::MAX_SHARDS || rows.len() != cores || !in_order {
        return Err(Skip::mismatch(
            MANIFEST_FILE,
            "file list does not match its core count",
        ));
    }
    Ok(Some((
        (
            header.generation,
            cores,
            header.created_unix_ns,
            rows,
            stream_sequence,
        ),
        len,
    )))
}

/// Restores one core file into `states`, routing each record by the partition function.
fn restore_file(
    dir: &Path,
    manifest: &Manifest,
    row: (u32, u64, u64),
    states: &mut [CoreState],
    now: i64,
    counts: &mut Counts,
) -> Result<(), Skip> {
    let (generation, cores, _, _, _) = manifest;
    let (core, want_len, want_sum) = row;
    let name = core_file(core as usize, *generation);
    let Some((r, len)) = open(dir, &name, MAX_SNAPSHOT_FILE_BYTES)? else {
        return Err(Skip {
            reason: "missing",
            file: name,
            detail: "named by the manifest but absent".into(),
        });
    };
    if len < want_len {
        return Err(Skip::format(&name, FormatError::Truncated));
    }
    if len > want_len {
        return Err(Skip::format(
            &name,
            FormatError::Corrupt("longer than the manifest says"),
        ));
    }
    let err = |e| Skip::format(&name, e);
    let (mut d, header) = Decoder::open(r, want_len).map_err(err)?;
    if header.kind != FileKind::Core
        || header.generation != *generation
        || header.core != core
        || header.cores as usize != *cores
    {
        return Err(Skip::mismatch(&name, "header does not match the manifest"));
    }
    let n = states.len();
    let target = move |tenant: &str, model: &str| {
        shard::owner_of_partition(shard::partition(tenant, model), n)
    };
    let max_entries = states[0].index.config().max_entries;
    let mut caches: Vec<RestoreCache> = (0..n).map(|_| RestoreCache::default()).collect();
    while let Some(section) = d.next_section().map_err(err)? {
        match section.kind {
            SectionKind::Stats => section
                .stats(|r| {
                    let st = &mut states[target(r.tenant, r.model)];
                    match st.index.restore_stats(r, now, &*st.policy) {
                        RestoreOutcome::Restored => counts.stats += 1,
                        RestoreOutcome::Expired | RestoreOutcome::Refused => {}
                    }
                })
                .map_err(err)?,
            SectionKind::Entries => section
                .entries(|e| {
                    let core = target(e.tenant, e.model);
                    let st = &mut states[core];
                    let full = max_entries > 0
                        && st.index.directory().non_reserved_entries() as u64 >= max_entries;
                    if full {
                        counts.refused += 1;
                        return;
                    }
                    match st
                        .index
                        .restore_entry(e, now, &*st.policy, &mut caches[core])
                    {
                        RestoreOutcome::Restored => counts.entries += 1,
                        RestoreOutcome::Expired => counts.expired += 1,
                        RestoreOutcome::Refused => counts.refused += 1,
                    }
                })
                .map_err(err)?,
            _ => return Err(err(FormatError::Corrupt("unexpected section"))),
        }
    }
    if d.digest() != (want_len, want_sum) {
        return Err(err(FormatError::Corrupt(
            "file checksum does not match the manifest",
        )));
    }
    counts.bytes += len;
    Ok(())
}

/// Restores the snapshot under `dir` into `cores` fresh states made by `fresh` (a fresh call
/// also makes a fresh shared directory, so a skipped restore leaves no count behind).
pub fn restore(dir: &Path, cores: usize, fresh: &dyn Fn() -> Vec<CoreState>) -> Restored {
    let started = Instant::now();
    if let Some(d) = crate::sys::test_hooks::restore_delay() {
        std::thread::sleep(d);
    }
    let now = unix_now_ns();
    let mut states = fresh();
    debug_assert_eq!(states.len(), cores);
    let mut counts = Counts::default();
    restore_producers(dir);
    let result = (|| -> Result<Option<(Manifest, u64)>, Skip> {
        // The policy first: the TTL filter (and later the eviction order) depends on it.
        if let Some((policy, len)) = read_policy(dir)? {
            let policy = Arc::new(policy);
            for st in states.iter_mut() {
                st.set_policy(policy.clone());
            }
            counts.bytes += len;
        }
        let Some((manifest, len)) = read_manifest(dir)? else {
            return Ok(None);
        };
        counts.bytes += len;
        for row in manifest.3.clone() {
            restore_file(dir, &manifest, row, &mut states, now, &mut counts)?;
        }
        Ok(Some((manifest, len)))
    })();
    let took = started.elapsed();
    match result {
        Ok(Some((manifest, _))) => {
            for st in states.iter_mut() {
                st.index.restore_finish();
            }
            let (generation, written_by, created, _, stream_sequence) = manifest;
            m::record_snapshot_found(created, counts.bytes, counts.entries);
            m::record_restore(counts.entries, took.as_micros() as u64);
            tracing::info!(
                generation,
                snapshot_shards = written_by,
                shards = cores,
                entries = counts.entries,
                stats_rows = counts.stats,
                expired = counts.expired,
                refused = counts.refused,
                bytes = counts.bytes,
                duration_ms = took.as_millis() as u64,
                stream_sequence,
                "snapshot_restored"
            );
            Restored {
                states,
                next_generation: generation + 1,
                stream_sequence,
            }
        }
        Ok(None) => {
            for st in states.iter_mut() {
                st.index.restore_finish();
            }
            m::record_restore_skipped("missing");
            m::record_restore(0, took.as_micros() as u64);
            tracing::info!(file = MANIFEST_FILE, "snapshot_not_found_starting_empty");
            Restored {
                states,
                next_generation: 1,
                stream_sequence: 0,
            }
        }
        Err(skip) => {
            m::record_restore_skipped(skip.reason);
            m::record_restore(0, took.as_micros() as u64);
            tracing::error!(
                reason = skip.reason,
                file = %skip.file,
                error = %skip.detail,
                "snapshot_restore_skipped_starting_empty"
            );
            drop(states);
            Restored {
                states: fresh(),
                next_generation: 1,
                stream_sequence: 0,
            }
        }
    }
}
