//! Bit-exact conversions between FP32 and the narrower float formats a tensor may arrive in
//! (docs/quantization.md §2): bfloat16, float16, FP8 E4M3FN and FP8 E5M2, and the E8M0 scale
//! format.
//!
//! Every narrowing conversion rounds to nearest, ties to even, with subnormal results where
//! the format has them (IEEE 754 `roundTiesToEven`, what PyTorch's `.to()` does). Overflow
//! gives infinity for bfloat16 and float16 (as PyTorch) and saturates to the largest finite
//! magnitude for both FP8 formats (the OCP FP8 specification's saturating mode, what CUDA's
//! `cvt.rn.satfinite` does and what inference engines get by clamping before `.to()`).
//! Infinities follow overflow; NaN becomes the format's canonical NaN, positive (payloads and
//! signs of NaNs are not portable between CPUs and GPUs, so they are not kept).
//!
//! `kernels/copy.cu` implements the same functions for GPUs; the emulated GPU tests compare
//! the two.

/// A float format narrower than FP32, described by what its encoder needs.
struct Narrow {
    /// Total bits (8 or 16): the sign is the top one.
    width: u32,
    /// Explicit mantissa bits.
    mantissa: u32,
    /// Exponent bias.
    bias: i32,
    /// Encoding (without sign) of the largest finite magnitude.
    max_finite: u32,
    /// What a magnitude beyond `max_finite` encodes to: `max_finite` (saturation) or infinity.
    overflow: u32,
    /// The canonical NaN.
    nan: u32,
}

const BF16: Narrow = Narrow {
    width: 16,
    mantissa: 7,
    bias: 127,
    max_finite: 0x7f7f,
    overflow: 0x7f80,
    nan: 0x7fc0,
};

const F16: Narrow = Narrow {
    width: 16,
    mantissa: 10,
    bias: 15,
    max_finite: 0x7bff,
    overflow: 0x7c00,
    nan: 0x7e00,
};

const E4M3FN: Narrow = Narrow {
    width: 8,
    mantissa: 3,
    bias: 7,
    max_finite: 0x7e,
    overflow: 0x7e,
    nan: 0x7f,
};

const E5M2: Narrow = Narrow {
    width: 8,
    mantissa: 2,
    bias: 15,
    max_finite: 0x7b,
    overflow: 0x7b,
    nan: 0x7f,
};

/// Largest finite FP8 E4M3FN value.
pub const E4M3FN_MAX: f32 = 448.0;
/// Largest finite FP8 E5M2 value.
pub const E5M2_MAX: f32 = 57344.0;

/// `mantissa >> shift` rounded to nearest, ties to even (`shift` ≥ 1).
fn shift_round_even(mantissa: u64, shift: u32) -> u64 {
    if shift >= 63 {
        return 0;
    }
    let kept = mantissa >> shift;
    let rest = mantissa & ((1u64 << shift) - 1);
    let half = 1u64 << (shift - 1);
    if rest > half || (rest == half && kept & 1 == 1) {
        kept + 1
    } else {
        kept
    }
}

/// Encodes `x` in `format`: round to nearest even, then overflow as the format says.
fn encode(x: f32, format: &Narrow) -> u32 {
    if x.is_nan() {
        return format.nan;
    }
    let bits = x.to_bits();
    let sign = (bits >> 31) << (format.width - 1);
    let magnitude = bits & 0x7fff_ffff;
    if magnitude == 0x7f80_0000 {
        return sign | format.overflow;
    }
    // |x| = mantissa · 2^exponent exactly.
    let (mantissa, exponent) = if magnitude >= 0x0080_0000 {
        (
            u64::from((magnitude & 0x007f_ffff) | 0x0080_0000),
            (magnitude >> 23) as i32 - 150,
        )
    } else {
        (u64::from(magnitude), -149)
    };
    if mantissa == 0 {
        return sign;
    }
    // The exponent of |x|'s leading bit, then of one unit in the last place of the result
    // (subnormal results share the smallest normal exponent's unit).
    let leading = exponent + 63 - mantissa.leading_zeros() as i32;
    let smallest_normal = 1 - format.bias;
    let result_exponent = leading.max(smallest_normal);
    let unit = result_exponent - format.mantissa as i32;
    // Narrower formats have coarser units than FP32 at every exponent: the shift is positive.
    let rounded = shift_round_even(mantissa, (unit - exponent) as u32);
    // Biased exponent field times 2^mantissa, plus the rounded significand (which carries the
    // implicit bit, or is the whole subnormal encoding): a carry out of the significand steps
    // the exponent, as rounding up to the next binade should.
    let code = (((result_exponent + format.bias - 1) as u64) << format.mantissa) + rounded;
    let code = if code > u64::from(format.max_finite) {
        format.overflow
    } else {
        code as u32
    };
    sign | code
}

/// FP32 → bfloat16 bits (round to nearest even; overflow → ±inf; NaN → 0x7fc0).
pub fn f32_to_bf16(x: f32) -> u16 {
    encode(x, &BF16) as u16
}

/// FP32 → float16 bits (round to nearest even; overflow → ±inf; NaN → 0x7e00).
pub fn f32_to_f16(x: f32) -> u16 {
    encode(x, &F16) as u16
}

/// FP32 → FP8 E4M3FN bits (round to nearest even; saturating at ±448; NaN → 0x7f).
pub fn f32_to_e4m3fn(x: f32) -> u8 {
    encode(x, &E4M3FN) as u8
}

/// FP32 → FP8 E5M2 bits (round to nearest even; saturating at ±57344; NaN → 0x7f).
pub fn f32_to_e5m2(x: f32) -> u8 {
    encode(x, &E5M2) as u8
}

/// bfloat16 bits → FP32 (exact).
pub fn bf16_to_f32(bits: u16) -> f32 {
    f32::from_bits(u32::from(bits) << 16)
}

/// float16 bits → FP32 (exact).
pub fn f16_to_f32(bits: u16) -> f32 {
    let sign = if bits & 0x8000 != 0 { -1.0f32 } else { 1.0 };
    let exponent = i32::from((bits >> 10) & 0x1f);
    let mantissa = f32::from(bits & 0x3ff);
    let magnitude = match exponent {
        0 => mantissa * 2f32.powi(-24),
        31 if mantissa == 0.0 => f32::INFINITY,
        31 => f32::NAN,
        e => (1024.0 + mantissa) * 2f32.powi(e - 25),
    };
    sign * magnitude
}

/// FP8 E4M3FN bits → FP32 (exact; 0x7f and 0xff are NaN).
pub fn e4m3fn_to_f32(bits: u8) -> f32 {
    let sign = if bits & 0x80 != 0 { -1.0f32 } else { 1.0 };
    let exponent = i32::from((bits >> 3) & 0xf);
    let mantissa = f32::from(bits & 0x7);
    if bits & 0x7f == 0x7f {
        return f32::NAN;
    }
    sign * match exponent {
        0 => mantissa * 2f32.powi(-9),
        e => (8.0 + mantissa) * 2f32.powi(e - 10),
    }
}

/// FP8 E5M2 bits → FP32 (exact).
pub fn e5m2_to_f32(bits: u8) -> f32 {
    let sign = if bits & 0x80 != 0 { -1.0f32 } else { 1.0 };
    let exponent = i32::from((bits >> 2) & 0x1f);
    let mantissa = f32::from(bits & 0x3);
    sign * match exponent {
        0 => mantissa * 2f32.powi(-16),
        31 if mantissa == 0.0 => f32::INFINITY,
        31 => f32::NAN,
        e => (4.0 + mantissa) * 2f32.powi(e - 17),
    }
}

/// The E8M0 encoding of a positive finite power of two `2^e` (its biased exponent `e + 127`).
pub fn e8m0_of_power_of_two(x: f32) -> u8 {
    (x.to_bits() >> 23) as u8
}

/// The E8M0 byte → FP32: `2^(byte - 127)`, NaN for 0xff.
pub fn e8m0_to_f32(bits: u8) -> f32 {
    match bits {
        0xff => f32::NAN,
        // 2^-127 is an FP32 subnormal.
        0 => f32::from_bits(0x0040_0000),
        e => f32::from_bits(u32::from(e) << 23),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_values() {
        assert_eq!(f32_to_e4m3fn(448.0), 0x7e);
        assert_eq!(f32_to_e4m3fn(463.9), 0x7e);
        assert_eq!(f32_to_e4m3fn(1e9), 0x7e);
        assert_eq!(f32_to_e4m3fn(-f32::INFINITY), 0xfe);
        assert_eq!(f32_to_e4m3fn(f32::NAN), 0x7f);
        assert_eq!(f32_to_e4m3fn(-0.0), 0x80);
        assert_eq!(f32_to_e4m3fn(1.0), 0x38);
        // The smallest subnormal is 2^-9; half of it ties to even (zero).
        assert_eq!(f32_to_e4m3fn(2f32.powi(-9)), 0x01);
        assert_eq!(f32_to_e4m3fn(2f32.powi(-10)), 0x00);
        assert_eq!(f32_to_e4m3fn(1.5 * 2f32.powi(-10)), 0x01);
        // 1 + 1/16 is halfway between 1 and 1.125: ties to even (1.0).
        assert_eq!(f32_to_e4m3fn(1.0625), 0x38);
        assert_eq!(f32_to_e4m3fn(1.1875), 0x3a);
        assert_eq!(f32_to_e5m2(57344.0), 0x7b);
        assert_eq!(f32_to_e5m2(f32::INFINITY), 0x7b);
        assert_eq!(f32_to_e5m2(1.0), 0x3c);
        assert_eq!(f32_to_bf16(1.0), 0x3f80);
        assert_eq!(f32_to_bf16(f32::MAX), 0x7f80);
        assert_eq!(f32_to_bf16(f32::from_bits(0x3f80_8000)), 0x3f80);
        assert_eq!(f32_to_bf16(f32::from_bits(0x3f81_8000)), 0x3f82);
        assert_eq!(f32_to_f16(65504.0), 0x7bff);
        assert_eq!(f32_to_f16(65520.0), 0x7c00);
        assert_eq!(f32_to_f16(2f32.powi(-24)), 0x0001);
        assert_eq!(f32_to_f16(f32::NAN), 0x7e00);
    }

    #[test]
    fn every_narrow_value_survives_the_round_trip() {
        for bits in 0..=u8::MAX {
            let x = e4m3fn_to_f32(bits);
            if !x.is_nan() {
                assert_eq!(f32_to_e4m3fn(x), bits, "{bits:#x}");
            }
            let y = e5m2_to_f32(bits);
            if y.is_finite() {
                assert_eq!(f32_to_e5m2(y), bits, "{bits:#x}");
            }
        }
        for bits in 0..=u16::MAX {
            let x = f16_to_f32(bits);
            if x.is_finite() {
                assert_eq!(f32_to_f16(x), bits, "{bits:#x}");
            }
            let y = bf16_to_f32(bits);
            if y.is_finite() {
                assert_eq!(f32_to_bf16(y), bits, "{bits:#x}");
            }
        }
    }
}
