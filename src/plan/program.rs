//! `RankProgram`: the one IR between the planner and the executors (DESIGN §4).
//!
//! Pure data. Every address is a byte offset relative to one of the rank's buffers: a tensor's
//! source view, a tensor's destination view, or the rank's staging arena. An executor runs a
//! program in four phases: local copies and packs, then every send and receive (posted
//! together, like one NCCL group), then unpacks. Sends to a peer and receives from it are
//! listed in the order both sides post them; sizes match by construction.

/// Which buffer an address is relative to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Buffer {
    /// The source view of tensor `Loc::tensor` (the caller's `sendbuff`).
    Src,
    /// The destination view of tensor `Loc::tensor` (the caller's `recvbuff`).
    Dst,
    /// The rank's staging arena (`RankProgram::staging_bytes` long); `tensor` is unused.
    Staging,
}

/// A byte address: `offset` bytes into a buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Loc {
    pub buffer: Buffer,
    pub tensor: u32,
    pub offset: u64,
}

/// One axis of a strided copy: `count` steps of `src_stride` / `dst_stride` bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CopyDim {
    pub count: u64,
    pub src_stride: u64,
    pub dst_stride: u64,
}

/// A strided block copy: for every point of the `dims` grid (outermost first), copy
/// `chunk_bytes` contiguous bytes. Dims are normalised: no count-1 dims, adjacent dims merged
/// where both sides are contiguous across them, the innermost contiguous span folded into
/// `chunk_bytes`.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Copy {
    pub src: Loc,
    pub dst: Loc,
    pub chunk_bytes: u64,
    pub dims: Vec<CopyDim>,
}

impl Copy {
    /// Builds a normalised copy of `elem_size`-byte elements over `dims` (outermost first).
    pub fn new(src: Loc, dst: Loc, elem_size: u64, dims: &[CopyDim]) -> Copy {
        let mut chunk_bytes = elem_size;
        let mut kept: Vec<CopyDim> = dims.iter().copied().filter(|d| d.count != 1).collect();
        if kept.iter().any(|d| d.count == 0) {
            return Copy {
                src,
                dst,
                chunk_bytes: 0,
                dims: Vec::new(),
            };
        }
        while let Some(inner) = kept.last() {
            if inner.src_stride == chunk_bytes && inner.dst_stride == chunk_bytes {
                chunk_bytes *= inner.count;
                kept.pop();
            } else {
                break;
            }
        }
        let mut merged: Vec<CopyDim> = Vec::with_capacity(kept.len());
        for dim in kept {
            if let Some(inner) = merged.last_mut() {
                // `merged` holds outer dims; `dim` is the next inner one.
                if inner.src_stride == dim.src_stride * dim.count
                    && inner.dst_stride == dim.dst_stride * dim.count
                {
                    *inner = CopyDim {
                        count: inner.count * dim.count,
                        src_stride: dim.src_stride,
                        dst_stride: dim.dst_stride,
                    };
                    continue;
                }
            }
            merged.push(dim);
        }
        Copy {
            src,
            dst,
            chunk_bytes,
            dims: merged,
        }
    }

    /// Bytes this copy moves.
    pub fn bytes(&self) -> u64 {
        // Saturating: the planner's sizes are checked, but a malformed program handed to an
        // executor must fail its bounds checks, not overflow.
        self.dims
            .iter()
            .fold(self.chunk_bytes, |acc, d| acc.saturating_mul(d.count))
    }

    /// True when both sides are one contiguous range.
    pub fn is_contiguous(&self) -> bool {
        self.dims.is_empty()
    }

    /// True when the source side is one contiguous range.
    pub fn src_is_contiguous(&self) -> bool {
        self.side_is_contiguous(|d| d.src_stride)
    }

    /// True when the destination side is one contiguous range.
    pub fn dst_is_contiguous(&self) -> bool {
        self.side_is_contiguous(|d| d.dst_stride)
    }

    fn side_is_contiguous(&self, stride: impl Fn(&CopyDim) -> u64) -> bool {
        let mut run = self.chunk_bytes;
        for d in self.dims.iter().rev() {
            if stride(d) != run {
                return false;
            }
            run *= d.count;
        }
        true
    }

    /// One past the highest source / destination byte touched, relative to the buffers.
    pub fn src_end(&self) -> u64 {
        self.src.offset.saturating_add(self.reach(|d| d.src_stride))
    }

    pub fn dst_end(&self) -> u64 {
        self.dst.offset.saturating_add(self.reach(|d| d.dst_stride))
    }

    fn reach(&self, stride: impl Fn(&CopyDim) -> u64) -> u64 {
        if self.bytes() == 0 {
            return 0;
        }
        self.dims.iter().fold(self.chunk_bytes, |acc, d| {
            acc.saturating_add((d.count - 1).saturating_mul(stride(d)))
        })
    }
}

/// One point-to-point message: `bytes` contiguous bytes at `loc`, to or from `peer`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Message {
    pub peer: u32,
    pub loc: Loc,
    pub bytes: u64,
}

/// How one rank's part of a plan is executed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ExecMode {
    /// Every receive lands in the destination buffer: callable inside a user's NCCL group.
    Groupable,
    /// Some receives land in staging and are unpacked afterwards: not callable inside a group.
    Staged,
}

/// Everything one rank does for one reshard call. Deterministic: every rank computes its own
/// program from the same descriptors, and the sends of one rank to another equal, in order
/// and size, that rank's receives from it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RankProgram {
    pub rank: u32,
    /// Equal on all ranks iff they planned from the same descriptors and config.
    pub fingerprint: u64,
    /// Source → destination copies of data this rank holds on both sides (colocated ranks).
    pub local_copies: Vec<Copy>,
    /// Source → staging copies that gather non-contiguous send data, before the sends.
    pub packs: Vec<Copy>,
    /// Sends, grouped by peer in posting order.
    pub sends: Vec<Message>,
    /// Receives, grouped by peer in posting order.
    pub recvs: Vec<Message>,
    /// Staging → destination copies after the receives complete.
    pub unpacks: Vec<Copy>,
    /// Bytes of staging arena the program addresses.
    pub staging_bytes: u64,
}

impl RankProgram {
    pub fn mode(&self) -> ExecMode {
        if self.unpacks.is_empty() {
            ExecMode::Groupable
        } else {
            ExecMode::Staged
        }
    }

    pub fn bytes_sent(&self) -> u64 {
        self.sends.iter().map(|m| m.bytes).sum()
    }

    pub fn bytes_received(&self) -> u64 {
        self.recvs.iter().map(|m| m.bytes).sum()
    }

    pub fn bytes_copied_locally(&self) -> u64 {
        self.local_copies.iter().map(Copy::bytes).sum()
    }

    /// Distinct ranks this rank sends to or receives from.
    pub fn peers(&self) -> Vec<u32> {
        let mut peers: Vec<u32> = self
            .sends
            .iter()
            .chain(&self.recvs)
            .map(|m| m.peer)
            .collect();
        peers.sort_unstable();
        peers.dedup();
        peers
    }

    /// True when the program has nothing to do (the rank may skip the call).
    pub fn is_empty(&self) -> bool {
        self.local_copies.is_empty() && self.sends.is_empty() && self.recvs.is_empty()
    }
}
