//! The buffers of this core's encoded LookupRoute answers, kept for its next answers. The
//! inline path encodes each answer on the core and hands it back ([`recycle`]), so a warm core
//! builds answers without allocating: score lists, replica ids, reason codes and adapters all
//! come from here. Answers the general path sends belong to the transport and never come back;
//! building one just finds less here and allocates.

use std::cell::RefCell;

use inferencecache_proto::v1alpha1 as pb;

use crate::limits::{LOOKUP_SPARE_SCORES, MAX_ID_BYTES};

/// What one core keeps. Bounded: a score list with room for at most [`LOOKUP_SPARE_SCORES`]
/// scores, as many replica-id buffers, strings of at most [`MAX_ID_BYTES`] each.
#[derive(Default)]
struct Spare {
    /// An empty score list, kept for its room.
    scores: Vec<pb::ReplicaScore>,
    /// Emptied replica-id buffers.
    ids: Vec<String>,
    /// Emptied reason-code and adapter buffers.
    reason: String,
    adapter: String,
}

thread_local! {
    static SPARE: RefCell<Spare> = RefCell::default();
}

/// Hands an encoded answer back to this core: the next answers built here reuse its buffers.
pub fn recycle(resp: pb::LookupRouteResponse) {
    let pb::LookupRouteResponse {
        mut replica_scores,
        reason_code,
        adapter_id,
        ..
    } = resp;
    SPARE.with_borrow_mut(|spare| {
        keep_ids(spare, &mut replica_scores);
        let room = replica_scores.capacity();
        if room <= LOOKUP_SPARE_SCORES && room > spare.scores.capacity() {
            spare.scores = replica_scores;
        }
        keep_text(&mut spare.reason, reason_code);
        keep_text(&mut spare.adapter, adapter_id);
    });
}

/// An empty score list, with the room a previous answer's list had when one was handed back.
pub(super) fn scores() -> Vec<pb::ReplicaScore> {
    SPARE.with_borrow_mut(|spare| std::mem::take(&mut spare.scores))
}

/// Empties `scores`, keeping their replica-id buffers for the next scores pushed here.
pub(super) fn clear(scores: &mut Vec<pb::ReplicaScore>) {
    SPARE.with_borrow_mut(|spare| keep_ids(spare, scores));
}

/// Appends `score`, its replica id written into a kept buffer when there is one.
pub(super) fn push_score(scores: &mut Vec<pb::ReplicaScore>, score: ScoreOf<'_>) {
    let mut replica_id = SPARE
        .with_borrow_mut(|spare| spare.ids.pop())
        .unwrap_or_default();
    debug_assert!(replica_id.is_empty(), "kept buffers are emptied");
    replica_id.push_str(score.replica);
    scores.push(pb::ReplicaScore {
        replica_id,
        score: score.score,
        matched_tokens: score.matched_tokens,
        estimated_cache_hit_prob: score.estimated_cache_hit_prob,
        tier: score.tier,
    });
}

/// `reason` in a kept buffer.
pub(super) fn reason(reason: &str) -> String {
    fill(
        SPARE.with_borrow_mut(|spare| std::mem::take(&mut spare.reason)),
        reason,
    )
}

/// `adapter` in a kept buffer.
pub(super) fn adapter(adapter: &str) -> String {
    fill(
        SPARE.with_borrow_mut(|spare| std::mem::take(&mut spare.adapter)),
        adapter,
    )
}

/// One score of an answer, borrowed from the index.
#[derive(Default)]
pub(super) struct ScoreOf<'a> {
    pub replica: &'a str,
    pub score: f32,
    pub matched_tokens: i32,
    pub estimated_cache_hit_prob: f32,
    pub tier: i32,
}

/// Moves the replica ids of `scores` (emptied) into the spare, as many as it keeps.
fn keep_ids(spare: &mut Spare, scores: &mut Vec<pb::ReplicaScore>) {
    for s in scores.drain(..) {
        let mut id = s.replica_id;
        if spare.ids.len() < LOOKUP_SPARE_SCORES && id.capacity() <= MAX_ID_BYTES {
            id.clear();
            spare.ids.push(id);
        }
    }
}

/// Keeps `text`'s buffer in `slot` unless it is over the bound.
fn keep_text(slot: &mut String, mut text: String) {
    if text.capacity() <= MAX_ID_BYTES {
        text.clear();
        *slot = text;
    }
}

/// `buf` holding exactly `text`.
fn fill(mut buf: String, text: &str) -> String {
    buf.clear();
    buf.push_str(text);
    buf
}

#[cfg(test)]
mod tests {
    use super::*;

    fn score(replica: &str) -> ScoreOf<'_> {
        ScoreOf {
            replica,
            score: 1.0,
            ..Default::default()
        }
    }

    #[test]
    fn a_recycled_answer_lends_its_buffers_to_the_next_one() {
        let mut first = scores();
        push_score(&mut first, score("replica-a"));
        push_score(&mut first, score("replica-b"));
        let id_buf = first[1].replica_id.as_ptr();
        let resp = pb::LookupRouteResponse {
            replica_scores: first,
            reason_code: reason("PREFIX_MATCH"),
            ..Default::default()
        };
        let list_buf = resp.replica_scores.as_ptr();
        recycle(resp);
        let mut next = scores();
        assert_eq!(next.as_ptr(), list_buf, "the score list is reused");
        assert!(next.is_empty());
        push_score(&mut next, score("replica-c"));
        assert_eq!(next[0].replica_id, "replica-c");
        assert_eq!(
            next[0].replica_id.as_ptr(),
            id_buf,
            "an id buffer is reused"
        );
        assert_eq!(reason("NO_HINT"), "NO_HINT");
    }

    #[test]
    fn what_is_kept_is_bounded() {
        let big = "x".repeat(MAX_ID_BYTES + 1);
        let mut list = Vec::new();
        for _ in 0..LOOKUP_SPARE_SCORES * 2 {
            push_score(&mut list, score(&big));
        }
        push_score(&mut list, score("small"));
        clear(&mut list);
        SPARE.with_borrow(|spare| {
            assert_eq!(spare.ids.len(), 1, "only the id within the bound is kept");
        });
        let mut many = Vec::with_capacity(LOOKUP_SPARE_SCORES * 2);
        many.push(pb::ReplicaScore::default());
        recycle(pb::LookupRouteResponse {
            replica_scores: many,
            reason_code: big.clone(),
            ..Default::default()
        });
        SPARE.with_borrow(|spare| {
            assert!(spare.scores.capacity() <= LOOKUP_SPARE_SCORES);
            assert!(spare.reason.capacity() <= MAX_ID_BYTES);
            assert!(spare.ids.len() <= LOOKUP_SPARE_SCORES);
        });
    }
}
