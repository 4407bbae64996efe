//! Byte-exact end-to-end checking of a plan on the host executor.
//!
//! Plans every rank, fills each source view with a value derived from the element's global
//! index (and the bytes around strided views with a sentinel), runs all ranks on the host
//! executor, then checks every destination element and that no byte outside the destination
//! views changed. This is what `ncclreshard check` runs.

use ncclreshard::error::{Error, Result};
use ncclreshard::exec::host::{execute, RankBuffers};
use ncclreshard::layout::{next_index, RankView, Side, TensorSpec};
use ncclreshard::plan::{Config, Planner, RankProgram};

/// What a successful check moved and verified.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CheckReport {
    pub ranks: usize,
    pub elements_checked: u64,
    pub bytes_sent: u64,
    pub bytes_copied_locally: u64,
    pub messages: u64,
    pub staged_ranks: usize,
}

/// The value element `index` (row-major global linear index) of tensor `tensor` carries, as
/// little-endian bytes truncated to the element size. A hash, so that a misplaced element
/// almost never matches by chance even with 1-byte elements across many elements.
pub fn element_value(tensor: u32, index: u64) -> u64 {
    let mut z = index ^ (u64::from(tensor) << 48) ^ 0x9e37_79b9_7f4a_7c15;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The byte a position outside every view holds before and after the reshard.
pub fn sentinel(offset: usize) -> u8 {
    0xa5 ^ (offset as u8).wrapping_mul(31)
}

/// Calls `f(byte offset in the view, global linear index)` for every element of a rank's view.
fn for_each_element(shape: &[u64], rank_view: &RankView, mut f: impl FnMut(usize, u64)) {
    let RankView { indices, view } = rank_view;
    if view.elements() == 0 {
        return;
    }
    let ndim = shape.len();
    // Per dim, the global indices of local positions (per dim, not per element).
    let globals: Vec<Vec<u64>> = indices
        .iter()
        .map(|r| r.runs().iter().flat_map(|run| run.start..run.end).collect())
        .collect();
    let global_strides = ncclreshard::layout::row_major_strides(shape);
    let byte_strides = view.byte_strides();
    let mut pos = vec![0usize; ndim];
    loop {
        let mut offset = 0u64;
        let mut global = 0u64;
        for d in 0..ndim {
            offset += pos[d] as u64 * byte_strides[d];
            global += globals[d][pos[d]] * global_strides[d];
        }
        f(offset as usize, global);
        if !next_index(&mut pos, |d| globals[d].len()) {
            return;
        }
    }
}

/// The most host memory `check` allocates for all ranks' views together.
pub const MAX_CHECK_BYTES: u64 = 16 << 30;

fn alloc(extent: u64) -> Result<Vec<u8>> {
    let len = usize::try_from(extent)
        .map_err(|_| Error::invalid_argument("view too large for this host"))?;
    let mut bytes = Vec::new();
    bytes.try_reserve_exact(len).map_err(|_| {
        Error::invalid_argument(format!("cannot allocate a {extent}-byte view on this host"))
    })?;
    bytes.extend((0..len).map(sentinel));
    Ok(bytes)
}

/// Host bytes `check` needs: every rank's source and destination views.
fn host_bytes_needed(tensors: &[TensorSpec], ranks: &[u32]) -> u64 {
    let mut total = 0u64;
    for &rank in ranks {
        for spec in tensors {
            for side in [Side::Src, Side::Dst] {
                if let Some(v) = spec.rank_view(side, rank) {
                    total = total.saturating_add(v.view.extent_bytes());
                }
            }
        }
    }
    total
}

/// The bytes of `rank`'s source view of tensor `t` as `check` fills it (each element's value
/// from its global index, sentinels between the elements of a strided view), or `None` when
/// the rank has no source view. Executors other than the host one use it to set up the same
/// data (the GPU tests).
pub fn source_view_bytes(spec: &TensorSpec, t: u32, rank: u32) -> Result<Option<Vec<u8>>> {
    let Some(v) = spec.rank_view(Side::Src, rank) else {
        return Ok(None);
    };
    let mut bytes = alloc(v.view.extent_bytes())?;
    let size = spec.elem_size() as usize;
    for_each_element(&spec.shape, &v, |offset, global| {
        let value = element_value(t, global).to_le_bytes();
        bytes[offset..offset + size].copy_from_slice(&value[..size]);
    });
    Ok(Some(bytes))
}

/// A destination view as it starts: sentinels everywhere (`None` when `rank` has no view).
pub fn destination_view_bytes(spec: &TensorSpec, rank: u32) -> Result<Option<Vec<u8>>> {
    spec.rank_view(Side::Dst, rank)
        .map(|v| alloc(v.view.extent_bytes()))
        .transpose()
}

/// Checks `rank`'s destination view of tensor `t` after a reshard: every element holds its
/// value and every byte between elements still holds its sentinel. Returns the elements
/// checked.
pub fn verify_destination_view(spec: &TensorSpec, t: u32, rank: u32, got: &[u8]) -> Result<u64> {
    let Some(v) = spec.rank_view(Side::Dst, rank) else {
        return Ok(0);
    };
    let view = &v.view;
    if got.len() as u64 != view.extent_bytes() {
        return Err(Error::internal(format!(
            "tensor {t} rank {rank}: the destination view is {} bytes, not {}",
            got.len(),
            view.extent_bytes()
        )));
    }
    let size = spec.elem_size() as usize;
    let mask = if size == 8 {
        u64::MAX
    } else {
        (1u64 << (8 * size)) - 1
    };
    // A dense view has no bytes between its elements, so only strided views need the map of
    // which bytes belong to elements.
    let dense = view.extent_bytes() == view.elements() * size as u64;
    let mut inside = if dense {
        Vec::new()
    } else {
        vec![false; got.len()]
    };
    let mut failure: Option<String> = None;
    let mut checked = 0;
    for_each_element(&spec.shape, &v, |offset, global| {
        if !dense {
            inside[offset..offset + size]
                .iter_mut()
                .for_each(|b| *b = true);
        }
        let mut bytes = [0u8; 8];
        bytes[..size].copy_from_slice(&got[offset..offset + size]);
        let want = element_value(t, global) & mask;
        if failure.is_none() && u64::from_le_bytes(bytes) != want {
            failure = Some(format!(
                "tensor {t} rank {rank}: element with global index {global} at byte {offset} is {:02x?}, expected {:02x?}",
                &got[offset..offset + size],
                &want.to_le_bytes()[..size]
            ));
        }
        checked += 1;
    });
    if let Some(message) = failure {
        return Err(Error::internal(message));
    }
    if !dense {
        if let Some(offset) = (0..got.len()).find(|&o| !inside[o] && got[o] != sentinel(o)) {
            return Err(Error::internal(format!(
                "tensor {t} rank {rank}: byte {offset} outside the destination view was overwritten"
            )));
        }
    }
    Ok(checked)
}

/// Plans, executes and verifies a reshard of `tensors` under `config` on the host.
pub fn check(tensors: &[TensorSpec], config: &Config) -> Result<CheckReport> {
    let planner = Planner::new(tensors.to_vec(), config.clone())?;
    let ranks = planner.ranks();
    let needed = host_bytes_needed(tensors, &ranks);
    if needed > MAX_CHECK_BYTES {
        return Err(Error::invalid_argument(format!(
            "checking this case needs {needed} bytes of host memory for all ranks' views; check is limited to {MAX_CHECK_BYTES}"
        )));
    }
    let programs: Vec<RankProgram> = ranks
        .iter()
        .map(|&r| planner.rank_program(r))
        .collect::<Result<_>>()?;
    let mut buffers = Vec::with_capacity(ranks.len());
    for &rank in &ranks {
        let mut memory = RankBuffers::default();
        for (t, spec) in tensors.iter().enumerate() {
            memory
                .src
                .push(source_view_bytes(spec, t as u32, rank)?.unwrap_or_default());
            memory
                .dst
                .push(destination_view_bytes(spec, rank)?.unwrap_or_default());
        }
        buffers.push(memory);
    }
    execute(&programs, &mut buffers)?;

    let mut report = CheckReport {
        ranks: ranks.len(),
        ..Default::default()
    };
    for p in &programs {
        report.bytes_sent += p.bytes_sent();
        report.bytes_copied_locally += p.bytes_copied_locally();
        report.messages += p.sends.len() as u64;
        report.staged_ranks += usize::from(!p.unpacks.is_empty());
    }
    for (i, &rank) in ranks.iter().enumerate() {
        for (t, spec) in tensors.iter().enumerate() {
            report.elements_checked +=
                verify_destination_view(spec, t as u32, rank, &buffers[i].dst[t])?;
        }
    }
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;
    use ncclreshard::layout::{DType, Layout, Mesh, Placement};

    #[test]
    fn verification_catches_a_wrong_element_and_a_clobbered_gap() {
        let mut spec = TensorSpec {
            shape: vec![4, 3],
            dtype: DType::Bfloat16,
            src: Layout::new(
                Mesh::new(vec![1], vec![0]).unwrap(),
                vec![Placement::Replicate],
            ),
            dst: Layout::new(
                Mesh::new(vec![1], vec![0]).unwrap(),
                vec![Placement::Replicate],
            ),
        };
        for strides in [None, Some(vec![4, 1])] {
            spec.dst.strides = strides.clone();
            spec.src.strides = strides;
            // The source view holds exactly what a correct destination must hold.
            let good = source_view_bytes(&spec, 0, 0).unwrap().unwrap();
            assert_eq!(verify_destination_view(&spec, 0, 0, &good).unwrap(), 12);
            let mut wrong = good.clone();
            wrong[2] ^= 1;
            let err = verify_destination_view(&spec, 0, 0, &wrong).unwrap_err();
            assert!(err.message.contains("global index 1"), "{err}");
            if spec.dst.strides.is_some() {
                let mut clobbered = good.clone();
                clobbered[6] ^= 0xff; // the padding element after row 0
                let err = verify_destination_view(&spec, 0, 0, &clobbered).unwrap_err();
                assert!(
                    err.message.contains("outside the destination view"),
                    "{err}"
                );
            }
        }
    }
}
