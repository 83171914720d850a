//! The snapshot thread: periodic snapshots every `--snapshot-interval-ms` and the final one at
//! SIGTERM, after the gRPC drain. Serialisation runs on each core in slices of at most
//! [`SNAPSHOT_SLICE_BUDGET`] / [`SNAPSHOT_SLICE_MAX_ENTRIES`] (one mailbox operation each, so the
//! core serves whatever is queued between two slices); every byte of file I/O runs here.

use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use inferencecache_index::index::EntryCursor;
use xxhash_rust::xxh3::Xxh3;

use super::format::{self, Encoder, FileKind, Header, SectionKind, Totals};
use super::{MANIFEST_FILE, TMP_SUFFIX, core_file, generation_of, sync_dir, write_atomic};
use crate::limits::{
    DRAIN_TIMEOUT, SNAPSHOT_SHUTDOWN_BUDGET, SNAPSHOT_SLICE_BUDGET, SNAPSHOT_SLICE_MAX_ENTRIES,
};
use crate::metrics::snapshot as m;
use crate::runtime::{self, health, mailbox};
use crate::shard::CoreState;
use crate::sys::clock::{thread_cpu_time, unix_now_ns};

/// Longest one slice may take to come back from its core (a stalled core fails the snapshot
/// instead of hanging it).
const SLICE_REPLY_TIMEOUT: Duration = Duration::from_secs(5);

/// Where a core's export continues.
#[derive(Clone, Copy, Debug)]
enum Cursor {
    /// Stats rows from this model-scope position.
    Stats(u32),
    /// Entries from this place of the index's store.
    Entries(EntryCursor),
    /// Everything was exported.
    Done,
}

/// One slice: its bytes, where the next continues, its totals, and the wall and thread-CPU
/// time it took on the core (wall minus CPU is time the OS ran something else).
type Slice = (Vec<u8>, Cursor, Totals, Duration, Duration);

/// Encodes the next slice of this core's records: stops at the time budget or the entry bound,
/// whichever comes first. Runs on the core, as one mailbox operation.
fn export_slice(st: &mut CoreState, cursor: Cursor) -> Slice {
    let start = Instant::now();
    let cpu_start = thread_cpu_time();
    ENCODER.with(|cell| {
        let mut enc = cell.borrow_mut();
        enc.reset_totals();
        encode_slice(st, cursor, &mut enc, start, cpu_start)
    })
}

thread_local! {
    /// Each core's encoder, reused from slice to slice: its row buffer and name tables keep
    /// their capacity, so a slice does not regrow (and fault in) fresh buffers.
    static ENCODER: std::cell::RefCell<Encoder> = std::cell::RefCell::new(Encoder::new());
}

fn encode_slice(
    st: &mut CoreState,
    mut cursor: Cursor,
    enc: &mut Encoder,
    start: Instant,
    cpu_start: Option<Duration>,
) -> Slice {
    const STEP: usize = 256;
    let mut rows = 0usize;
    loop {
        cursor = match cursor {
            Cursor::Stats(p) => st
                .index
                .export_stats(p, STEP, |r| {
                    enc.stats(r);
                    rows += 1;
                })
                .map_or(Cursor::Entries(EntryCursor::START), Cursor::Stats),
            Cursor::Entries(p) => st
                .index
                .export_entries(p, STEP, |e| {
                    enc.entry(e);
                    rows += 1;
                })
                .map_or(Cursor::Done, Cursor::Entries),
            Cursor::Done => break,
        };
        if rows >= SNAPSHOT_SLICE_MAX_ENTRIES || start.elapsed() >= SNAPSHOT_SLICE_BUDGET {
            break;
        }
    }
    let bytes = enc.take();
    let cpu = match (cpu_start, thread_cpu_time()) {
        (Some(a), Some(b)) => b.saturating_sub(a),
        _ => Duration::ZERO,
    };
    (bytes, cursor, enc.totals(), start.elapsed(), cpu)
}

/// Why a snapshot was not completed.
#[derive(Debug)]
enum WriteError {
    Io(std::io::Error),
    CoreUnreachable(usize),
    /// Shutdown began during a periodic snapshot (the final one follows).
    Interrupted,
    /// The final snapshot ran out of [`SNAPSHOT_SHUTDOWN_BUDGET`].
    Budget,
}

impl WriteError {
    fn reason(&self) -> &'static str {
        match self {
            WriteError::Io(_) => "io_error",
            WriteError::CoreUnreachable(_) => "core_unreachable",
            WriteError::Interrupted | WriteError::Budget => "shutdown_budget",
        }
    }
}

impl std::fmt::Display for WriteError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            WriteError::Io(e) => write!(f, "{e}"),
            WriteError::CoreUnreachable(c) => write!(f, "core {c} did not answer"),
            WriteError::Interrupted => f.write_str("interrupted by shutdown"),
            WriteError::Budget => f.write_str("shutdown budget exhausted"),
        }
    }
}

impl From<std::io::Error> for WriteError {
    fn from(e: std::io::Error) -> Self {
        WriteError::Io(e)
    }
}

struct Ctx {
    dir: PathBuf,
    cores: usize,
    admin: tokio::runtime::Handle,
}

/// One core file written: `(length, xxh3, entries, longest slice wall, longest slice CPU)`.
type Written = (u64, u64, u64, Duration, Duration);

impl Ctx {
    /// Fails the snapshot when it must stop: shutdown during a periodic one, or past the final
    /// one's deadline.
    fn check(&self, deadline: Option<Instant>) -> Result<(), WriteError> {
        match deadline {
            None if runtime::shutting_down() => Err(WriteError::Interrupted),
            Some(d) if Instant::now() > d => Err(WriteError::Budget),
            _ => Ok(()),
        }
    }

    fn write_core(
        &self,
        core: usize,
        header: &Header,
        path: &Path,
        deadline: Option<Instant>,
    ) -> Result<Written, WriteError> {
        let file = std::fs::File::create(path)?;
        let mut w = BufWriter::with_capacity(1 << 20, file);
        let mut hasher = Xxh3::new();
        let mut len = 0u64;
        let mut put = |w: &mut BufWriter<std::fs::File>, b: &[u8]| -> std::io::Result<()> {
            hasher.update(b);
            len += b.len() as u64;
            w.write_all(b)
        };
        put(&mut w, &format::encode_header(header))?;
        let mut cursor = Cursor::Stats(0);
        let mut totals = Totals::default();
        let (mut longest, mut longest_cpu) = (Duration::ZERO, Duration::ZERO);
        while !matches!(cursor, Cursor::Done) {
            self.check(deadline)?;
            let c = cursor;
            let slice = self.admin.block_on(async move {
                tokio::time::timeout(
                    SLICE_REPLY_TIMEOUT,
                    mailbox::call(core, move |st| export_slice(st, c)),
                )
                .await
            });
            let Ok(Ok((bytes, next, t, took, cpu))) = slice else {
                return Err(WriteError::CoreUnreachable(core));
            };
            longest = longest.max(took);
            longest_cpu = longest_cpu.max(cpu);
            put(&mut w, &bytes)?;
            totals.sections += t.sections;
            totals.entries += t.entries;
            totals.stats += t.stats;
            cursor = next;
        }
        let mut end = Vec::new();
        format::push_end(&mut end, &totals);
        put(&mut w, &end)?;
        let file = w.into_inner().map_err(|e| e.into_error())?;
        file.sync_all()?;
        Ok((len, hasher.digest(), totals.entries, longest, longest_cpu))
    }

    /// Writes one complete generation: every core file, then the manifest naming them; then
    /// removes the files of other generations.
    fn write_generation(
        &self,
        generation: u64,
        deadline: Option<Instant>,
    ) -> Result<(), WriteError> {
        let started = Instant::now();
        let created = unix_now_ns();
        // Every event-log message up to here was applied before the first slice is read, so the
        // snapshot includes it; later ones may be included too, and are replayed at restore
        // (applying an update or event again leaves the same state).
        let stream_sequence = crate::metrics::nats::applied_sequence();
        let mut files = Vec::with_capacity(self.cores);
        let (mut bytes, mut entries) = (0u64, 0u64);
        let (mut longest, mut longest_cpu) = (Duration::ZERO, Duration::ZERO);
        for core in 0..self.cores {
            let name = core_file(core, generation);
            let tmp = self.dir.join(format!("{name}{TMP_SUFFIX}"));
            let header = Header {
                kind: FileKind::Core,
                generation,
                created_unix_ns: created,
                core: core as u32,
                cores: self.cores as u32,
            };
            let written = self
                .write_core(core, &header, &tmp, deadline)
                .and_then(|w| {
                    std::fs::rename(&tmp, self.dir.join(&name))?;
                    Ok(w)
                });
            let (len, sum, n, slice, slice_cpu) = match written {
                Ok(w) => w,
                Err(e) => {
                    let _ = std::fs::remove_file(&tmp);
                    return Err(e);
                }
            };
            files.push((core as u32, len, sum));
            bytes += len;
            entries += n;
            longest = longest.max(slice);
            longest_cpu = longest_cpu.max(slice_cpu);
        }
        sync_dir(&self.dir)?;
        let header = Header {
            kind: FileKind::Manifest,
            generation,
            created_unix_ns: created,
            core: 0,
            cores: self.cores as u32,
        };
        let manifest = format::encode_file(
            &header,
            SectionKind::Manifest,
            self.cores as u32,
            &format::manifest_body(&files, stream_sequence),
        );
        write_atomic(&self.dir, MANIFEST_FILE, &manifest)?;
        bytes += manifest.len() as u64;
        bytes += super::save_producers(&self.dir, generation)?;
        self.remove_other_generations(generation);
        let took = started.elapsed();
        m::record_snapshot_written(created, bytes, entries, took.as_micros() as u64);
        tracing::info!(
            generation,
            entries,
            bytes,
            duration_ms = took.as_millis() as u64,
            max_slice_us = longest.as_micros() as u64,
            max_slice_cpu_us = longest_cpu.as_micros() as u64,
            "snapshot_written"
        );
        Ok(())
    }

    fn remove_other_generations(&self, keep: u64) {
        let Ok(dir) = std::fs::read_dir(&self.dir) else {
            return;
        };
        for entry in dir.flatten() {
            let name = entry.file_name();
            let name = name.to_string_lossy();
            if generation_of(&name).is_some_and(|g| g != keep) {
                let _ = std::fs::remove_file(entry.path());
            }
        }
    }

    fn write_logged(&self, generation: u64, deadline: Option<Instant>) -> bool {
        match self.write_generation(generation, deadline) {
            Ok(()) => true,
            Err(WriteError::Interrupted) => false,
            Err(e) => {
                m::record_write_failure(e.reason());
                tracing::error!(generation, error = %e, reason = e.reason(), "snapshot_write_failed");
                false
            }
        }
    }
}

/// The running snapshot thread.
pub struct Writer {
    thread: std::thread::JoinHandle<()>,
}

impl Writer {
    /// Waits for the thread (it ends after the final snapshot, once shutdown was requested).
    pub fn join(self) {
        let _ = self.thread.join();
    }
}

/// Starts the snapshot thread. The runtime must have been told to hold its cores after the
/// drain ([`runtime::hold_cores_after_drain`]); the thread releases them after the final
/// snapshot.
pub fn start_writer(
    dir: PathBuf,
    cores: usize,
    interval: Duration,
    admin: tokio::runtime::Handle,
    first_generation: u64,
) -> Writer {
    let ctx = Ctx { dir, cores, admin };
    let thread = std::thread::Builder::new()
        .name("snapshot".into())
        .spawn(move || run(ctx, interval, first_generation))
        .expect("spawn snapshot thread");
    Writer { thread }
}

fn run(ctx: Ctx, interval: Duration, mut generation: u64) {
    loop {
        if runtime::wait_for_shutdown_until(Instant::now() + interval) {
            break;
        }
        if ctx.write_logged(generation, None) {
            generation += 1;
        }
    }
    // Final snapshot: once every core has drained its connections (no more ingest), while the
    // cores are held alive to answer the slices.
    // A stalled core (no heartbeat) never drains and would not answer: its final snapshot is
    // skipped at once, the previous complete generation stays.
    let drained_by = Instant::now() + DRAIN_TIMEOUT + Duration::from_secs(2);
    while !runtime::all_drained() && !health::any_stalled() && Instant::now() < drained_by {
        std::thread::sleep(Duration::from_millis(2));
    }
    let stalled: Vec<usize> = (0..ctx.cores).filter(|c| health::is_stalled(*c)).collect();
    if stalled.is_empty() {
        ctx.write_logged(generation, Some(Instant::now() + SNAPSHOT_SHUTDOWN_BUDGET));
    } else {
        m::record_write_failure(WriteError::CoreUnreachable(stalled[0]).reason());
        tracing::error!(generation, cores = ?stalled, "snapshot_final_skipped_core_stalled");
    }
    runtime::release_cores();
}
