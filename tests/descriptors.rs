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
                shape,
                dtype,
                src,
                dst,
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
