//! Byte-exact end-to-end checking of a plan on the host executor.
//!
//! Plans every rank, fills each source view with a value derived from the element's global
//! index (and the bytes around strided views with a sentinel), runs all ranks on the host
//! executor, then checks every destination element and that no byte outside the destination
//! views changed. This is what `ncclreshard check` runs.

use crate::reference_quantizer::{self, Converted};
use ncclreshard::error::{Error, Result};
use ncclreshard::exec::{rank_program, NoLimits, StagingLimit};
use ncclreshard::layout::{next_index, RankView, Side, TensorSpec};
use ncclreshard::plan::{Config, Planner, RankProgram};
use ncclreshard::quant::{float, Conversion};
use ncclreshard::transport::host::{execute, RankBuffers};
use ncclreshard::DType;

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

/// The FP32 value element `index` of converted tensor `tensor` carries before its conversion:
/// meaningful floats, per quantization block of `block` elements along each dim of `shape` of
/// one kind: mostly values of a magnitude between 2^-12 and 2^12, and some blocks all zero,
/// of tiny or huge values, or with NaNs or infinities among them.
pub fn float_value(tensor: u32, shape: &[u64], block: &[u64], index: u64) -> f32 {
    let mut rest = index;
    let mut block_id = 0u64;
    for d in (0..shape.len()).rev() {
        let i = rest % shape[d].max(1);
        rest /= shape[d].max(1);
        block_id = block_id
            .wrapping_mul(1_000_003)
            .wrapping_add(i / block[d].max(1));
    }
    let kind = element_value(tensor ^ 0x5a5a, block_id) % 16;
    let h = element_value(tensor, index);
    let unit = (h >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0;
    let magnitude = match kind {
        0 => 0.0,
        1 => 1e-6,
        2 => 1e30,
        _ => 2f64.powi((element_value(tensor ^ 0xa5a5, block_id) % 25) as i32 - 12),
    };
    match kind {
        3 if h % 7 == 0 => f32::NAN,
        4 if h % 11 == 0 => {
            if h & 1 == 0 {
                f32::INFINITY
            } else {
                f32::NEG_INFINITY
            }
        }
        0 if h & 1 == 1 => -0.0,
        _ => (unit * magnitude) as f32,
    }
}

/// The bytes of element `index` of tensor `tensor` in its source dtype: the hash of
/// [`element_value`], or for a converted tensor its [`float_value`] in the source's float type.
pub fn source_element(
    spec: &TensorSpec,
    conversion: Option<&Conversion>,
    tensor: u32,
    index: u64,
) -> [u8; 8] {
    let Some(conversion) = conversion else {
        return element_value(tensor, index).to_le_bytes();
    };
    let block = conversion.block_shape(&spec.shape);
    let x = float_value(tensor, &spec.shape, &block, index);
    let mut out = [0u8; 8];
    match spec.dtype {
        DType::Float32 => out[..4].copy_from_slice(&x.to_le_bytes()),
        DType::Bfloat16 => out[..2].copy_from_slice(&float::f32_to_bf16(x).to_le_bytes()),
        DType::Float16 => out[..2].copy_from_slice(&float::f32_to_f16(x).to_le_bytes()),
        other => panic!("{other} is not a conversion source (validated)"),
    }
    out
}

/// What a converted tensor must hold everywhere once it arrived: the reference quantizer's
/// conversion of the whole tensor its sources hold ([`source_element`]).
pub fn expected_conversion(spec: &TensorSpec, conversion: &Conversion, tensor: u32) -> Converted {
    let elements: u64 = spec.shape.iter().product();
    let size = spec.elem_size() as usize;
    let values: Vec<f32> = (0..elements)
        .map(|i| {
            reference_quantizer::load(
                spec.dtype,
                &source_element(spec, Some(conversion), tensor, i)[..size],
            )
        })
        .collect();
    reference_quantizer::convert_tensor(conversion, &spec.shape, &values)
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

/// Every rank's buffers for a reshard of `tensors` with `conversions` (`None`: none convert),
/// filled as `check` fills them: source views from [`source_element`], destination and scale
/// views with sentinels (scale views after the tensors', as the programs address them).
pub fn rank_buffers(
    tensors: &[TensorSpec],
    conversions: Option<&[Option<Conversion>]>,
    rank: u32,
) -> Result<RankBuffers> {
    let conversion = |t: usize| conversions.and_then(|c| c[t].as_ref());
    let mut memory = RankBuffers::default();
    for (t, spec) in tensors.iter().enumerate() {
        memory.src.push(
            converted_source_view_bytes(spec, conversion(t), t as u32, rank)?.unwrap_or_default(),
        );
        let dst = match conversion(t) {
            Some(c) => converted_destination_view_bytes(spec, c, rank)?,
            None => destination_view_bytes(spec, rank)?,
        };
        memory.dst.push(dst.unwrap_or_default());
    }
    for (t, spec) in tensors.iter().enumerate() {
        if let Some(c) = conversion(t).filter(|c| c.is_scaled()) {
            memory
                .dst
                .push(scale_view_bytes(spec, c, rank)?.unwrap_or_default());
        }
    }
    Ok(memory)
}

/// The bytes of `rank`'s source view of tensor `t` as `check` fills it (each element's value
/// from its global index, sentinels between the elements of a strided view), or `None` when
/// the rank has no source view. Executors other than the host one use it to set up the same
/// data (the GPU tests).
pub fn source_view_bytes(spec: &TensorSpec, t: u32, rank: u32) -> Result<Option<Vec<u8>>> {
    converted_source_view_bytes(spec, None, t, rank)
}

/// [`source_view_bytes`] of a tensor that converts on the way (`conversion`): its elements are
/// [`source_element`]s.
pub fn converted_source_view_bytes(
    spec: &TensorSpec,
    conversion: Option<&Conversion>,
    t: u32,
    rank: u32,
) -> Result<Option<Vec<u8>>> {
    let Some(v) = spec.rank_view(Side::Src, rank) else {
        return Ok(None);
    };
    let mut bytes = alloc(v.view.extent_bytes())?;
    let size = spec.elem_size() as usize;
    for_each_element(&spec.shape, &v, |offset, global| {
        let value = source_element(spec, conversion, t, global);
        bytes[offset..offset + size].copy_from_slice(&value[..size]);
    });
    Ok(Some(bytes))
}

/// The destination view of a converted tensor (`conversion`, in its dtype) as it starts:
/// sentinels everywhere.
pub fn converted_destination_view_bytes(
    spec: &TensorSpec,
    conversion: &Conversion,
    rank: u32,
) -> Result<Option<Vec<u8>>> {
    spec.dst
        .rank_view(&spec.shape, conversion.dtype.size(), rank)
        .map(|v| alloc(v.view.extent_bytes()))
        .transpose()
}

/// A quantized tensor's scale view as it starts (sentinels), if `rank` holds scales.
pub fn scale_view_bytes(
    spec: &TensorSpec,
    conversion: &Conversion,
    rank: u32,
) -> Result<Option<Vec<u8>>> {
    let Some(layout) = conversion.scale_layout(spec) else {
        return Ok(None);
    };
    layout
        .rank_view(
            &conversion.scale_shape(&spec.shape),
            conversion.scale_format.size(),
            rank,
        )
        .map(|v| alloc(v.view.extent_bytes()))
        .transpose()
}

/// Checks `got`, a view of `rank` (holding `view`'s elements of a tensor of `shape`) after a
/// reshard: element with global index i holds `expected[i·size .. (i+1)·size]`, and every byte
/// between elements still holds its sentinel. `what` names the view in errors. Returns the
/// elements checked.
fn verify_view(
    shape: &[u64],
    view: &RankView,
    expected: &[u8],
    size: usize,
    got: &[u8],
    what: &str,
) -> Result<u64> {
    if got.len() as u64 != view.view.extent_bytes() {
        return Err(Error::internal(format!(
            "{what}: the view is {} bytes, not {}",
            got.len(),
            view.view.extent_bytes()
        )));
    }
    let dense = view.view.extent_bytes() == view.view.elements() * size as u64;
    let mut inside = if dense {
        Vec::new()
    } else {
        vec![false; got.len()]
    };
    let mut failure: Option<String> = None;
    let mut checked = 0;
    for_each_element(shape, view, |offset, global| {
        if !dense {
            inside[offset..offset + size]
                .iter_mut()
                .for_each(|b| *b = true);
        }
        let want = &expected[global as usize * size..(global as usize + 1) * size];
        if failure.is_none() && &got[offset..offset + size] != want {
            failure = Some(format!(
                "{what}: element with global index {global} at byte {offset} is {:02x?}, expected {:02x?}",
                &got[offset..offset + size],
                want
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
                "{what}: byte {offset} outside the view was overwritten"
            )));
        }
    }
    Ok(checked)
}

/// Checks `rank`'s destination view of converted tensor `t` against `expected` (from
/// [`expected_conversion`]), bytes between elements included. Returns the elements checked.
pub fn verify_converted_view(
    spec: &TensorSpec,
    conversion: &Conversion,
    expected: &Converted,
    t: u32,
    rank: u32,
    got: &[u8],
) -> Result<u64> {
    let size = conversion.dtype.size();
    let Some(view) = spec.dst.rank_view(&spec.shape, size, rank) else {
        return Ok(0);
    };
    verify_view(
        &spec.shape,
        &view,
        &expected.values,
        size as usize,
        got,
        &format!("tensor {t} ({}) rank {rank}", conversion.dtype),
    )
}

/// Checks `rank`'s scale view of quantized tensor `t` against `expected`. Returns the scales
/// checked.
pub fn verify_scale_view(
    spec: &TensorSpec,
    conversion: &Conversion,
    expected: &Converted,
    t: u32,
    rank: u32,
    got: &[u8],
) -> Result<u64> {
    let Some(layout) = conversion.scale_layout(spec) else {
        return Ok(0);
    };
    let shape = conversion.scale_shape(&spec.shape);
    let size = conversion.scale_format.size();
    let Some(view) = layout.rank_view(&shape, size, rank) else {
        return Ok(0);
    };
    verify_view(
        &shape,
        &view,
        &expected.scales,
        size as usize,
        got,
        &format!(
            "tensor {t}'s scales ({}) rank {rank}",
            conversion.scale_format.name()
        ),
    )
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
    check_with_conversions(tensors, &vec![None; tensors.len()], config)
}

/// [`check`] for tensors that may convert on the way: a converted tensor's destination views
/// and scale views must hold what the reference quantizer makes of the whole tensor.
pub fn check_with_conversions(
    tensors: &[TensorSpec],
    conversions: &[Option<Conversion>],
    config: &Config,
) -> Result<CheckReport> {
    let planner =
        Planner::with_conversions(tensors.to_vec(), conversions.to_vec(), config.clone())?;
    let ranks = planner.ranks();
    let needed = host_bytes_needed(tensors, &ranks);
    if needed > MAX_CHECK_BYTES {
        return Err(Error::invalid_argument(format!(
            "checking this case needs {needed} bytes of host memory for all ranks' views; check is limited to {MAX_CHECK_BYTES}"
        )));
    }
    let programs: Vec<RankProgram> = ranks
        .iter()
        .map(|&r| rank_program(&planner, r, StagingLimit::new(0), &NoLimits))
        .collect::<Result<_>>()?;
    let mut buffers = ranks
        .iter()
        .map(|&rank| rank_buffers(tensors, Some(conversions), rank))
        .collect::<Result<Vec<_>>>()?;
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
    let expected: Vec<Option<Converted>> = tensors
        .iter()
        .zip(conversions)
        .enumerate()
        .map(|(t, (spec, c))| c.as_ref().map(|c| expected_conversion(spec, c, t as u32)))
        .collect();
    for (i, &rank) in ranks.iter().enumerate() {
        let mut scale_slot = tensors.len();
        for (t, spec) in tensors.iter().enumerate() {
            let got = &buffers[i].dst[t];
            report.elements_checked += match (&conversions[t], &expected[t]) {
                (Some(c), Some(e)) => {
                    let mut n = verify_converted_view(spec, c, e, t as u32, rank, got)?;
                    if c.is_scaled() {
                        n += verify_scale_view(
                            spec,
                            c,
                            e,
                            t as u32,
                            rank,
                            &buffers[i].dst[scale_slot],
                        )?;
                        scale_slot += 1;
                    }
                    n
                }
                _ => verify_destination_view(spec, t as u32, rank, got)?,
            };
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
