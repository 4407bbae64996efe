//! The device encoding of copies (what kernels/copy.cu reads) moves exactly the bytes the host
//! executor's copy semantics move, for the copies real plans contain.

mod oracle;

use ncclreshard::gpu::descriptors::{encode, Addressing, BaseKey, CopyDesc, Encoded};
use ncclreshard::plan::{Buffer, StridedCopy};
use ncclreshard::transport::host::copy_block;
use ncclreshard::{Config, DType, Mode, Planner, TensorSpec};
use oracle::strategies;
use proptest::prelude::*;
use std::collections::HashMap;

fn tensor() -> impl Strategy<Value = TensorSpec> {
    strategies::shape().prop_flat_map(|shape| {
        let n = shape.len();
        (
            Just(shape),
            strategies::layout(n, 8, 4),
            strategies::layout(n, 8, 4),
            prop::sample::select(vec![
                DType::Int8,
                DType::Bfloat16,
                DType::Float32,
                DType::Float64,
            ]),
        )
            .prop_map(|(shape, src, dst, dtype)| TensorSpec {
                src: strategies::fit_blocks(&shape, src),
                dst: strategies::fit_blocks(&shape, dst),
                shape,
                dtype,
            })
    })
}

/// Runs an encoding on host memory exactly as the kernel does (the same offset arithmetic and
/// tile walk; byte-wise instead of vector-wise). `memory` holds every slot's buffer; an
/// address outside a buffer is an error naming the slot.
fn interpret(encoded: &Encoded, memory: &mut HashMap<BaseKey, Vec<u8>>) -> Result<(), String> {
    for launch in &encoded.launches {
        for t in launch.first_tile..launch.first_tile + launch.tiles {
            let tile = encoded.tiles[t as usize];
            let d = &encoded.descs[tile.desc as usize];
            let (src, dst) = (
                launch.bases[d.src_base as usize],
                launch.bases[d.dst_base as usize],
            );
            for byte in tile.start..tile.start + tile.bytes {
                let chunk = byte / d.chunk_bytes;
                let within = byte % d.chunk_bytes;
                let (s, t) = chunk_offsets(d, chunk);
                let value = *memory
                    .get(&src)
                    .and_then(|b| b.get((s + within) as usize))
                    .ok_or_else(|| format!("read outside {src:?} at {}", s + within))?;
                *memory
                    .get_mut(&dst)
                    .and_then(|b| b.get_mut((t + within) as usize))
                    .ok_or_else(|| format!("write outside {dst:?} at {}", t + within))? = value;
            }
        }
    }
    Ok(())
}

/// `chunk_offsets` of kernels/copy.cu: where chunk `chunk` of a descriptor starts on each side.
fn chunk_offsets(d: &CopyDesc, mut chunk: u64) -> (u64, u64) {
    let (mut s, mut t) = (d.src_offset, d.dst_offset);
    for k in (0..d.ndims as usize).rev() {
        let i = chunk % d.count[k];
        chunk /= d.count[k];
        s += i * d.src_stride[k];
        t += i * d.dst_stride[k];
    }
    (s, t)
}

fn key(buffer: Buffer, tensor: u32) -> BaseKey {
    match buffer {
        Buffer::Src => BaseKey::SrcTensor(tensor),
        Buffer::Dst => BaseKey::DstTensor(tensor),
        Buffer::Staging => BaseKey::Staging,
        Buffer::Work => BaseKey::Work,
    }
}

/// Runs one copy both ways from the same source bytes and compares the destinations.
fn compare(copy: &StridedCopy, seed: u8) {
    let src: Vec<u8> = (0..copy.src_end())
        .map(|i| (i as u8).wrapping_mul(31) ^ seed)
        .collect();
    let mut expected = vec![0u8; copy.dst_end() as usize];
    copy_block(
        copy,
        &src[copy.src.offset as usize..],
        &mut expected[copy.dst.offset as usize..],
    );

    let mut memory = HashMap::new();
    memory.insert(key(copy.src.buffer, copy.src.tensor), src.clone());
    memory.insert(
        key(copy.dst.buffer, copy.dst.tensor),
        vec![0u8; copy.dst_end() as usize],
    );
    interpret(
        &encode(std::slice::from_ref(copy), Addressing::PerTensor),
        &mut memory,
    )
    .unwrap_or_else(|e| panic!("{e} for {copy:?}"));
    assert_eq!(
        memory[&key(copy.dst.buffer, copy.dst.tensor)],
        expected,
        "{copy:?}"
    );

    // The single-buffer addressing shifts every view by its tensor's offset.
    let shift = 4096 + 8 * u64::from(copy.src.tensor);
    let offsets = vec![shift; copy.src.tensor.max(copy.dst.tensor) as usize + 1];
    let single = encode(
        std::slice::from_ref(copy),
        Addressing::Single {
            src_offsets: &offsets,
            dst_offsets: &offsets,
        },
    );
    let mut memory = HashMap::new();
    let pad = |b: &[u8], at: Buffer| -> Vec<u8> {
        let mut v = if matches!(at, Buffer::Staging | Buffer::Work) {
            Vec::new()
        } else {
            vec![0u8; shift as usize]
        };
        v.extend_from_slice(b);
        v
    };
    let single_key = |b: Buffer| match b {
        Buffer::Src => BaseKey::SendBuffer,
        Buffer::Dst => BaseKey::RecvBuffer,
        Buffer::Staging => BaseKey::Staging,
        Buffer::Work => BaseKey::Work,
    };
    memory.insert(single_key(copy.src.buffer), pad(&src, copy.src.buffer));
    memory.insert(
        single_key(copy.dst.buffer),
        pad(&vec![0u8; copy.dst_end() as usize], copy.dst.buffer),
    );
    interpret(&single, &mut memory).unwrap_or_else(|e| panic!("{e} for {copy:?}"));
    assert_eq!(
        memory[&single_key(copy.dst.buffer)],
        pad(&expected, copy.dst.buffer),
        "single-buffer addressing of {copy:?}"
    );
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]
    #[test]
    fn encoded_copies_match_the_host_executor(
        tensors in prop::collection::vec(tensor(), 1..=3),
        mode in prop::sample::select(vec![Mode::Groupable, Mode::Staged, Mode::Auto]),
    ) {
        let planner = Planner::new(tensors, Config { mode, ..Default::default() }).expect("valid");
        for rank in planner.ranks() {
            let program = match planner.rank_program(rank) {
                Ok(program) => program,
                // Element-wise interleaving can exceed groupable mode's message cap.
                Err(e) if mode == Mode::Groupable && e.message.contains("groupable mode needs") => continue,
                Err(e) => panic!("plans: {e}"),
            };
            for (i, copy) in program.local_copies.iter().chain(&program.packs).chain(&program.unpacks).enumerate() {
                compare(copy, i as u8);
            }
        }
    }
}

// ---- conversions ----

use ncclreshard::gpu::descriptors::{
    encode_converts, ARITH_E8M0, ARITH_INVERSE, ARITH_SCALED, FANIN, KIND_AMAX, KIND_REDUCE,
    KIND_SCALE, KIND_VALUES, ROWS_GENERAL, ROWS_ONE,
};
use ncclreshard::plan::{ConvertDim, Loc, StridedConvert};
use ncclreshard::quant::{Arithmetic, ScaleEncoding, ScaleFormat};
use ncclreshard::transport::host::convert_box;

/// A conversion descriptor's arithmetic, read back from its `arith` field as the kernel reads it.
fn arithmetic_of(d: &CopyDesc) -> Arithmetic {
    let dtype = |code: u32| DType::from_nccl_code(code as i32).expect("a dtype code");
    Arithmetic {
        src: dtype(d.arith & 0xff),
        dst: dtype((d.arith >> 8) & 0xff),
        scale: (d.arith & ARITH_SCALED != 0).then_some(ScaleEncoding {
            format: if d.arith & ARITH_E8M0 != 0 {
                ScaleFormat::E8m0
            } else {
                ScaleFormat::Float32
            },
            inverse: d.arith & ARITH_INVERSE != 0,
        }),
    }
}

/// `block_at` of kernels/copy.cu: (source, destination offsets, rows, width) of block `b`.
fn block_at(d: &CopyDesc, mut b: u64) -> (u64, u64, u64, u64) {
    let last = d.ndims as usize - 1;
    let (mut s, mut t, mut rows, mut width) = (d.src_offset, d.dst_offset, 1, 0);
    for k in (0..=last).rev() {
        let n = d.count[k].div_ceil(d.block[k]);
        let lo = (b % n) * d.block[k];
        b /= n;
        let extent = d.block[k].min(d.count[k] - lo);
        s += lo * d.src_stride[k];
        t += lo * d.dst_stride[k];
        if k == last {
            width = extent;
        } else {
            rows *= extent;
        }
    }
    (s, t, rows, width)
}

/// `row_offsets` of kernels/copy.cu.
fn row_offsets(d: &CopyDesc, mut b: u64, mut h: u64) -> (u64, u64) {
    if d.row_dim == ROWS_ONE {
        return (0, 0);
    }
    if d.row_dim != ROWS_GENERAL {
        let k = d.row_dim as usize;
        return (h * d.src_stride[k], h * d.dst_stride[k]);
    }
    let last = d.ndims as usize - 1;
    let (mut s, mut t) = (0, 0);
    for k in (0..=last).rev() {
        let n = d.count[k].div_ceil(d.block[k]);
        let lo = (b % n) * d.block[k];
        b /= n;
        if k == last {
            continue;
        }
        let extent = d.block[k].min(d.count[k] - lo);
        s += (h % extent) * d.src_stride[k];
        t += (h % extent) * d.dst_stride[k];
        h /= extent;
    }
    (s, t)
}

/// `partials_level` of kernels/copy.cu: (partials per block, scratch offset) of `level`.
fn partials_level(d: &CopyDesc, level: u32) -> (u64, u64) {
    let (mut p, mut o) = (d.partials, d.partials_offset);
    for _ in 0..level {
        o = (o + 4 * d.blocks * p + 15) & !15;
        p = p.div_ceil(FANIN);
    }
    (p, o)
}

fn f32_at(buffer: &[u8], offset: u64) -> f32 {
    let o = offset as usize;
    f32::from_le_bytes(buffer[o..o + 4].try_into().unwrap())
}

/// Runs conversion passes on host memory with the kernel's item arithmetic (which item is which
/// block, rows and strips; where partials, levels, divisors and scales go), element by element
/// with `crate::quant`'s arithmetic. `memory` holds every slot's buffer.
fn interpret_converts(
    passes: &[Encoded],
    memory: &mut HashMap<BaseKey, Vec<u8>>,
) -> Result<(), String> {
    for encoded in passes {
        for launch in &encoded.launches {
            for t in launch.first_tile..launch.first_tile + launch.tiles {
                let tile = encoded.tiles[t as usize];
                let d = &encoded.descs[tile.desc as usize];
                let key = |slot: u32| launch.bases[slot as usize];
                let (src, dst, scales, work) = (
                    key(d.src_base),
                    key(d.dst_base),
                    key(d.scale_base),
                    key(d.work_base),
                );
                let arith = arithmetic_of(d);
                let (ss, ds) = (u64::from(arith.src.size()), u64::from(arith.dst.size()));
                for item in tile.start..tile.start + tile.bytes {
                    match d.kind {
                        KIND_AMAX | KIND_VALUES => {
                            let (b, i) = (item / d.partials, item % d.partials);
                            let (rho, gamma) = (i / d.strip_groups, i % d.strip_groups);
                            let (bs, bt, rows, width) = block_at(d, b);
                            let last = d.ndims as usize - 1;
                            let per = 16 / ss;
                            let (h0, h1) = (
                                rho * u64::from(d.item_rows),
                                ((rho + 1) * u64::from(d.item_rows)).min(rows),
                            );
                            let divisor = if d.kind == KIND_VALUES && arith.scale.is_some() {
                                f32_at(&memory[&work], d.divisors_offset + 4 * b)
                            } else {
                                1.0
                            };
                            let mut amax = 0.0f32;
                            for h in h0..h1 {
                                for q in 0..u64::from(d.item_strips) {
                                    let first = (gamma + q * d.strip_groups) * per;
                                    if first >= width {
                                        continue;
                                    }
                                    let (rs, rt) = row_offsets(d, b, h);
                                    for e in first..(first + per).min(width) {
                                        let s = (bs + rs + e * d.src_stride[last]) as usize;
                                        let x = arith.load(
                                            memory[&src]
                                                .get(s..s + ss as usize)
                                                .ok_or("read outside the source")?,
                                        );
                                        if d.kind == KIND_AMAX {
                                            amax = ncclreshard::quant::amax([amax, x]);
                                        } else {
                                            let o = (bt + rt + e * d.dst_stride[last]) as usize;
                                            let out = memory
                                                .get_mut(&dst)
                                                .and_then(|m| m.get_mut(o..o + ds as usize))
                                                .ok_or("write outside the destination")?;
                                            arith.convert(x, divisor, out);
                                        }
                                    }
                                }
                            }
                            if d.kind == KIND_AMAX {
                                let o = (d.partials_offset + 4 * item) as usize;
                                memory.get_mut(&work).unwrap()[o..o + 4]
                                    .copy_from_slice(&amax.to_le_bytes());
                            }
                        }
                        KIND_REDUCE => {
                            let (below, below_at) = partials_level(d, d.level - 1);
                            let (per, at) = partials_level(d, d.level);
                            let (b, i) = (item / per, item % per);
                            let m = (i * FANIN..((i + 1) * FANIN).min(below))
                                .map(|j| f32_at(&memory[&work], below_at + 4 * (b * below + j)))
                                .fold(0.0f32, f32::max);
                            let o = (at + 4 * item) as usize;
                            memory.get_mut(&work).unwrap()[o..o + 4]
                                .copy_from_slice(&m.to_le_bytes());
                        }
                        KIND_SCALE => {
                            let b = item;
                            let mut level = 0;
                            let (mut per, mut at) = partials_level(d, 0);
                            while per > FANIN {
                                level += 1;
                                (per, at) = partials_level(d, level);
                            }
                            let amax = (0..per)
                                .map(|j| f32_at(&memory[&work], at + 4 * (b * per + j)))
                                .fold(0.0f32, f32::max);
                            let scale = arith.block_scale(amax);
                            let (mut rest, mut where_) = (b, d.scale_offset);
                            for k in (0..d.ndims as usize).rev() {
                                let n = d.count[k].div_ceil(d.block[k]);
                                where_ += (rest % n) * d.scale_stride[k];
                                rest /= n;
                            }
                            let size = arith.scale.unwrap().format.size() as usize;
                            let w = where_ as usize;
                            memory
                                .get_mut(&scales)
                                .and_then(|m| m.get_mut(w..w + size))
                                .ok_or("scale outside its view")?
                                .copy_from_slice(&scale.stored[..size]);
                            let o = (d.divisors_offset + 4 * b) as usize;
                            memory.get_mut(&work).unwrap()[o..o + 4]
                                .copy_from_slice(&scale.divisor.to_le_bytes());
                        }
                        kind => return Err(format!("unknown kind {kind}")),
                    }
                }
            }
        }
    }
    Ok(())
}

/// Runs one conversion's encoding through [`interpret_converts`] and compares every
/// destination and scale byte with the host executor's semantics ([`convert_box`]).
fn compare_convert(convert: &StridedConvert, src: &[u8]) {
    let encoded = encode_converts(std::slice::from_ref(convert), Addressing::PerTensor);
    let arith = &convert.arithmetic;
    let dst_len = convert.reach(|d| d.dst_stride, u64::from(arith.dst.size())) as usize;
    let scale_len = convert.scale_reach() as usize;
    let mut memory = HashMap::new();
    memory.insert(BaseKey::SrcTensor(0), src.to_vec());
    memory.insert(BaseKey::DstTensor(0), vec![0x5a; dst_len]);
    memory.insert(BaseKey::DstTensor(1), vec![0x5a; scale_len]);
    memory.insert(BaseKey::Scratch, vec![0xa5; encoded.scratch_bytes as usize]);
    interpret_converts(&encoded.passes, &mut memory).unwrap_or_else(|e| panic!("{e}: {convert:?}"));
    let (values, scales) = convert_box(convert, src);
    let mut want = vec![0x5a; dst_len];
    for (o, v) in values {
        want[o..o + arith.dst.size() as usize].copy_from_slice(&v[..arith.dst.size() as usize]);
    }
    let mut want_scales = vec![0x5a; scale_len];
    for (o, v) in scales {
        want_scales[o..o + v.len()].copy_from_slice(&v);
    }
    assert!(
        memory[&BaseKey::DstTensor(0)] == want,
        "values of {convert:?}"
    );
    assert!(
        memory[&BaseKey::DstTensor(1)] == want_scales,
        "scales of {convert:?}"
    );
}

/// A box of `counts` (outermost first) with blocks `blocks` (a cast: all 1), source strides
/// padded by `pad` elements per dim (or its two last dims transposed), a dense destination and
/// a dense scale grid.
fn convert_of(
    counts: &[u64],
    blocks: &[u64],
    arithmetic: Arithmetic,
    pad: u64,
    transposed: bool,
) -> StridedConvert {
    let (ss, ds) = (
        u64::from(arithmetic.src.size()),
        u64::from(arithmetic.dst.size()),
    );
    let n = counts.len();
    let dense = |size: u64, pad: u64| {
        let mut strides = vec![0u64; n];
        let mut run = size;
        for k in (0..n).rev() {
            strides[k] = run;
            run *= counts[k] + pad;
        }
        strides
    };
    let mut src = dense(ss, pad);
    if transposed && n >= 2 {
        // Column-major over the last two dims.
        src[n - 1] = ss * (counts[n - 2] + pad);
        src[n - 2] = ss;
    }
    let dst = dense(ds, 0);
    let size = arithmetic.scale.map_or(0, |s| u64::from(s.format.size()));
    let mut scale = vec![0u64; n];
    let mut run = size;
    for k in (0..n).rev() {
        scale[k] = run;
        run *= counts[k].div_ceil(blocks[k]);
    }
    let loc = |buffer, tensor| Loc {
        buffer,
        tensor,
        offset: 0,
    };
    StridedConvert {
        tensor: 0,
        start: vec![0; n],
        src: loc(Buffer::Src, 0),
        dst: loc(Buffer::Dst, 0),
        scale: arithmetic.scale.map(|_| loc(Buffer::Dst, 1)),
        dims: (0..n)
            .map(|k| ConvertDim {
                count: counts[k],
                src_stride: src[k],
                dst_stride: dst[k],
                block: blocks[k],
                scale_stride: scale[k],
            })
            .collect(),
        arithmetic,
    }
}

fn source_bytes(len: usize, seed: u64) -> Vec<u8> {
    // Mostly ordinary magnitudes, with NaNs and infinities where the pattern lands on them.
    (0..len)
        .map(|i| ((i as u64).wrapping_mul(0x9e37_79b9).wrapping_add(seed) >> 7) as u8 ^ 0x20)
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]
    #[test]
    fn encoded_conversions_match_the_host_executor(
        counts in prop::collection::vec(1u64..24, 1..=3),
        block_seed in prop::collection::vec(1u64..40, 3),
        src in prop::sample::select(vec![DType::Float32, DType::Bfloat16, DType::Float16]),
        dst in prop::sample::select(vec![DType::Float8E4M3, DType::Float8E5M2, DType::Bfloat16, DType::Float16]),
        e8m0 in any::<bool>(),
        inverse in any::<bool>(),
        pad in 0u64..3,
        transposed in any::<bool>(),
        wide in any::<bool>(),
        seed in any::<u64>(),
    ) {
        prop_assume!(src != dst);
        let mut counts = counts;
        if wide {
            // Rows longer than a strip group: items of several strips or many partials.
            *counts.last_mut().unwrap() *= 9;
        }
        let scaled = matches!(dst, DType::Float8E4M3 | DType::Float8E5M2);
        let arithmetic = Arithmetic {
            src,
            dst,
            scale: scaled.then_some(ScaleEncoding {
                format: if e8m0 { ScaleFormat::E8m0 } else { ScaleFormat::Float32 },
                inverse,
            }),
        };
        let blocks: Vec<u64> = counts
            .iter()
            .zip(&block_seed)
            .map(|(&c, &b)| if scaled { b.min(c + 3) } else { 1 })
            .collect();
        let convert = convert_of(&counts, &blocks, arithmetic, pad, transposed);
        let len = convert.reach(|d| d.src_stride, u64::from(src.size())) as usize;
        compare_convert(&convert, &source_bytes(len, seed));
    }
}

#[test]
fn large_blocks_fold_their_partials_level_by_level() {
    // One block of 300 x 600 bfloat16 (per tensor): 190 partials, one reduction level; and
    // 1 x 4000 blocks (per channel): items of 16 strips, partials folded without a level.
    let arithmetic = Arithmetic {
        src: DType::Bfloat16,
        dst: DType::Float8E4M3,
        scale: Some(ScaleEncoding {
            format: ScaleFormat::Float32,
            inverse: false,
        }),
    };
    for (counts, blocks) in [
        (vec![300u64, 600], vec![300u64, 600]),
        (vec![3, 4000], vec![1, 4000]),
        (vec![2, 7, 5, 9], vec![2, 7, 5, 9]),
    ] {
        let convert = convert_of(&counts, &blocks, arithmetic, 0, false);
        let passes = encode_converts(std::slice::from_ref(&convert), Addressing::PerTensor);
        let len = convert.reach(|d| d.src_stride, 2) as usize;
        compare_convert(&convert, &source_bytes(len, 7));
        if counts[0] == 300 {
            assert!(
                passes
                    .passes
                    .iter()
                    .any(|p| p.descs.iter().any(|d| d.kind == KIND_REDUCE)),
                "a reduction pass"
            );
        }
    }
}

/// Byte ranges a row's lanes store (destination offsets) and read (source offsets, from the
/// row's first byte; negative: before it).
type RowSplit = (Vec<(u32, u32)>, Vec<(i64, i64)>);

/// `issue_piece` of kernels/copy.cu for every lane of every piece of a row of `len` bytes whose
/// first destination byte is `r` past a 16-byte boundary and whose source is `delta` past the
/// destination's alignment: the byte ranges it stores (destination offsets from the row's
/// start) and reads (source offsets), including the overflow elements the last piece copies.
fn row_split(len: u32, r: u32, delta: u32, width: u32) -> RowSplit {
    let units = (len + r + 15) >> 4;
    let mut g = 1;
    while g < units && g < 32 {
        g <<= 1;
    }
    let pieces = units.div_ceil(g);
    let (mut stores, mut reads) = (Vec::new(), Vec::new());
    let span = len + r;
    let k_lo = (r + delta + 15) >> 4;
    let top = (span + delta) >> 4;
    let k_hi = if delta != 0 {
        top.saturating_sub(1)
    } else {
        span >> 4
    };
    let interior = k_hi > k_lo;
    let head = if interior { 16 * k_lo - r } else { len };
    let tail = if interior { span - 16 * k_hi } else { 0 };
    let elements = (head + tail) / width;
    let at = |e: u32| {
        if e * width < head {
            e * width
        } else {
            len - tail + (e * width - head)
        }
    };
    let element = |e: u32, stores: &mut Vec<(u32, u32)>, reads: &mut Vec<(i64, i64)>| {
        stores.push((at(e), at(e) + width));
        reads.push((i64::from(at(e)), i64::from(at(e) + width)));
    };
    for piece in 0..pieces {
        for lane in 0..g {
            let k = k_lo + piece * g + lane;
            if interior && k < k_hi {
                // A whole 16-byte unit of the destination, from one or two aligned words.
                let o = 16 * k - r;
                assert_eq!((o + r) % 16, 0);
                stores.push((o, o + 16));
                let word = i64::from(o) - i64::from(delta);
                reads.push((word, word + if delta != 0 { 32 } else { 16 }));
            }
            if piece * g + lane < elements {
                element(piece * g + lane, &mut stores, &mut reads);
            }
            if piece + 1 == pieces {
                let mut x = pieces * g + lane;
                while x < elements {
                    element(x, &mut stores, &mut reads);
                    x += g;
                }
            }
        }
    }
    (stores, reads)
}

#[test]
fn every_row_is_cut_into_units_and_edges_that_cover_it_once_and_read_only_it() {
    for len in 1..=700u32 {
        for r in 0..16 {
            for delta in 0..16 {
                // The widest edge width the row's ends allow (source, destination, length).
                for width in [1u32, 2, 4] {
                    if (r | (r + delta) | len) % width != 0 {
                        continue;
                    }
                    let (stores, reads) = row_split(len, r, delta, width);
                    let mut covered = vec![0u8; len as usize];
                    for &(a, b) in &stores {
                        assert!(
                            b <= len,
                            "len {len} r {r} delta {delta}: store past the row"
                        );
                        for byte in a..b {
                            covered[byte as usize] += 1;
                        }
                    }
                    assert!(
                        covered.iter().all(|&c| c == 1),
                        "len {len} r {r} delta {delta} width {width}: bytes stored {covered:?}"
                    );
                    for &(a, b) in &reads {
                        assert!(
                            a >= 0 && b <= i64::from(len),
                            "len {len} r {r} delta {delta}: reads [{a}, {b}) outside the row"
                        );
                    }
                }
            }
        }
    }
}
