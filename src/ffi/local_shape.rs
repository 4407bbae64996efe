//! `ncclReshardLocalShape`'s body: converts the layout and shape, calls the core
//! ([`Layout::rank_view`]) and writes the outputs.

use super::boundary::array;
use super::decode;
use super::types::*;
use crate::error::{Error, Result};
use crate::layout::validate_shape;
use std::os::raw::c_int;

/// Element size used for the layout's checks: the call has no dtype, and the local shape and
/// index runs do not depend on it.
const ELEM_SIZE: u32 = 1;

/// # Safety
/// Pointers are NULL or valid for the lengths the arguments state.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn local_shape(
    layout: *const ncclReshardLayout_t,
    ndim: c_int,
    shape: *const i64,
    rank: c_int,
    local_shape: *mut i64,
    runs: *mut i64,
    runs_capacity: c_int,
    runs_per_dim: *mut c_int,
) -> Result<()> {
    let n = decode::count(ndim, NCCL_RESHARD_MAX_DIMS, "ndim")?;
    // SAFETY: shape holds ndim entries.
    let global = decode::sizes(unsafe { array(shape, n, "shape") }?, "shape")?;
    // SAFETY: layout is NULL or a valid descriptor whose pointers are NULL or valid.
    let layout = unsafe { decode::layout(layout, n, &"layout", &mut Default::default()) }?;
    validate_shape(&global, ELEM_SIZE)?;
    layout.validate(&global, ELEM_SIZE, "layout")?;
    let rank_u =
        u32::try_from(rank).map_err(|_| Error::invalid_argument(format!("rank is {rank}")))?;
    let view = layout
        .rank_view(&global, ELEM_SIZE, rank_u)
        .ok_or_else(|| {
            Error::invalid_argument(format!(
                "rank {rank} is not in the layout's mesh; it has no local view"
            ))
        })?;
    if local_shape.is_null() && n > 0 {
        return Err(Error::invalid_argument("localShape is NULL"));
    }
    let total_runs: usize = view.indices.iter().map(|r| r.runs().len()).sum();
    if !runs.is_null() {
        if runs_per_dim.is_null() {
            return Err(Error::invalid_argument(
                "runs is given but runsPerDim is NULL",
            ));
        }
        if usize::try_from(runs_capacity).map_or(true, |c| c < total_runs) {
            return Err(Error::invalid_argument(format!(
                "runsCapacity is {runs_capacity} but {total_runs} runs are needed; call with runs = NULL to get runsPerDim first"
            )));
        }
    }
    // All checks passed: write outputs.
    for (d, (&extent, r)) in view.local_shape().iter().zip(&view.indices).enumerate() {
        // SAFETY: localShape holds ndim entries.
        unsafe { local_shape.add(d).write(extent as i64) };
        if !runs_per_dim.is_null() {
            // SAFETY: runsPerDim holds ndim entries.
            unsafe { runs_per_dim.add(d).write(r.runs().len() as c_int) };
        }
    }
    if !runs.is_null() {
        let mut at = 0;
        for r in &view.indices {
            for run in r.runs() {
                // SAFETY: runs holds runsCapacity ≥ total_runs pairs.
                unsafe {
                    runs.add(2 * at).write(run.start as i64);
                    runs.add(2 * at + 1).write(run.end as i64);
                }
                at += 1;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout(mesh_ndim: c_int, placement: ncclReshardPlacement_t) -> ncclReshardLayout_t {
        let mut l = ncclReshardLayout_t {
            size: std::mem::size_of::<ncclReshardLayout_t>(),
            version: 0,
            meshNdim: mesh_ndim,
            meshShape: [0; NCCL_RESHARD_MAX_DIMS],
            ranks: std::ptr::null(),
            firstRank: 0,
            placements: [ncclReshardPlacement_t::default(); NCCL_RESHARD_MAX_DIMS],
            strides: std::ptr::null(),
        };
        l.meshShape[0] = 2;
        l.placements[0] = placement;
        l
    }

    fn error(l: &ncclReshardLayout_t, shape: &[i64]) -> String {
        let mut local = [0i64; NCCL_RESHARD_MAX_DIMS];
        // SAFETY: every pointer is valid for the lengths given; runs are not asked for.
        let result = unsafe {
            local_shape(
                l,
                shape.len() as c_int,
                shape.as_ptr(),
                0,
                local.as_mut_ptr(),
                std::ptr::null_mut(),
                0,
                std::ptr::null_mut(),
            )
        };
        result.expect_err("an invalid layout").message
    }

    #[test]
    fn errors_name_the_layout_argument() {
        let shard = |dim| ncclReshardPlacement_t {
            kind: 1,
            dim,
            splitFactor: 0,
        };
        // Conversion errors name the field inside the layout…
        let message = error(&layout(0, shard(0)), &[8]);
        assert!(message.starts_with("layout->meshNdim is 0"), "{message}");
        // …and so do the core's checks of the layout against the shape…
        let message = error(&layout(1, shard(2)), &[8]);
        assert!(
            message.starts_with("layout: placements[0] = Shard(2) shards dim 2"),
            "{message}"
        );
        // …and of the shape itself.
        let message = error(&layout(1, shard(0)), &[-1]);
        assert!(message.starts_with("shape[0] is -1"), "{message}");
        let mut local = [0i64; 1];
        let l = layout(1, shard(0));
        // SAFETY: as above.
        unsafe {
            local_shape(
                &l,
                1,
                [8i64].as_ptr(),
                1,
                local.as_mut_ptr(),
                std::ptr::null_mut(),
                0,
                std::ptr::null_mut(),
            )
        }
        .unwrap();
        assert_eq!(local, [4]);
    }
}
