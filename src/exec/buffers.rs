//! The buffer side of the executor contract, which every transport implements (the CUDA
//! executor here; NIXL, CUDA IPC or host copies elsewhere): where a rank's views of a plan's
//! tensors sit in the buffers of a call, and which buffers a call must pass.
//!
//! A call passes either one source and one destination buffer (`ncclReshard`: each tensor's
//! view at its offset in them) or one pointer per tensor and side (`ncclReshardMulti`). The
//! rules are checked here, once, before any transport runs: a rank holding data on a side
//! needs that side's buffer, views of different tensors do not overlap within a buffer of a
//! single-buffer call (a plan only ever called per tensor may leave its offsets at 0), and the
//! source and destination of a call do not overlap (no in-place reshards). Pointers are plain
//! addresses: nothing here reads or writes through them.

use crate::error::{Error, Result};
use crate::layout::{RankView, Side, TensorSpec};
use crate::plan::DstRange;
use crate::quant::Conversion;

/// Where a call's buffers are: what an executor is handed after [`RankViews`] checked them.
pub enum CallBuffers<'a> {
    /// `ncclReshard`: one source and one destination buffer; views at the plan's offsets.
    Single {
        /// `sendbuff` (0 when the rank has no source view).
        send: usize,
        /// `recvbuff` (0 when the rank has no destination view).
        recv: usize,
    },
    /// `ncclReshardMulti`: one pointer per tensor and side (0 where the rank has no view; an
    /// empty slice when the rank has no views on that side).
    PerTensor {
        /// `sendbuffs`: one source view per tensor.
        send: &'a [usize],
        /// `recvbuffs`: one destination view per tensor, then one per scale tensor.
        recv: &'a [usize],
    },
}

/// Where one tensor's view sits in the single-buffer call: `bytes` bytes (the view's extent)
/// from byte `offset` of the buffer.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ViewRange {
    /// Byte offset of the view's first byte in the buffer.
    pub offset: u64,
    /// The view's extent: from its first byte to past its last (strided views included).
    pub bytes: u64,
}

impl ViewRange {
    fn end(&self) -> u64 {
        self.offset + self.bytes
    }
}

/// One tensor's views on this rank (`None` where the rank has no view on that side).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TensorViews {
    /// The source view in the call's source buffer.
    pub src: Option<ViewRange>,
    /// The destination view in the call's destination buffer.
    pub dst: Option<ViewRange>,
}

/// A rank's views of every tensor of a plan, with their offsets in the single-buffer call,
/// validated once when the plan is made; it checks every call's buffers against them.
/// Immutable, so shareable across threads.
///
/// The views of quantized tensors' scales follow the tensors' (entry `ntensors + k` is the
/// k-th scale tensor's: a destination view only).
#[derive(Clone, Debug)]
pub struct RankViews {
    rank: u32,
    tensors: Vec<TensorViews>,
    /// What each entry is called in messages (`tensors[3] (layers.0.wq)`, `the scales of
    /// tensors[3]`).
    labels: Vec<String>,
    /// Why the single-buffer call cannot be used (two tensors' views overlap at their
    /// offsets), if it cannot; the per-tensor call ignores the offsets.
    single_refused: Option<String>,
}

/// Checks that no two of `ranges` (range, tensor) overlap; `buffer` names the buffer and
/// `field` the offset field.
/// Checks that no two of `ranges` (range, entry) overlap; `buffer` names the buffer,
/// `field(entry)` the offset field of an entry and `label(entry)` the entry.
fn check_disjoint(
    mut ranges: Vec<(ViewRange, usize)>,
    buffer: &str,
    field: &dyn Fn(usize) -> String,
    label: &dyn Fn(usize) -> String,
) -> std::result::Result<(), String> {
    ranges.retain(|(r, _)| r.bytes > 0);
    ranges.sort_unstable_by_key(|&(r, t)| (r.offset, r.bytes, t));
    for w in ranges.windows(2) {
        let ((first, first_entry), (second, second_entry)) = (w[0], w[1]);
        if first.end() > second.offset {
            return Err(format!(
                "{} = {}: its view overlaps the view of {} in {buffer} (bytes [{}, {})); give each tensor its own byte range to call ncclReshard, or call ncclReshardMulti, which ignores the offsets",
                field(second_entry),
                second.offset,
                label(first_entry),
                first.offset,
                first.end()
            ));
        }
    }
    Ok(())
}

impl RankViews {
    /// `rank`'s views of `tensors`, the views of tensor `t` at `offsets[t]` = (source offset,
    /// destination offset) in the single-buffer call; `names[t]` is its name, if any. Errors
    /// (naming `tensors[t].srcOffset` / `.dstOffset`) when a view would end past 2^63 bytes;
    /// views that overlap at their offsets refuse only single-buffer calls.
    pub fn new(
        rank: u32,
        tensors: &[TensorSpec],
        offsets: &[(u64, u64)],
        names: Vec<Option<String>>,
    ) -> Result<RankViews> {
        RankViews::with_conversions(rank, tensors, None, offsets, &[], names)
    }

    /// Like [`RankViews::new`] for tensors that may convert on the way: a converted tensor's
    /// destination view holds its destination dtype, and each quantized tensor t has a scale
    /// view, at `scale_offsets[t]` in the single-buffer call's destination buffer.
    pub fn with_conversions(
        rank: u32,
        tensors: &[TensorSpec],
        conversions: Option<&[Option<Conversion>]>,
        offsets: &[(u64, u64)],
        scale_offsets: &[u64],
        names: Vec<Option<String>>,
    ) -> Result<RankViews> {
        let range =
            |view: Option<RankView>, offset: u64, field: &str| -> Result<Option<ViewRange>> {
                let Some(view) = view else {
                    return Ok(None);
                };
                let bytes = view.view.extent_bytes();
                offset
                    .checked_add(bytes)
                    .filter(|&end| end <= i64::MAX as u64)
                    .ok_or_else(|| {
                        Error::invalid_argument(format!(
                            "{field} = {offset} puts the view past 2^63 bytes"
                        ))
                    })?;
                Ok(Some(ViewRange { offset, bytes }))
            };
        let conversion = |t: usize| conversions.and_then(|c| c.get(t)).and_then(Option::as_ref);
        let mut views = Vec::with_capacity(tensors.len());
        let mut labels = Vec::with_capacity(tensors.len());
        let mut scale_of = Vec::new();
        let label = |t: usize| match names.get(t).and_then(Option::as_ref) {
            Some(name) => format!("tensors[{t}] ({name})"),
            None => format!("tensors[{t}]"),
        };
        for (t, (spec, &(src_offset, dst_offset))) in tensors.iter().zip(offsets).enumerate() {
            let dst_size = conversion(t).map_or(spec.elem_size(), |c| c.dtype.size());
            views.push(TensorViews {
                src: range(
                    spec.rank_view(Side::Src, rank),
                    src_offset,
                    &format!("tensors[{t}].srcOffset"),
                )?,
                dst: range(
                    spec.dst.rank_view(&spec.shape, dst_size, rank),
                    dst_offset,
                    &format!("tensors[{t}].dstOffset"),
                )?,
            });
            labels.push(label(t));
        }
        for (t, spec) in tensors.iter().enumerate() {
            let Some(c) = conversion(t) else { continue };
            let Some(layout) = c.scale_layout(spec) else {
                continue;
            };
            let shape = c.scale_shape(&spec.shape);
            let view = layout.rank_view(&shape, c.scale_format.size(), rank);
            let offset = scale_offsets.get(t).copied().unwrap_or(0);
            views.push(TensorViews {
                src: None,
                dst: range(view, offset, &format!("tensors[{t}].scaleOffset"))?,
            });
            labels.push(format!("the scales of {}", label(t)));
            scale_of.push(t);
        }
        let ntensors = tensors.len();
        let field = |entry: usize, name: &str| {
            if entry < ntensors {
                format!("tensors[{entry}].{name}")
            } else {
                format!("tensors[{}].scaleOffset", scale_of[entry - ntensors])
            }
        };
        let label = |entry: usize| labels[entry].clone();
        let ranges = |side: fn(&TensorViews) -> Option<ViewRange>| {
            views
                .iter()
                .enumerate()
                .filter_map(|(t, v)| side(v).map(|r| (r, t)))
                .collect()
        };
        let single_refused = check_disjoint(
            ranges(|v| v.src),
            "sendbuff",
            &|e| field(e, "srcOffset"),
            &label,
        )
        .and_then(|()| {
            check_disjoint(
                ranges(|v| v.dst),
                "recvbuff",
                &|e| field(e, "dstOffset"),
                &label,
            )
        })
        .err();
        Ok(RankViews {
            rank,
            tensors: views,
            labels,
            single_refused,
        })
    }

    /// Where the destination views sit in the single-buffer call's destination buffer (one
    /// entry per destination view, `None` where the rank has none): the layout its receives
    /// may land in place in (`plan::in_place`). `None` when the single-buffer call is refused
    /// (views overlap at their offsets: a plan only ever called per tensor may leave them 0).
    pub fn dst_ranges(&self) -> Option<Vec<Option<DstRange>>> {
        self.single_refused.is_none().then(|| {
            self.tensors
                .iter()
                .map(|v| {
                    v.dst.map(|r| DstRange {
                        offset: r.offset,
                        bytes: r.bytes,
                    })
                })
                .collect()
        })
    }

    /// The views, one entry per tensor in plan order.
    pub fn tensors(&self) -> &[TensorViews] {
        &self.tensors
    }

    /// Offsets of the source views in the single-buffer call (0 where the rank has none).
    pub fn src_offsets(&self) -> Vec<u64> {
        self.tensors
            .iter()
            .map(|v| v.src.map_or(0, |r| r.offset))
            .collect()
    }

    /// Offsets of the destination views in the single-buffer call (0 where the rank has none).
    pub fn dst_offsets(&self) -> Vec<u64> {
        self.tensors
            .iter()
            .map(|v| v.dst.map_or(0, |r| r.offset))
            .collect()
    }

    /// The first tensor with a non-empty view on `side`.
    fn first_holding(&self, side: fn(&TensorViews) -> Option<ViewRange>) -> Option<usize> {
        self.tensors
            .iter()
            .position(|v| side(v).is_some_and(|r| r.bytes > 0))
    }

    /// Bytes of the single-buffer call's source buffer this rank reads: up to the end of its
    /// last source view.
    pub fn send_bytes(&self) -> u64 {
        self.extent(|v| v.src)
    }

    /// Bytes of the single-buffer call's destination buffer this rank writes at most.
    pub fn recv_bytes(&self) -> u64 {
        self.extent(|v| v.dst)
    }

    fn extent(&self, side: fn(&TensorViews) -> Option<ViewRange>) -> u64 {
        self.tensors
            .iter()
            .filter_map(|v| side(v).map(|r| r.end()))
            .max()
            .unwrap_or(0)
    }

    fn tensor_name(&self, t: usize) -> String {
        self.labels
            .get(t)
            .cloned()
            .unwrap_or_else(|| format!("tensors[{t}]"))
    }

    /// The buffers of a single-buffer call (`send`/`recv` addresses, 0 for NULL), after
    /// checking that the rank has every buffer it needs and that the two do not overlap.
    pub fn single(&self, send: usize, recv: usize) -> Result<CallBuffers<'static>> {
        if let Some(why) = &self.single_refused {
            return Err(Error::invalid_argument(why.clone()));
        }
        if send == 0 {
            if let Some(t) = self.first_holding(|v| v.src) {
                return Err(Error::invalid_argument(format!(
                    "sendbuff is NULL but rank {} holds source data of {}",
                    self.rank,
                    self.tensor_name(t)
                )));
            }
        }
        if recv == 0 {
            if let Some(t) = self.first_holding(|v| v.dst) {
                return Err(Error::invalid_argument(format!(
                    "recvbuff is NULL but rank {} receives data of {}",
                    self.rank,
                    self.tensor_name(t)
                )));
            }
        }
        let (sb, rb) = (self.send_bytes() as usize, self.recv_bytes() as usize);
        if send != 0
            && recv != 0
            && sb > 0
            && rb > 0
            && send < recv.saturating_add(rb)
            && recv < send.saturating_add(sb)
        {
            return Err(Error::invalid_argument(format!(
                "sendbuff ({send:#x}, {sb} bytes) and recvbuff ({recv:#x}, {rb} bytes) overlap; in-place reshards are not supported"
            )));
        }
        Ok(CallBuffers::Single { send, recv })
    }

    /// The buffers of a per-tensor call (one address per tensor and side, 0 for NULL; an empty
    /// slice when none is given), after checking that every view the rank holds has its
    /// buffer and that no tensor's source and destination overlap.
    pub fn per_tensor<'a>(&self, send: &'a [usize], recv: &'a [usize]) -> Result<CallBuffers<'a>> {
        let send_at = |t: usize| send.get(t).copied().unwrap_or(0);
        let recv_at = |t: usize| recv.get(t).copied().unwrap_or(0);
        for (t, v) in self.tensors.iter().enumerate() {
            let src = v.src.filter(|r| r.bytes > 0);
            let dst = v.dst.filter(|r| r.bytes > 0);
            if src.is_some() && send_at(t) == 0 {
                return Err(Error::invalid_argument(format!(
                    "sendbuffs[{t}] is NULL but rank {} holds source data of {}",
                    self.rank,
                    self.tensor_name(t)
                )));
            }
            if dst.is_some() && recv_at(t) == 0 {
                return Err(Error::invalid_argument(format!(
                    "recvbuffs[{t}] is NULL but rank {} receives data of {}",
                    self.rank,
                    self.tensor_name(t)
                )));
            }
            if let (Some(src), Some(dst)) = (src, dst) {
                let (s, d) = (send_at(t), recv_at(t));
                if s < d.saturating_add(dst.bytes as usize)
                    && d < s.saturating_add(src.bytes as usize)
                {
                    return Err(Error::invalid_argument(format!(
                        "sendbuffs[{t}] and recvbuffs[{t}] overlap; in-place reshards are not supported"
                    )));
                }
            }
        }
        Ok(CallBuffers::PerTensor { send, recv })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::{DType, Layout, Mesh, Placement};

    /// A [4, 4] float tensor, Shard(0) over ranks 0 and 1 → Replicate on rank 1: rank 1 holds
    /// 32 source bytes and receives 64.
    fn spec() -> TensorSpec {
        let layout = |ranks: Vec<u32>, p| {
            Layout::new(Mesh::new(vec![ranks.len() as u64], ranks).unwrap(), vec![p])
        };
        TensorSpec {
            shape: vec![4, 4],
            dtype: DType::Float32,
            src: layout(vec![0, 1], Placement::Shard(0)),
            dst: layout(vec![1], Placement::Replicate),
        }
    }

    fn message<T>(result: Result<T>) -> String {
        result.err().expect("an error").message
    }

    #[test]
    fn views_sit_at_their_offsets_and_must_not_overlap_in_single_buffer_calls() {
        let two = [spec(), spec()];
        let names = vec![None, Some("w".to_string())];
        let views = RankViews::new(1, &two, &[(0, 0), (32, 64)], names.clone()).unwrap();
        assert_eq!(views.send_bytes(), 64);
        assert_eq!(views.recv_bytes(), 128);
        assert_eq!(views.src_offsets(), [0, 32]);
        // Rank 0 receives nothing: no destination views, whatever its offsets.
        let sender = RankViews::new(0, &two, &[(0, 0), (32, 0)], names.clone()).unwrap();
        assert_eq!(sender.recv_bytes(), 0);
        // Overlapping views refuse the single-buffer call, not the per-tensor one (which
        // ignores offsets: a plan only ever called per tensor may leave them at 0).
        let overlapping = RankViews::new(1, &two, &[(0, 0), (16, 64)], names.clone()).unwrap();
        let err = message(overlapping.single(0x1000, 0x100000));
        assert!(
            err.starts_with(
                "tensors[1].srcOffset = 16: its view overlaps the view of tensors[0] in sendbuff"
            ) && err.contains("ncclReshardMulti"),
            "{err}"
        );
        assert!(overlapping
            .per_tensor(&[0x1000, 0x2000], &[0x10000, 0x20000])
            .is_ok());
        let err = message(RankViews::new(
            1,
            &two,
            &[(0, 0), (32, i64::MAX as u64)],
            names,
        ));
        assert!(err.contains("tensors[1].dstOffset"), "{err}");
    }

    #[test]
    fn views_back_to_back_are_a_layout_to_receive_in_place_into() {
        let two = [spec(), spec()];
        let names = vec![None, Some("w".to_string())];
        // Rank 1's destination views are 64 bytes: at 0 and 64 they sit back to back.
        let views = RankViews::new(1, &two, &[(0, 0), (32, 64)], names.clone()).unwrap();
        let range = |offset| Some(DstRange { offset, bytes: 64 });
        assert_eq!(views.dst_ranges(), Some(vec![range(0), range(64)]));
        // Overlapping views are no layout (offsets left at 0): the single-buffer call is
        // refused.
        let zero = RankViews::new(1, &two, &[(0, 0), (32, 0)], names).unwrap();
        assert_eq!(zero.dst_ranges(), None);
    }

    #[test]
    fn calls_need_the_buffers_the_rank_uses_and_must_not_work_in_place() {
        let two = [spec(), spec()];
        let names = vec![None, Some("w".to_string())];
        let views = RankViews::new(1, &two, &[(0, 0), (32, 64)], names).unwrap();
        assert!(views.single(0x1000, 0x2000).is_ok());
        let err = message(views.single(0, 0x2000));
        assert!(
            err.starts_with("sendbuff is NULL but rank 1 holds source data of tensors[0]"),
            "{err}"
        );
        // The source reads 64 bytes: a destination 32 bytes on overlaps it.
        let err = message(views.single(0x1000, 0x1020));
        assert!(
            err.contains("overlap; in-place reshards are not supported"),
            "{err}"
        );
        assert!(views
            .per_tensor(&[0x1000, 0x3000], &[0x5000, 0x7000])
            .is_ok());
        let err = message(views.per_tensor(&[0x1000, 0x3000], &[0x5000]));
        assert!(
            err.starts_with("recvbuffs[1] is NULL but rank 1 receives data of tensors[1] (w)"),
            "{err}"
        );
        let err = message(views.per_tensor(&[0x1000, 0x3000], &[0x5000, 0x3010]));
        assert!(
            err.starts_with("sendbuffs[1] and recvbuffs[1] overlap"),
            "{err}"
        );
        // A rank with no views needs no buffers.
        let idle = RankViews::new(7, &two, &[(0, 0), (0, 0)], vec![None, None]).unwrap();
        assert!(idle.single(0, 0).is_ok() && idle.per_tensor(&[], &[]).is_ok());
    }
}
