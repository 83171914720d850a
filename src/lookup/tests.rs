//! One decision per request: a LookupRoute is resolved (and its tokens fingerprinted) once,
//! whether it is answered where it was received or hops to its owner.

use std::time::Instant;

use inferencecache_index::index::IndexConfig;
use inferencecache_index::resolve::calls;
use inferencecache_proto::v1alpha1 as pb;

use super::*;
use crate::shard::{self, CoreState};

/// Runs `f` on a fresh thread installed as core `core` of a one-core server: every partition
/// is core 0's, so a call decided on core 1 must hop.
fn on_core<R: Send + 'static>(core: usize, f: impl FnOnce() -> R + Send + 'static) -> R {
    std::thread::spawn(move || {
        shard::install(CoreState::new(core, IndexConfig::default()));
        f()
    })
    .join()
    .expect("test thread")
}

fn token_ids_request() -> pb::LookupRouteRequest {
    pb::LookupRouteRequest {
        tenant_id: "t".into(),
        model_id: "m".into(),
        hash_scheme: "vllm".into(),
        token_ids: (0..64 * 16).collect(),
        ..Default::default()
    }
}

const CFG: LookupConfig = LookupConfig {
    engine_block_size: 16,
};

/// The resolutions and fingerprints made on this thread while `f` ran.
fn counted<R>(f: impl FnOnce() -> R) -> (R, u64, u64) {
    let before = calls::on_this_thread();
    let r = f();
    let after = calls::on_this_thread();
    (
        r,
        after.resolutions - before.resolutions,
        after.fingerprints - before.fingerprints,
    )
}

#[test]
fn a_hopped_token_ids_lookup_is_resolved_and_fingerprinted_once() {
    on_core(1, || {
        let req = token_ids_request();
        let ((resp, owner), resolutions, fingerprints) = counted(|| {
            let decision = decide(&CFG, &(&req).into(), Instant::now(), None);
            let Decision::Hop { decided, inputs } = decision else {
                panic!("core 1 does not own the partition: the call hops");
            };
            let owner = decided.owner;
            let call = OwnerCall {
                req: LookupRequest::Decoded(req),
                inputs,
                decided,
            };
            // The owner's half, run here: what core 0 runs when the call arrives.
            let (resp, _req) = shard::with_core(|st| owner::answer(st, call));
            (resp, owner)
        });
        assert_eq!(owner, 0);
        assert_eq!(resp.reason_code, reason::NO_HINT, "an empty index");
        assert_eq!((resolutions, fingerprints), (1, 1));
    });
}

#[test]
fn a_local_token_ids_lookup_is_resolved_and_fingerprinted_once() {
    on_core(0, || {
        let req = token_ids_request();
        let (decision, resolutions, fingerprints) =
            counted(|| decide(&CFG, &(&req).into(), Instant::now(), None));
        assert!(matches!(decision, Decision::Answered(_)), "core 0 owns it");
        assert_eq!((resolutions, fingerprints), (1, 1));
    });
}

#[test]
fn a_malformed_chain_fails_open_where_it_was_received() {
    on_core(1, || {
        let req = pb::LookupRouteRequest {
            block_hashes: vec![vec![1u8; 8].into()],
            ..token_ids_request()
        };
        let decision = decide(&CFG, &(&req).into(), Instant::now(), None);
        let Decision::Answered(resp) = decision else {
            panic!("nothing for the owner to do")
        };
        assert_eq!(resp.reason_code, reason::NO_HINT);
    });
}

#[test]
fn a_prompt_is_tokenized_before_the_owner_is_asked() {
    on_core(1, || {
        let req = pb::LookupRouteRequest {
            token_ids: Vec::new(),
            prompt_text: "hello".into(),
            ..token_ids_request()
        };
        let (decision, resolutions, _) =
            counted(|| decide(&CFG, &(&req).into(), Instant::now(), None));
        let Decision::Tokenize(decided) = decision else {
            panic!("the prompt needs the tokenizer")
        };
        assert_eq!(decided.owner, 0);
        assert!(decided.deadline.is_some(), "the default tokenize deadline");
        assert_eq!(resolutions, 1);
    });
}
