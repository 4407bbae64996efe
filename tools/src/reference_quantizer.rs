//! The reference quantizer: what a converted tensor must hold, written from the published
//! definitions, independently of the library's code (docs/quantization.md §5), for the tests,
//! `ncclreshard check` and the refit demo.
//!
//! - **Elements** by search, not by bit manipulation: every code of the destination format is
//!   decoded with the formulas of its specification (OCP 8-bit floating point v1.0 for E4M3FN
//!   and E5M2, IEEE 754 binary16, bfloat16 = the top half of binary32), and a value takes the
//!   nearest one, ties to the code with an even mantissa. FP8 first clamps to ±max (the OCP
//!   saturating mode, as inference engines clamp before `.to(float8)`); bfloat16 and float16
//!   round to infinity past the midpoint above their largest finite value, as PyTorch does.
//!   NaN becomes the canonical positive NaN.
//! - **Blocks** as DeepSeek-V3's `weight_quant` (`inference/kernel.py`, which its
//!   `bf16_cast_fp8.py` uses to write `weight_scale_inv`) defines them: `s = amax / 448`,
//!   `y = x / s`, `y.to(float8_e4m3fn)`, `s` stored — with the `amax.clamp(1e-4)` of DeepGEMM's,
//!   vLLM's and SGLang's `per_block_cast_to_fp8` (an all-zero block otherwise divides 0 by 0),
//!   the amax taken over non-NaN values (Triton's `tl.max` on a GPU is `max.f32`, which ignores
//!   NaN), and the division in IEEE FP32 (Triton's `/` is the approximate `div.full.f32` on
//!   GPUs, so `weight_quant` run there is not itself a bit-exact reference).
//! - **E8M0 scales** as SGLang's and DeepGEMM's `per_block_cast_to_fp8` with
//!   `ceil_to_ue8m0`: the biased exponent of the FP32 scale, plus one when any mantissa bit is
//!   set, clamped to 1..254; the values are `x * (1.0 / sf)`.
//!
//! The functions work on whole global tensors (row-major), so they share nothing with how the
//! planner cuts tensors into shards, blocks and messages.

use ncclreshard::quant::{Conversion, ScaleFormat, Scheme};
use ncclreshard::DType;
use std::sync::OnceLock;

/// The value of code `bits` of `dtype` by its format's definition (NaN for NaN codes).
pub fn decode(dtype: DType, bits: u32) -> f64 {
    // (exponent bits, mantissa bits, bias, whether the all-ones exponent is inf/NaN)
    let (e_bits, m_bits, bias, ieee_top) = match dtype {
        DType::Float8E4M3 => (4u32, 3u32, 7i32, false),
        DType::Float8E5M2 => (5, 2, 15, true),
        DType::Float16 => (5, 10, 15, true),
        DType::Bfloat16 => (8, 7, 127, true),
        other => panic!("{other} is not a narrow float"),
    };
    let sign = if bits >> (e_bits + m_bits) & 1 == 1 {
        -1.0
    } else {
        1.0
    };
    let e = ((bits >> m_bits) & ((1 << e_bits) - 1)) as i32;
    let m = f64::from(bits & ((1 << m_bits) - 1));
    let top = (1 << e_bits) - 1;
    let fraction = m / f64::from(1u32 << m_bits);
    if ieee_top && e == top {
        return if m == 0.0 {
            sign * f64::INFINITY
        } else {
            f64::NAN
        };
    }
    // E4M3FN: only S.1111.111 is NaN; the rest of the top exponent holds finite values.
    if !ieee_top && e == top && m == f64::from((1u32 << m_bits) - 1) {
        return f64::NAN;
    }
    if e == 0 {
        sign * fraction * 2f64.powi(1 - bias)
    } else {
        sign * (1.0 + fraction) * 2f64.powi(e - bias)
    }
}

/// Every non-negative finite code of `dtype` with its value, ascending by value.
fn positive_table(dtype: DType) -> &'static [(f64, u32)] {
    static TABLES: OnceLock<Vec<Vec<(f64, u32)>>> = OnceLock::new();
    let formats = [
        DType::Float8E4M3,
        DType::Float8E5M2,
        DType::Float16,
        DType::Bfloat16,
    ];
    let tables = TABLES.get_or_init(|| {
        formats
            .iter()
            .map(|&d| {
                let width = 8 * d.size();
                let mut table: Vec<(f64, u32)> = (0..1u32 << (width - 1))
                    .map(|c| (decode(d, c), c))
                    .filter(|(v, _)| v.is_finite())
                    .collect();
                table.sort_by(|a, b| a.0.total_cmp(&b.0));
                table
            })
            .collect()
    });
    let i = formats
        .iter()
        .position(|&d| d == dtype)
        .unwrap_or_else(|| panic!("{dtype} is not a narrow float"));
    &tables[i]
}

/// The canonical NaN of a format.
fn canonical_nan(dtype: DType) -> u32 {
    match dtype {
        DType::Float8E4M3 | DType::Float8E5M2 => 0x7f,
        DType::Float16 => 0x7e00,
        DType::Bfloat16 => 0x7fc0,
        other => panic!("{other} is not a narrow float"),
    }
}

/// `x` in `dtype` by search: the nearest code, ties to the even code; FP8 saturates,
/// bfloat16/float16 overflow to infinity.
pub fn encode(dtype: DType, x: f32) -> u32 {
    if x.is_nan() {
        return canonical_nan(dtype);
    }
    let width = 8 * dtype.size();
    let sign = if x.is_sign_negative() {
        1 << (width - 1)
    } else {
        0
    };
    let table = positive_table(dtype);
    let (max, max_code) = *table.last().expect("a format has values");
    let a = f64::from(x).abs();
    let fp8 = matches!(dtype, DType::Float8E4M3 | DType::Float8E5M2);
    if fp8 && a >= max {
        return sign | max_code;
    }
    if !fp8 && a > max {
        // The next binade's first value would be 2^(emax + 1), with an even code: the infinity.
        let beyond = 2.0 * 2f64.powi(max.log2().floor() as i32);
        let inf = max_code + 1;
        return sign
            | if a >= (max + beyond) / 2.0 {
                inf
            } else {
                max_code
            };
    }
    let i = table.partition_point(|&(v, _)| v < a);
    let above = table.get(i).copied();
    let below = i.checked_sub(1).map(|j| table[j]);
    let code = match (below, above) {
        (_, Some((v, c))) if v == a => c,
        (Some((lo, lc)), Some((hi, hc))) => {
            if a - lo < hi - a || (a - lo == hi - a && lc % 2 == 0) {
                lc
            } else {
                hc
            }
        }
        (Some((_, c)), None) | (None, Some((_, c))) => c,
        (None, None) => unreachable!("tables are not empty"),
    };
    sign | code
}

/// FP32 value of a source element's little-endian bytes.
pub fn load(dtype: DType, bytes: &[u8]) -> f32 {
    match dtype {
        DType::Float32 => f32::from_le_bytes(bytes[..4].try_into().expect("4 bytes")),
        DType::Bfloat16 | DType::Float16 => {
            let v = decode(dtype, u32::from(u16::from_le_bytes([bytes[0], bytes[1]])));
            if v.is_nan() {
                f32::NAN
            } else {
                v as f32
            }
        }
        other => panic!("{other} is not a conversion source"),
    }
}

/// The largest finite value of an FP8 format.
fn fp8_max(dtype: DType) -> f32 {
    let (max, _) = *positive_table(dtype).last().expect("a format has values");
    max as f32
}

/// One block's scale: the divisor its elements are quantized with and the stored scale bytes.
pub fn block_scale(conversion: &Conversion, amax: f32) -> (f32, Vec<u8>) {
    // torch: x_amax.clamp(1e-4) on an FP32 tensor; the scalar becomes FP32 1e-4.
    let amax = if amax < 1e-4f32 { 1e-4f32 } else { amax };
    let sf = amax / fp8_max(conversion.dtype);
    match conversion.scale_format {
        ScaleFormat::Float32 => {
            let stored = if conversion.scale_inverse {
                1.0 / sf
            } else {
                sf
            };
            (sf, stored.to_le_bytes().to_vec())
        }
        ScaleFormat::E8m0 => {
            if sf.is_infinite() {
                return (f32::INFINITY, vec![0xff]);
            }
            // ceil_to_ue8m0: exp = (bits >> 23) & 0xff, plus one for a nonzero mantissa,
            // clamp(1, 254), then (exp << 23) viewed as FP32.
            let bits = sf.to_bits();
            let exp = (((bits >> 23) & 0xff) + u32::from(bits & 0x7f_ffff != 0)).clamp(1, 254);
            let sf = f32::from_bits(exp << 23);
            let stored = if conversion.scale_inverse {
                // 1 / 2^(exp - 127) = 2^(127 - exp): biased, 254 - exp.
                254 - exp
            } else {
                exp
            };
            (sf, vec![stored as u8])
        }
    }
}

/// The quantized value of `x` under divisor `sf`: `x / sf` for FP32 scales (weight_quant),
/// `x * (1.0 / sf)` for E8M0 (per_block_cast_to_fp8), then the element conversion.
pub fn quantized(conversion: &Conversion, x: f32, sf: f32) -> u32 {
    let y = match conversion.scale_format {
        ScaleFormat::Float32 => x / sf,
        ScaleFormat::E8m0 => x * (1.0 / sf),
    };
    encode(conversion.dtype, y)
}

/// The extent of a block along each dim, from the scheme's definition.
pub fn block_extent(scheme: Scheme, shape: &[u64]) -> Vec<u64> {
    let n = shape.len();
    (0..n)
        .map(|d| match scheme {
            Scheme::None => 1,
            Scheme::PerTensor => shape[d].max(1),
            Scheme::PerChannel if d + 1 == n => shape[d].max(1),
            Scheme::PerChannel => 1,
            Scheme::Block { cols, .. } if d + 1 == n => cols,
            Scheme::Block { rows, .. } if d + 2 == n => rows,
            Scheme::Block { .. } => 1,
        })
        .collect()
}

/// A whole tensor converted: its elements (row-major, destination bytes) and its scales
/// (row-major over the block grid, stored bytes; empty for a cast).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Converted {
    pub values: Vec<u8>,
    pub scales: Vec<u8>,
}

/// Converts a whole tensor of `shape` whose source elements are `source` (FP32 values,
/// row-major) as `conversion` says.
pub fn convert_tensor(conversion: &Conversion, shape: &[u64], source: &[f32]) -> Converted {
    let elem = conversion.dtype.size() as usize;
    let mut values = vec![0u8; source.len() * elem];
    let put = |values: &mut Vec<u8>, i: usize, code: u32| {
        values[i * elem..(i + 1) * elem].copy_from_slice(&code.to_le_bytes()[..elem]);
    };
    if conversion.scheme == Scheme::None {
        for (i, &x) in source.iter().enumerate() {
            put(&mut values, i, encode(conversion.dtype, x));
        }
        return Converted {
            values,
            scales: Vec::new(),
        };
    }
    let block = block_extent(conversion.scheme, shape);
    let grid: Vec<u64> = shape
        .iter()
        .zip(&block)
        .map(|(n, b)| n.div_ceil(*b))
        .collect();
    // Every element's block, row-major over the grid.
    let n = shape.len();
    let mut members: Vec<Vec<usize>> = vec![Vec::new(); grid.iter().product::<u64>() as usize];
    for (i, _) in source.iter().enumerate() {
        let mut rest = i as u64;
        let mut index = vec![0u64; n];
        for d in (0..n).rev() {
            index[d] = rest % shape[d];
            rest /= shape[d];
        }
        let mut b = 0u64;
        for d in 0..n {
            b = b * grid[d] + index[d] / block[d];
        }
        members[b as usize].push(i);
    }
    let mut scales = Vec::new();
    for elements in &members {
        let amax = elements
            .iter()
            .map(|&i| source[i])
            .filter(|v| !v.is_nan())
            .fold(0.0f32, |m, v| m.max(v.abs()));
        let (sf, stored) = block_scale(conversion, amax);
        scales.extend(stored);
        for &i in elements {
            put(&mut values, i, quantized(conversion, source[i], sf));
        }
    }
    Converted { values, scales }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decoding_follows_the_specifications() {
        assert_eq!(decode(DType::Float8E4M3, 0x7e), 448.0);
        assert!(decode(DType::Float8E4M3, 0x7f).is_nan());
        assert_eq!(decode(DType::Float8E4M3, 0x01), 2f64.powi(-9));
        assert_eq!(decode(DType::Float8E5M2, 0x7b), 57344.0);
        assert_eq!(decode(DType::Float8E5M2, 0x7c), f64::INFINITY);
        assert_eq!(decode(DType::Float16, 0x7bff), 65504.0);
        assert_eq!(decode(DType::Bfloat16, 0x3f80), 1.0);
        assert_eq!(encode(DType::Float8E4M3, 1000.0), 0x7e);
        assert_eq!(encode(DType::Float8E4M3, -0.0), 0x80);
        assert_eq!(encode(DType::Float16, 65520.0), 0x7c00);
        assert_eq!(encode(DType::Float16, 65519.0), 0x7bff);
        assert_eq!(encode(DType::Bfloat16, f32::MAX), 0x7f80);
    }

    #[test]
    fn a_block_quantizes_to_its_amax() {
        let conversion =
            Conversion::quantize(DType::Float8E4M3, Scheme::Block { rows: 2, cols: 2 });
        let out = convert_tensor(&conversion, &[2, 3], &[1.0, -2.0, 0.0, 4.0, 0.5, 0.0]);
        // Block (0, 0): amax 4 → s = 4/448; block (0, 1): amax 0 → s = 1e-4/448.
        assert_eq!(out.scales.len(), 8);
        assert_eq!(
            f32::from_le_bytes(out.scales[..4].try_into().unwrap()),
            4.0 / 448.0
        );
        assert_eq!(out.values[3], encode(DType::Float8E4M3, 448.0) as u8);
        assert_eq!(out.values[2], 0);
    }
}
