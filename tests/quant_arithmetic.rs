//! The library's conversion arithmetic (`ncclreshard::quant`, which the host executor runs)
//! against the reference quantizer (`ncclreshard_tools::reference_quantizer`, written from the
//! published definitions by search, not bit manipulation): every bfloat16 and float16 input
//! exhaustively, random FP32 bit patterns, and random blocks (zeros, NaN, infinities, huge
//! and tiny values) under every scale encoding.

use ncclreshard::quant::{amax, float, Arithmetic, Conversion, ScaleFormat, Scheme};
use ncclreshard::DType;
use ncclreshard_tools::reference_quantizer as reference;
use proptest::prelude::*;

const TARGETS: [DType; 4] = [
    DType::Bfloat16,
    DType::Float16,
    DType::Float8E4M3,
    DType::Float8E5M2,
];

fn library_encode(dtype: DType, x: f32) -> u32 {
    match dtype {
        DType::Bfloat16 => u32::from(float::f32_to_bf16(x)),
        DType::Float16 => u32::from(float::f32_to_f16(x)),
        DType::Float8E4M3 => u32::from(float::f32_to_e4m3fn(x)),
        DType::Float8E5M2 => u32::from(float::f32_to_e5m2(x)),
        other => panic!("{other}"),
    }
}

fn check_all_targets(x: f32) {
    for dtype in TARGETS {
        assert_eq!(
            library_encode(dtype, x),
            reference::encode(dtype, x),
            "{x:e} ({:#010x}) to {dtype}",
            x.to_bits()
        );
    }
}

#[test]
fn every_bfloat16_and_float16_value_converts_as_the_reference_says() {
    for bits in 0..=u16::MAX {
        let from_bf16 = float::bf16_to_f32(bits);
        let reference_bf16 = reference::load(DType::Bfloat16, &bits.to_le_bytes());
        assert!(
            from_bf16.to_bits() == reference_bf16.to_bits()
                || (from_bf16.is_nan() && reference_bf16.is_nan()),
            "bf16 {bits:#x}"
        );
        check_all_targets(from_bf16);
        let from_f16 = float::f16_to_f32(bits);
        let reference_f16 = reference::load(DType::Float16, &bits.to_le_bytes());
        assert!(
            from_f16.to_bits() == reference_f16.to_bits()
                || (from_f16.is_nan() && reference_f16.is_nan()),
            "f16 {bits:#x}"
        );
        check_all_targets(from_f16);
    }
}

#[test]
fn values_around_every_rounding_boundary_convert_as_the_reference_says() {
    // Midpoints between neighbouring FP8 and float16 values, and one FP32 ulp either side:
    // where round-to-nearest-even and saturation decide.
    for dtype in TARGETS {
        let codes: u32 = 1 << (8 * dtype.size() - 1);
        let values: Vec<f64> = (0..codes)
            .map(|c| reference::decode(dtype, c))
            .filter(|v| v.is_finite())
            .collect();
        for w in values.windows(2) {
            let mid = ((w[0] + w[1]) / 2.0) as f32;
            for x in [
                mid,
                f32::from_bits(mid.to_bits() + 1),
                f32::from_bits(mid.to_bits().saturating_sub(1)),
            ] {
                check_all_targets(x);
                check_all_targets(-x);
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 20_000, ..ProptestConfig::default() })]

    #[test]
    fn random_fp32_bit_patterns_convert_as_the_reference_says(bits in any::<u32>()) {
        check_all_targets(f32::from_bits(bits));
    }
}

/// A block's values: a magnitude class (zeros, tiny, ordinary, huge) with optional NaN and
/// infinity sprinkled in, as FP32 values representable in `src`.
fn block_values(src: DType) -> impl Strategy<Value = Vec<f32>> {
    let magnitude = prop_oneof![
        Just(0.0f32),
        Just(1e-30f32),
        Just(1e-6f32),
        Just(1.0f32),
        Just(3e4f32),
        Just(1e30f32),
    ];
    (magnitude, 1usize..64, any::<u64>(), 0u8..8).prop_map(move |(scale, len, seed, special)| {
        let mut state = seed | 1;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        (0..len)
            .map(|i| {
                let r = next();
                let unit = (r >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0;
                let mut x = (unit * f64::from(scale)) as f32;
                if special == 1 && i == 0 {
                    x = f32::NAN;
                }
                if special == 2 && i == len / 2 {
                    x = f32::INFINITY;
                }
                if special == 3 && i == 0 {
                    x = -0.0;
                }
                // Representable in the source type.
                match src {
                    DType::Bfloat16 => float::bf16_to_f32(float::f32_to_bf16(x)),
                    DType::Float16 => float::f16_to_f32(float::f32_to_f16(x)),
                    _ => x,
                }
            })
            .collect()
    })
}

fn conversions() -> impl Strategy<Value = (DType, Conversion)> {
    (
        prop_oneof![
            Just(DType::Float32),
            Just(DType::Bfloat16),
            Just(DType::Float16)
        ],
        prop_oneof![Just(DType::Float8E4M3), Just(DType::Float8E5M2)],
        prop_oneof![Just(ScaleFormat::Float32), Just(ScaleFormat::E8m0)],
        any::<bool>(),
    )
        .prop_map(|(src, dst, format, inverse)| {
            let mut c = Conversion::quantize(dst, Scheme::PerTensor);
            c.scale_format = format;
            c.scale_inverse = inverse;
            (src, c)
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 4_000, ..ProptestConfig::default() })]

    #[test]
    fn a_block_quantizes_as_the_reference_says(
        (src, conversion) in conversions(),
        seed_values in block_values(DType::Float32),
    ) {
        let values: Vec<f32> = seed_values
            .iter()
            .map(|&x| match src {
                DType::Bfloat16 => float::bf16_to_f32(float::f32_to_bf16(x)),
                DType::Float16 => float::f16_to_f32(float::f32_to_f16(x)),
                _ => x,
            })
            .collect();
        let arithmetic: Arithmetic = conversion.arithmetic(src);
        let scale = arithmetic.block_scale(amax(values.iter().copied()));
        let expected = reference::convert_tensor(&conversion, &[values.len() as u64], &values);
        let stored = &scale.stored[..conversion.scale_format.size() as usize];
        prop_assert_eq!(stored, &expected.scales[..], "scale of {:?}", values);
        for (i, &x) in values.iter().enumerate() {
            let mut out = [0u8; 1];
            arithmetic.convert(x, scale.divisor, &mut out);
            prop_assert_eq!(
                u32::from(out[0]),
                u32::from(expected.values[i]),
                "element {} = {:e} of {:?}", i, x, values
            );
        }
    }
}

#[test]
fn the_reciprocal_forms_of_other_references_differ_rarely_and_by_one_step() {
    // vLLM's per_block_cast_to_fp8 quantizes FP32-scaled blocks with x * (1.0 / sf), the
    // DeepGEMM tests with x * (448.0 / amax); DeepSeek-V3's weight_quant (and this library)
    // with x / sf. The forms differ only where the two roundings straddle an FP8 midpoint:
    // count how often (about one value in ten thousand) over a million bfloat16 values, and that it is by one step at most.
    let conversion = Conversion::quantize(DType::Float8E4M3, Scheme::PerTensor);
    let arithmetic = conversion.arithmetic(DType::Bfloat16);
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let (mut differ_vllm, mut differ_deepgemm, mut total) = (0u64, 0u64, 0u64);
    for _ in 0..(1 << 14) {
        let block: Vec<f32> = (0..64)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                float::bf16_to_f32((state >> 48) as u16 & 0x7fff | 0x3000)
            })
            .collect();
        let a = amax(block.iter().copied());
        let scale = arithmetic.block_scale(a);
        for &x in &block {
            let mut ours = [0u8];
            arithmetic.convert(x, scale.divisor, &mut ours);
            let vllm = float::f32_to_e4m3fn(x * (1.0 / scale.divisor));
            let deepgemm = float::f32_to_e4m3fn(x * (448.0 / a.max(1e-4)));
            for (other, count) in [(vllm, &mut differ_vllm), (deepgemm, &mut differ_deepgemm)] {
                if other != ours[0] {
                    *count += 1;
                    assert_eq!(
                        other.abs_diff(ours[0]),
                        1,
                        "{x:e}: {other:#x} vs {:#x}",
                        ours[0]
                    );
                }
            }
            total += 1;
        }
    }
    assert!(differ_vllm * 1000 < total, "{differ_vllm} of {total}");
    assert!(
        differ_deepgemm * 1000 < total,
        "{differ_deepgemm} of {total}"
    );
    eprintln!("x * (1/sf) differs in {differ_vllm}, x * (448/amax) in {differ_deepgemm} of {total} values");
}
