//! A LookupRoute request that outlives the turn it was read in: sent to the owner core (and
//! back), or held while its prompt is tokenized. Either what the general path's prost decoded,
//! or the received message itself with where the view found each field, so a request decoded
//! from its bytes is not decoded again.

use std::ops::Range;

use bytes::Bytes;
use inferencecache_index::index::{BlockHashes, StridedHashes};
use inferencecache_index::resolve::LookupRouteView;
use inferencecache_proto::v1alpha1 as pb;

/// A request owned by the call answering it.
pub enum LookupRequest {
    /// Decoded by prost (the general path).
    Decoded(pb::LookupRouteRequest),
    /// Decoded from its bytes into a view by the HTTP/2 turn that read it.
    Received(ReceivedRequest),
}

impl LookupRequest {
    /// The request as resolution and the lookup read it.
    pub fn view(&self) -> LookupRouteView<'_> {
        match self {
            LookupRequest::Decoded(req) => req.into(),
            LookupRequest::Received(req) => req.view(),
        }
    }

    /// The prompt text, for the tokenizer: moved out of a decoded request, copied out of a
    /// received one (its bytes are shared with the message).
    pub fn take_prompt_text(&mut self) -> String {
        match self {
            LookupRequest::Decoded(req) => std::mem::take(&mut req.prompt_text),
            LookupRequest::Received(req) => {
                let text = req.view().prompt_text.to_owned();
                req.prompt_text = 0..0;
                text
            }
        }
    }

    /// The model id, kept for the metric label while the request is with the owner core.
    pub fn model_label(&self) -> ModelLabel {
        match self {
            LookupRequest::Decoded(req) => ModelLabel::Copied(req.model_id.clone()),
            LookupRequest::Received(req) => ModelLabel::Shared(req.msg.slice(req.model_id.clone())),
        }
    }
}

/// A request's model id that outlives the request: a copy, or a share of its message.
pub enum ModelLabel {
    Copied(String),
    Shared(Bytes),
}

impl ModelLabel {
    /// The model id.
    pub fn as_str(&self) -> &str {
        match self {
            ModelLabel::Copied(s) => s,
            // Checked as UTF-8 when the view was decoded.
            ModelLabel::Shared(b) => std::str::from_utf8(b).unwrap_or_default(),
        }
    }
}

/// A received message and the fields a view of it found there: strings and the prefix hash as
/// ranges of the message, the repeated fields copied. `token_ids` are not kept: a request that
/// outlives its turn was resolved (or is tokenized) already, and nothing after that reads them.
pub struct ReceivedRequest {
    msg: Bytes,
    model_id: Range<usize>,
    tenant_id: Range<usize>,
    prefix_hash: Range<usize>,
    hash_scheme: Range<usize>,
    prompt_text: Range<usize>,
    adapter_id: Range<usize>,
    prefix_token_count: i32,
    slo: Option<pb::Slo>,
    block_hashes: ReceivedHashes,
    block_token_counts: Vec<i32>,
}

/// The block hashes of a [`ReceivedRequest`]: copied when 8 bytes each (as the view holds
/// them), else slices of the message.
enum ReceivedHashes {
    Fixed(Vec<[u8; 8]>),
    Slices(Vec<Bytes>),
    /// 8-byte hashes where they lie in the message, `stride` apart.
    Strided {
        at: Range<usize>,
        stride: usize,
        len: usize,
    },
}

impl ReceivedRequest {
    /// Keeps `view`, a view of `msg` (every field it borrows lies in `msg`).
    pub fn new(msg: Bytes, view: &LookupRouteView<'_>) -> Self {
        let at = |field: &[u8]| range_in(&msg, field);
        let block_hashes = match view.block_hashes {
            BlockHashes::Fixed(hashes) => ReceivedHashes::Fixed(hashes.to_vec()),
            BlockHashes::Strided(hashes) => ReceivedHashes::Strided {
                at: range_in(&msg, hashes.bytes()),
                stride: hashes.stride(),
                len: hashes.len(),
            },
            other => ReceivedHashes::Slices(
                (0..other.len())
                    .map(|i| msg.slice(range_in(&msg, other.get(i))))
                    .collect(),
            ),
        };
        ReceivedRequest {
            model_id: at(view.model_id.as_bytes()),
            tenant_id: at(view.tenant_id.as_bytes()),
            prefix_hash: at(view.prefix_hash),
            hash_scheme: at(view.hash_scheme.as_bytes()),
            prompt_text: at(view.prompt_text.as_bytes()),
            adapter_id: at(view.adapter_id.as_bytes()),
            prefix_token_count: view.prefix_token_count,
            slo: view.slo,
            block_hashes,
            block_token_counts: view.block_token_counts.to_vec(),
            msg,
        }
    }

    /// The request as resolution and the lookup read it (`token_ids` empty).
    pub fn view(&self) -> LookupRouteView<'_> {
        LookupRouteView {
            model_id: self.text(&self.model_id),
            tenant_id: self.text(&self.tenant_id),
            prefix_hash: &self.msg[self.prefix_hash.clone()],
            prefix_token_count: self.prefix_token_count,
            hash_scheme: self.text(&self.hash_scheme),
            slo: self.slo,
            block_hashes: match &self.block_hashes {
                ReceivedHashes::Fixed(h) => BlockHashes::Fixed(h),
                ReceivedHashes::Slices(h) => BlockHashes::Bytes(h),
                ReceivedHashes::Strided { at, stride, len } => BlockHashes::Strided(
                    StridedHashes::new(&self.msg[at.clone()], *stride, *len)
                        .expect("the strided run of a valid view of this message"),
                ),
            },
            block_token_counts: &self.block_token_counts,
            token_ids: &[],
            prompt_text: self.text(&self.prompt_text),
            adapter_id: self.text(&self.adapter_id),
        }
    }

    /// A string field; checked as UTF-8 when the view was decoded.
    fn text(&self, at: &Range<usize>) -> &str {
        std::str::from_utf8(&self.msg[at.clone()]).unwrap_or_default()
    }
}

/// Where `field`, a slice of `msg` or empty, lies in `msg`.
fn range_in(msg: &[u8], field: &[u8]) -> Range<usize> {
    if field.is_empty() {
        return 0..0;
    }
    let start = (field.as_ptr() as usize)
        .checked_sub(msg.as_ptr() as usize)
        .filter(|&s| s + field.len() <= msg.len())
        .expect("a view's fields lie in its message");
    start..start + field.len()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_kept_view_reads_as_the_view_without_its_tokens() {
        let msg = Bytes::from_static(b"....tenant..model..scheme..hash..text..adapter..h1h2h3h4..");
        let s = |from: usize, len: usize| std::str::from_utf8(&msg[from..from + len]).unwrap();
        let slices: Vec<&[u8]> = vec![&msg[48..50], &msg[50..52]];
        let view = LookupRouteView {
            tenant_id: s(4, 6),
            model_id: s(12, 5),
            hash_scheme: s(19, 6),
            prefix_hash: &msg[27..31],
            prompt_text: s(33, 4),
            adapter_id: s(39, 7),
            prefix_token_count: 7,
            slo: Some(pb::Slo {
                ttft_ms: 1,
                tbt_ms: 2,
            }),
            block_hashes: BlockHashes::Slices(&slices),
            block_token_counts: &[16, 16],
            token_ids: &[1, 2, 3],
        };
        let kept = ReceivedRequest::new(msg.clone(), &view);
        let want = LookupRouteView {
            token_ids: &[],
            ..view
        };
        assert_eq!(kept.view(), want);
        let fixed = [[1u8; 8], [2u8; 8]];
        let view = LookupRouteView {
            block_hashes: BlockHashes::Fixed(&fixed),
            ..LookupRouteView::default()
        };
        let kept = ReceivedRequest::new(msg, &view);
        assert_eq!(kept.view(), view);
    }
}
