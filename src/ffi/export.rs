//! The C form of a plan's data: `ncclReshardPlanInfo_t` and `ncclReshardTransfer_t` from the
//! core's [`Plan`] and its [`Export`](crate::exec::Export) (how each location and dtype is
//! named in C).

use super::types::*;
use crate::error::{Error, Result};
use crate::exec::Plan;
use crate::plan::{region_of, Buffer, Loc, Mode, StridedConvert, WorkRegion};
use std::os::raw::c_int;

/// What `ncclReshardPlanGetInfo` reports of `plan`.
pub(crate) fn info(plan: &Plan) -> ncclReshardPlanInfo_t {
    let p = plan.program();
    ncclReshardPlanInfo_t {
        size: std::mem::size_of::<ncclReshardPlanInfo_t>(),
        version: super::NCCL_RESHARD_VERSION_CODE as u32,
        rank: plan.rank() as c_int,
        ntensors: plan.ntensors() as c_int,
        mode: plan.mode() as c_int,
        groupable: c_int::from(plan.mode() == Mode::Groupable),
        peers: p.peers().len() as c_int,
        messagesSent: p.sends.len() as i64,
        messagesReceived: p.recvs.len() as i64,
        bytesSent: p.bytes_sent(),
        bytesReceived: p.bytes_received(),
        bytesCopied: p.bytes_copied_locally(),
        stagingBytes: plan
            .placed()
            .map_or(p.staging_bytes, |q| q.staging_bytes.max(p.staging_bytes)),
        fingerprint: p.fingerprint,
        sendBytes: plan.views().send_bytes(),
        recvBytes: plan.views().recv_bytes(),
        rounds: p.rounds().len() as c_int,
        scaleTensors: (plan.ndestinations() - plan.ntensors()) as c_int,
        workBytes: p.work_bytes,
    }
}

/// The C form of every transfer of `plan`, in export order (see `ncclReshardTransfer_t`): the
/// transfers by round, each round's conversions of what it sends before them, the conversions
/// after the last round.
pub(crate) fn transfers(plan: &Plan) -> Result<Vec<ncclReshardTransfer_t>> {
    let export = plan.export()?;
    let rank = plan.rank();
    // A location as the export names it: (view, offset in it).
    let view_of = |loc: Loc| -> (ncclReshardView_t, u64) {
        let view = match loc.buffer {
            Buffer::Src => ncclReshardView_t::ncclReshardViewSource,
            Buffer::Dst | Buffer::Staging => ncclReshardView_t::ncclReshardViewDestination,
            Buffer::Work => match region_of(loc.tensor).1 {
                WorkRegion::Converted => ncclReshardView_t::ncclReshardViewConverted,
                WorkRegion::Scales => ncclReshardView_t::ncclReshardViewScales,
                WorkRegion::Unconverted => ncclReshardView_t::ncclReshardViewUnconverted,
            },
        };
        (view, loc.offset)
    };
    // The element types of a block's bytes: the tensor's source dtype where they land
    // unconverted (in the receiver's workspace), else its destination dtype (its dtype
    // when it does not convert); scales move as bytes.
    let dtypes_of = |tensor: u32, dst: Loc| -> (c_int, c_int) {
        match plan.dtypes().get(tensor as usize) {
            None => (NCCL_UINT8, NCCL_UINT8),
            Some(&(from, _)) if dst.buffer == Buffer::Work => (from.nccl_code(), from.nccl_code()),
            Some(&(_, to)) => (to.nccl_code(), to.nccl_code()),
        }
    };
    let mut out = Vec::new();
    let convert = |c: &StridedConvert, round: u32| -> ncclReshardTransfer_t {
        let (src_view, src_offset) = view_of(c.src);
        let (dst_view, dst_offset) = view_of(c.dst);
        let (scale_view, scale_offset) = c
            .scale
            .map_or((ncclReshardView_t::ncclReshardViewDestination, 0), view_of);
        let mut t = ncclReshardTransfer_t {
            size: std::mem::size_of::<ncclReshardTransfer_t>(),
            version: super::NCCL_RESHARD_VERSION_CODE as u32,
            kind: ncclReshardTransferKind_t::ncclReshardTransferConvert as c_int,
            peer: rank as c_int,
            tensor: c.tensor as c_int,
            ndim: c.dims.len() as c_int,
            srcOffset: src_offset,
            dstOffset: dst_offset,
            chunkBytes: 0,
            copyNdim: c.dims.len() as c_int,
            bytes: c.dst_bytes(),
            round: round as c_int,
            srcView: src_view as c_int,
            blockOffset: 0,
            blockBytes: c.dst_bytes(),
            dstView: dst_view as c_int,
            srcDtype: c.arithmetic.src.nccl_code(),
            dstDtype: c.arithmetic.dst.nccl_code(),
            scaleView: scale_view as c_int,
            scaleOffset: scale_offset,
            ..Default::default()
        };
        for (d, dim) in c.dims.iter().enumerate() {
            t.count[d] = dim.count as i64;
            t.srcStride[d] = dim.src_stride as i64;
            t.dstStride[d] = dim.dst_stride as i64;
            t.scaleStride[d] = dim.scale_stride as i64;
        }
        for (d, (&start, dim)) in c.start.iter().zip(&c.dims).enumerate() {
            t.globalStart[d] = start as i64;
            t.globalCount[d] = dim.count as i64;
        }
        t
    };
    // Each round's conversions come before its transfers (both are in round order).
    let mut converts = export.converts_before.iter().peekable();
    for transfer in &export.transfers {
        while let Some((round, c)) = converts.next_if(|&&(round, _)| round <= transfer.round) {
            out.push(convert(c, *round));
        }
        let b = &export.blocks[transfer.block];
        let (kind, peer) = if b.from == b.to {
            (ncclReshardTransferKind_t::ncclReshardTransferLocal, b.to)
        } else if b.from == rank {
            (ncclReshardTransferKind_t::ncclReshardTransferSend, b.to)
        } else {
            (ncclReshardTransferKind_t::ncclReshardTransferRecv, b.from)
        };
        if transfer.copy.src.buffer == Buffer::Staging {
            return Err(Error::internal(format!(
                "block {} of rank {} reads the staging arena",
                transfer.block, rank
            )));
        }
        let (src_view, src_offset) = view_of(transfer.copy.src);
        let (dst_view, dst_offset) = view_of(transfer.copy.dst);
        let (src_dtype, dst_dtype) = dtypes_of(b.tensor, transfer.copy.dst);
        let mut t = ncclReshardTransfer_t {
            size: std::mem::size_of::<ncclReshardTransfer_t>(),
            version: super::NCCL_RESHARD_VERSION_CODE as u32,
            kind: kind as c_int,
            peer: peer as c_int,
            tensor: b.tensor as c_int,
            ndim: b.start.len() as c_int,
            srcOffset: src_offset,
            dstOffset: dst_offset,
            chunkBytes: transfer.copy.chunk_bytes,
            copyNdim: transfer.copy.dims.len() as c_int,
            bytes: transfer.copy.bytes(),
            round: transfer.round as c_int,
            srcView: src_view as c_int,
            blockOffset: transfer.offset,
            blockBytes: b.copy.bytes(),
            dstView: dst_view as c_int,
            srcDtype: src_dtype,
            dstDtype: dst_dtype,
            scaleView: ncclReshardView_t::ncclReshardViewDestination as c_int,
            ..Default::default()
        };
        for (d, (&s, &c)) in b.start.iter().zip(&b.count).enumerate() {
            t.globalStart[d] = s as i64;
            t.globalCount[d] = c as i64;
        }
        for (d, dim) in transfer.copy.dims.iter().enumerate() {
            t.count[d] = dim.count as i64;
            t.srcStride[d] = dim.src_stride as i64;
            t.dstStride[d] = dim.dst_stride as i64;
        }
        out.push(t);
    }
    for (round, c) in converts {
        out.push(convert(c, *round));
    }
    let last = plan.program().rounds().last().map_or(0, |r| r.round + 1);
    for c in &export.converts_after {
        out.push(convert(c, last));
    }
    Ok(out)
}

/// `ncclUint8`: the type scales travel as in the export.
const NCCL_UINT8: c_int = 1;
