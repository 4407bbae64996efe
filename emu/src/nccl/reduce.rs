//! NCCL data types and reduction operators, computed on the host. Half and bfloat16 values are
//! converted to f32, combined, and rounded back to nearest-even once.

pub use ncclreshard_nccl_api::dtype::{
    size_of, BFLOAT16, FLOAT16, FLOAT32, FLOAT64, FLOAT8E4M3, FLOAT8E5M2, INT32, INT64, INT8,
    UINT32, UINT64, UINT8,
};

/// `ncclRedOp_t` values.
pub const SUM: i32 = 0;
pub const PROD: i32 = 1;
pub const MAX: i32 = 2;
pub const MIN: i32 = 3;
pub const AVG: i32 = 4;

/// Whether the emulator can reduce this type (fp8 types only move).
pub fn reducible(dtype: i32) -> bool {
    !matches!(dtype, FLOAT8E4M3 | FLOAT8E5M2) && size_of(dtype).is_some()
}

pub fn f16_to_f32(h: u16) -> f32 {
    let sign = if h & 0x8000 != 0 { -1.0f32 } else { 1.0 };
    let exp = (h >> 10) & 0x1f;
    let mant = (h & 0x3ff) as u32;
    match exp {
        0 => sign * (mant as f32) * 2f32.powi(-24),
        31 => f32::from_bits(((h as u32 & 0x8000) << 16) | 0x7f80_0000 | (mant << 13)),
        _ => {
            f32::from_bits(((h as u32 & 0x8000) << 16) | ((exp as u32 + 112) << 23) | (mant << 13))
        }
    }
}

pub fn f32_to_f16(f: f32) -> u16 {
    let x = f.to_bits();
    let sign = ((x >> 16) & 0x8000) as u16;
    let exp = ((x >> 23) & 0xff) as i32;
    let mant = x & 0x7f_ffff;
    if exp == 255 {
        return sign | 0x7c00 | if mant != 0 { 0x200 } else { 0 };
    }
    let e = exp - 127 + 15;
    if e >= 31 {
        return sign | 0x7c00;
    }
    if e <= 0 {
        if e < -10 {
            return sign;
        }
        let m = mant | 0x80_0000;
        let shift = (14 - e) as u32;
        let half = 1u32 << (shift - 1);
        let rem = m & ((1 << shift) - 1);
        let mut r = m >> shift;
        if rem > half || (rem == half && r & 1 == 1) {
            r += 1;
        }
        return sign | r as u16;
    }
    let mut r = ((e as u32) << 10) | (mant >> 13);
    let rem = mant & 0x1fff;
    if rem > 0x1000 || (rem == 0x1000 && r & 1 == 1) {
        r += 1;
    }
    sign | r as u16
}

pub fn bf16_to_f32(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}

pub fn f32_to_bf16(f: f32) -> u16 {
    let x = f.to_bits();
    if f.is_nan() {
        return ((x >> 16) | 0x40) as u16;
    }
    ((x + 0x7fff + ((x >> 16) & 1)) >> 16) as u16
}

macro_rules! fold_int {
    ($t:ty, $inputs:expr, $op:expr, $n:expr) => {{
        let size = std::mem::size_of::<$t>();
        let count = $inputs[0].len() / size;
        let get = |buf: &[u8], i: usize| {
            <$t>::from_le_bytes(buf[i * size..(i + 1) * size].try_into().unwrap())
        };
        let mut out = Vec::with_capacity(count * size);
        for i in 0..count {
            let mut acc = get($inputs[0], i);
            for b in &$inputs[1..] {
                let v = get(b, i);
                acc = match $op {
                    SUM | AVG => acc.wrapping_add(v),
                    PROD => acc.wrapping_mul(v),
                    MAX => acc.max(v),
                    _ => acc.min(v),
                };
            }
            if $op == AVG {
                acc /= $n as $t;
            }
            out.extend_from_slice(&acc.to_le_bytes());
        }
        out
    }};
}

macro_rules! fold_float {
    ($t:ty, $size:expr, $inputs:expr, $op:expr, $n:expr, $load:expr, $store:expr) => {{
        let count = $inputs[0].len() / $size;
        let mut out = Vec::with_capacity(count * $size);
        for i in 0..count {
            let get = |buf: &[u8]| -> $t { $load(&buf[i * $size..(i + 1) * $size]) };
            let mut acc = get($inputs[0]);
            for b in &$inputs[1..] {
                let v = get(b);
                acc = match $op {
                    SUM | AVG => acc + v,
                    PROD => acc * v,
                    MAX => {
                        if v > acc || acc.is_nan() {
                            v
                        } else {
                            acc
                        }
                    }
                    _ => {
                        if v < acc || acc.is_nan() {
                            v
                        } else {
                            acc
                        }
                    }
                };
            }
            if $op == AVG {
                acc /= $n as $t;
            }
            out.extend_from_slice(&$store(acc));
        }
        out
    }};
}

/// Reduces equal-length buffers (one per rank, in rank order) element-wise.
pub fn reduce(dtype: i32, op: i32, inputs: &[&[u8]]) -> Vec<u8> {
    let n = inputs.len();
    match dtype {
        INT8 => fold_int!(i8, inputs, op, n),
        UINT8 => fold_int!(u8, inputs, op, n),
        INT32 => fold_int!(i32, inputs, op, n),
        UINT32 => fold_int!(u32, inputs, op, n),
        INT64 => fold_int!(i64, inputs, op, n),
        UINT64 => fold_int!(u64, inputs, op, n),
        FLOAT32 => fold_float!(
            f32,
            4,
            inputs,
            op,
            n,
            |b: &[u8]| f32::from_le_bytes(b.try_into().unwrap()),
            |v: f32| v.to_le_bytes()
        ),
        FLOAT64 => fold_float!(
            f64,
            8,
            inputs,
            op,
            n,
            |b: &[u8]| f64::from_le_bytes(b.try_into().unwrap()),
            |v: f64| v.to_le_bytes()
        ),
        FLOAT16 => fold_float!(
            f32,
            2,
            inputs,
            op,
            n,
            |b: &[u8]| f16_to_f32(u16::from_le_bytes([b[0], b[1]])),
            |v: f32| f32_to_f16(v).to_le_bytes()
        ),
        _ => fold_float!(
            f32,
            2,
            inputs,
            op,
            n,
            |b: &[u8]| bf16_to_f32(u16::from_le_bytes([b[0], b[1]])),
            |v: f32| f32_to_bf16(v).to_le_bytes()
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn half_conversions_round_to_nearest_even() {
        for (f, h) in [
            (1.0f32, 0x3c00u16),
            (-2.0, 0xc000),
            (65504.0, 0x7bff),
            (0.0, 0),
        ] {
            assert_eq!(f32_to_f16(f), h);
            assert_eq!(f16_to_f32(h), f);
        }
        assert_eq!(f32_to_f16(1e6), 0x7c00);
        // The smallest subnormal, and halfway between 1.0 and the next half (ties to even).
        assert_eq!(f32_to_f16(2f32.powi(-24)), 1);
        assert_eq!(f32_to_f16(1.0 + 2f32.powi(-11)), 0x3c00);
        assert_eq!(f32_to_f16(1.0 + 3.0 * 2f32.powi(-11)), 0x3c02);
        for h in [1u16, 0x3555, 0x7bff, 0x8001, 0x0400] {
            assert_eq!(f32_to_f16(f16_to_f32(h)), h);
        }
    }

    #[test]
    fn bfloat16_conversions_round_to_nearest_even() {
        assert_eq!(f32_to_bf16(1.0), 0x3f80);
        assert_eq!(bf16_to_f32(0x3f80), 1.0);
        assert_eq!(f32_to_bf16(f32::from_bits(0x3f80_8000)), 0x3f80);
        assert_eq!(f32_to_bf16(f32::from_bits(0x3f81_8000)), 0x3f82);
    }

    #[test]
    fn reductions_combine_ranks() {
        let a = 3i32.to_le_bytes();
        let b = (-5i32).to_le_bytes();
        assert_eq!(reduce(INT32, SUM, &[&a, &b]), (-2i32).to_le_bytes());
        assert_eq!(reduce(INT32, MAX, &[&a, &b]), 3i32.to_le_bytes());
        assert_eq!(reduce(INT32, AVG, &[&a, &b]), (-1i32).to_le_bytes());
        let x = f32_to_bf16(1.5).to_le_bytes();
        let y = f32_to_bf16(2.25).to_le_bytes();
        assert_eq!(
            reduce(BFLOAT16, PROD, &[&x, &y]),
            f32_to_bf16(3.375).to_le_bytes()
        );
    }
}
