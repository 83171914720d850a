//! Applying one producer message, shared by every way one arrives (the gRPC handlers, the NATS
//! JetStream consumer): the owner core applies it, then (several cores) the tenant quota and the
//! global cap pick their victims across cores (docs/BEHAVIOUR.md §7.1, §7.2), then the change
//! feed publishes the message and, after it, the entries its evictions removed. Each step ends
//! before the next message is applied, so every path keeps one global order.

use inferencecache_index::PROBE_TENANT;
use inferencecache_index::index::Admission;
use inferencecache_proto::v1alpha1 as pb;

use crate::feeds::events;
use crate::limits::{INGEST_PART_BLOCKS, SWEEP_SLICE_PAUSE};
use crate::runtime::{evict, mailbox};
use crate::shard::{CapNeed, IngestRefused, owner};

/// The owner core could not be reached (stalled or shutting down); nothing was applied.
#[derive(Debug)]
pub struct OwnerUnavailable;

/// Applies `update` on its owner core with its evictions and change-feed events. `Ok(Err(why))`:
/// the update was refused in whole or in part (counted, nothing else to do).
pub async fn apply_update(
    update: pb::CacheStateUpdate,
) -> Result<Result<(), IngestRefused>, OwnerUnavailable> {
    if update.tenant_id == PROBE_TENANT {
        return Ok(Ok(()));
    }
    if let Err(why) = IngestRefused::check_ids(&update) {
        crate::metrics::record_ingest_refused(why.metric_label());
        return Ok(Err(why));
    }
    let core = owner(&update.tenant_id, &update.model_id);
    let len = update.prefixes.len();
    // A large update is applied in parts, one step each, sweeps held off until its evictions
    // are done (as for one step). The owner may end a part early (the names and keyspaces it
    // creates count too): the next part starts where it ended.
    // The check that the update's names and keyspaces fit runs in steps too when it must look
    // its adapters up (`Admission`): such an attempt applies nothing and the part is tried again.
    let mut hold = None;
    let (mut start, mut partial) = (0, None);
    let mut update = update;
    let mut admission = Admission::default();
    loop {
        let end = part_end(&update, start);
        if end >= len {
            break;
        }
        hold.get_or_insert_with(evict::SweepHold::new);
        let ((applied, applied_to), back, admission_back) =
            mailbox::call_piece(core, CapNeed::Nothing, move |st| {
                let part = st.ingest_part(&update, start..end, &mut admission);
                (part, update, admission)
            })
            .await
            .map_err(|_| OwnerUnavailable)?;
        update = back;
        admission = admission_back;
        match applied {
            Err(why) if why.is_whole() => return Ok(Err(why)),
            Err(why) => partial = partial.or(Some(why)),
            Ok(()) => {}
        }
        start = applied_to;
        mailbox::pause(SWEEP_SLICE_PAUSE).await;
    }
    // The last part. The update travels back with the answer, so the change feed can publish
    // it without a copy; so do the entries its cap or quota evicted on the owner (published
    // after it). After a pending ALL_CLEARED on the owner (the ingest needs the store after
    // it), and after the slices of any cap victims it may need that are not ready.
    let need = CapNeed::Ingest {
        new_entries: len,
        tenant: update.tenant_id.as_str().into(),
    };
    let (applied, update, removals, evictions) = loop {
        let (applied, applied_to, (update_back, admission_back), finished) =
            mailbox::call_piece(core, need.clone(), move |st| {
                let (applied, applied_to) = st.ingest_part(&update, start..len, &mut admission);
                let finished = (applied_to >= len).then(|| {
                    let quota = st.quota_for(&update.tenant_id);
                    let evictions = evict::pending(st, &update.tenant_id, quota);
                    (events::take_removals(), evictions)
                });
                (applied, applied_to, (update, admission), finished)
            })
            .await
            .map_err(|_| OwnerUnavailable)?;
        update = update_back;
        admission = admission_back;
        if let Some((removals, evictions)) = finished {
            break (applied, update, removals, evictions);
        }
        // It created more than one step should: the rest in further parts.
        match applied {
            Err(why) if why.is_whole() => return Ok(Err(why)),
            Err(why) => partial = partial.or(Some(why)),
            Ok(()) => {}
        }
        hold.get_or_insert_with(evict::SweepHold::new);
        start = applied_to;
        mailbox::pause(SWEEP_SLICE_PAUSE).await;
    };
    // The evictions that follow (in steps, or across cores) hand back the removals each step
    // held, kept with the ingest's own up to one burst in all.
    let mut removals = removals;
    if let Some(e) = evictions {
        e.enforce(events::take_removals, &mut |later| removals.absorb(later))
            .await;
    }
    let applied = match (applied, partial) {
        (Ok(()), Some(why)) => Err(why),
        (applied, _) => applied,
    };
    if applied.is_ok() {
        events::publish_ingest(&update);
    }
    events::publish_removals(removals);
    Ok(applied)
}

/// The end of the part of `update.prefixes` that starts at `start`: about [`INGEST_PART_BLOCKS`]
/// blocks (a legacy prefix counts one, a chain entry its blocks; one entry is never split). The
/// owner may end it earlier (`CoreState::ingest_part`).
fn part_end(update: &pb::CacheStateUpdate, start: usize) -> usize {
    let mut blocks = 0;
    for (i, p) in update.prefixes.iter().enumerate().skip(start) {
        blocks += p.block_hashes.len().max(1);
        if blocks >= INGEST_PART_BLOCKS {
            return i + 1;
        }
    }
    update.prefixes.len()
}

/// Applies `event` on its owner core and publishes it to the change feed.
pub async fn apply_event(event: pb::CacheEvent) -> Result<(), OwnerUnavailable> {
    if event.tenant_id == PROBE_TENANT {
        return Ok(());
    }
    let core = owner(&event.tenant_id, &event.model_id);
    let event = mailbox::call_after_clear(core, move |st| {
        st.apply_event(&event);
        event
    })
    .await
    .map_err(|_| OwnerUnavailable)?;
    events::publish_event(&event);
    Ok(())
}
