//! Casting and quantizing on the way (docs/quantization.md): a tensor may arrive in another
//! element type than the one it leaves in — a BF16 trainer refits an FP8 inference engine in
//! one reshard — optionally scaled per block, with one scale per block written to a scale
//! tensor that has its own destination layout.
//!
//! This module is the semantics, bit for bit: what a [`Conversion`] is and what it requires,
//! the element conversions ([`float`]), and the block arithmetic ([`Arithmetic`]): the block's
//! amax, its scale, each quantized value. It knows nothing about ranks; the planner decides
//! where each block is converted (`plan::quantize`), the host executor runs these functions,
//! and `kernels/copy.cu` implements the same arithmetic on GPUs.

pub mod float;

use crate::error::{Error, Result};
use crate::layout::{DType, Layout, TensorSpec};

/// How values are scaled on the way.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Scheme {
    /// A plain cast: every element converted on its own (round to nearest even, saturating
    /// for FP8). No scales.
    None,
    /// One scale for the whole tensor.
    PerTensor,
    /// One scale per index of every dim but the last (a `[out, in]` weight: one per output
    /// channel, scales of shape `[out, 1]`).
    PerChannel,
    /// One scale per `rows × cols` block of the last two dims (per matrix of a stacked
    /// tensor: leading dims have blocks of 1; a 1-D tensor uses `cols` only). DeepSeek-V3's
    /// FP8 checkpoints use 128 × 128; MX-style scaling 1 × 32.
    Block {
        /// Block extent along the second-to-last dim, in elements (at least 1).
        rows: u64,
        /// Block extent along the last dim, in elements (at least 1).
        cols: u64,
    },
}

/// How a scale is stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ScaleFormat {
    /// FP32.
    Float32,
    /// E8M0: a biased power-of-two exponent in one byte (MX scales); the scale is rounded up
    /// to a power of two.
    E8m0,
}

impl ScaleFormat {
    /// Bytes per scale.
    pub fn size(self) -> u32 {
        match self {
            ScaleFormat::Float32 => 4,
            ScaleFormat::E8m0 => 1,
        }
    }

    /// The name case files and the CLI use (`float32`, `e8m0`), which
    /// [`ScaleFormat::from_name`] accepts.
    pub fn name(self) -> &'static str {
        match self {
            ScaleFormat::Float32 => "float32",
            ScaleFormat::E8m0 => "e8m0",
        }
    }

    /// Parses `float32` (or `float`, `fp32`) and `e8m0` (or `float8_e8m0fnu`, `ue8m0`), with
    /// or without the `torch.` prefix; `None` for anything else.
    pub fn from_name(name: &str) -> Option<ScaleFormat> {
        match name.strip_prefix("torch.").unwrap_or(name) {
            "float32" | "float" | "fp32" => Some(ScaleFormat::Float32),
            "e8m0" | "float8_e8m0fnu" | "ue8m0" => Some(ScaleFormat::E8m0),
            _ => None,
        }
    }
}

/// The smallest amax a scale is computed from: an all-zero block (or one of tiny values) gets
/// the scale of amax = 1e-4, as DeepGEMM's, vLLM's and SGLang's `per_block_cast_to_fp8`
/// clamp it (`amax.clamp(1e-4)`), instead of dividing zero by zero.
pub const AMAX_FLOOR: f32 = 1e-4;

/// What a tensor becomes on its way: a destination element type and how it is scaled.
/// Attached to a [`TensorSpec`] (whose `dtype` is then the source's) by
/// [`Planner::with_conversions`](crate::plan::Planner::with_conversions).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Conversion {
    /// The destination's element type.
    pub dtype: DType,
    /// How values are scaled; [`Scheme::None`] is a plain cast.
    pub scheme: Scheme,
    /// How scales are stored (scaled schemes only).
    pub scale_format: ScaleFormat,
    /// Store `1 / scale` instead of the scale (the scale is what the quantized values are
    /// multiplied by to dequantize: DeepSeek's `weight_scale_inv`, vLLM's `weight_scale`).
    pub scale_inverse: bool,
    /// Where the scales go (scaled schemes only): a layout of the scale tensor, whose shape
    /// is [`Conversion::scale_shape`]. `None`: the tensor's destination mesh and placements,
    /// dense.
    pub scale_layout: Option<Layout>,
}

impl Conversion {
    /// A plain cast to `dtype`.
    pub fn cast(dtype: DType) -> Conversion {
        Conversion {
            dtype,
            scheme: Scheme::None,
            scale_format: ScaleFormat::Float32,
            scale_inverse: false,
            scale_layout: None,
        }
    }

    /// Quantization to `dtype` (an FP8 type) under `scheme`, FP32 scales as DeepSeek-V3
    /// stores them (`weight_scale_inv`: the dequantization multiplier), on the destination's
    /// mesh and placements.
    pub fn quantize(dtype: DType, scheme: Scheme) -> Conversion {
        Conversion {
            scheme,
            ..Conversion::cast(dtype)
        }
    }

    /// True when the scheme writes scales.
    pub fn is_scaled(&self) -> bool {
        self.scheme != Scheme::None
    }

    /// The extent of a quantization block along each dim of a tensor of `shape` (all 1 for a
    /// plain cast; the tensor's extent where a block spans a whole dim).
    pub fn block_shape(&self, shape: &[u64]) -> Vec<u64> {
        let n = shape.len();
        let whole = |d: usize| shape[d].max(1);
        (0..n)
            .map(|d| match self.scheme {
                Scheme::None => 1,
                Scheme::PerTensor => whole(d),
                Scheme::PerChannel => {
                    if d + 1 == n {
                        whole(d)
                    } else {
                        1
                    }
                }
                Scheme::Block { rows, cols } => {
                    if d + 1 == n {
                        cols
                    } else if d + 2 == n {
                        rows
                    } else {
                        1
                    }
                }
            })
            .collect()
    }

    /// The scale tensor's shape: the number of blocks along each dim (empty for a 0-d tensor,
    /// which has one block).
    pub fn scale_shape(&self, shape: &[u64]) -> Vec<u64> {
        shape
            .iter()
            .zip(self.block_shape(shape))
            .map(|(&n, b)| n.div_ceil(b))
            .collect()
    }

    /// The scale tensor's destination layout (scaled schemes only).
    pub fn scale_layout(&self, spec: &TensorSpec) -> Option<Layout> {
        if !self.is_scaled() {
            return None;
        }
        Some(
            self.scale_layout
                .clone()
                .unwrap_or_else(|| Layout::new(spec.dst.mesh.clone(), spec.dst.placements.clone())),
        )
    }

    /// The element arithmetic for a tensor whose source elements are `src`.
    pub fn arithmetic(&self, src: DType) -> Arithmetic {
        Arithmetic {
            src,
            dst: self.dtype,
            scale: self.is_scaled().then_some(ScaleEncoding {
                format: self.scale_format,
                inverse: self.scale_inverse,
            }),
        }
    }

    /// Checks the conversion against its tensor (whose `dtype` is the source's). Errors name
    /// the field as case files spell it (`dst_dtype`, `quant.block`, `quant.scale_layout`).
    pub fn validate(&self, spec: &TensorSpec) -> Result<()> {
        self.validate_named(spec, &FieldNames::CASE_FILE)
    }

    /// [`Conversion::validate`] with errors naming the fields as `fields` spells them.
    pub fn validate_named(&self, spec: &TensorSpec, fields: &FieldNames) -> Result<()> {
        const SOURCES: [DType; 3] = [DType::Float32, DType::Bfloat16, DType::Float16];
        const DESTINATIONS: [DType; 4] = [
            DType::Bfloat16,
            DType::Float16,
            DType::Float8E4M3,
            DType::Float8E5M2,
        ];
        let names = |list: &[DType]| {
            list.iter()
                .map(|d| d.torch_name())
                .collect::<Vec<_>>()
                .join(", ")
        };
        if !SOURCES.contains(&spec.dtype) {
            return Err(Error::invalid_argument(format!(
                "dtype {} cannot be converted on the way: the source of a conversion is one of {}",
                spec.dtype,
                names(&SOURCES)
            )));
        }
        if !DESTINATIONS.contains(&self.dtype) {
            return Err(Error::invalid_argument(format!(
                "{} {} is not a conversion target; use one of {}",
                fields.dst_dtype,
                self.dtype,
                names(&DESTINATIONS)
            )));
        }
        if self.is_scaled() && !is_fp8(self.dtype) {
            return Err(Error::invalid_argument(format!(
                "{} {} needs an FP8 {} (float8_e4m3fn or float8_e5m2), not {}; a cast to {} has scheme none",
                fields.scheme,
                scheme_name(self.scheme),
                fields.dst_dtype,
                self.dtype,
                self.dtype
            )));
        }
        if self.scheme == Scheme::None && self.dtype == spec.dtype {
            return Err(Error::invalid_argument(format!(
                "{} {} is the source's dtype and {} is none: there is nothing to convert; leave the conversion out",
                fields.dst_dtype, self.dtype, fields.scheme
            )));
        }
        if let Scheme::Block { rows, cols } = self.scheme {
            if rows == 0 || cols == 0 {
                return Err(Error::invalid_argument(format!(
                    "{} is {rows} × {cols}; blocks need at least one row and one column",
                    fields.block
                )));
            }
        }
        if self.scheme == Scheme::PerChannel && spec.shape.is_empty() {
            return Err(Error::invalid_argument(format!(
                "{} per_channel needs a tensor with at least one dim (a 0-d tensor has one value: use per_tensor)",
                fields.scheme
            )));
        }
        if !self.is_scaled() && self.scale_layout.is_some() {
            return Err(Error::invalid_argument(format!(
                "{} is set but {} is none: a cast writes no scales",
                fields.scale_layout, fields.scheme
            )));
        }
        if let Some(layout) = self.scale_layout(spec) {
            let shape = self.scale_shape(&spec.shape);
            layout.validate(&shape, self.scale_format.size(), fields.scale_layout)?;
        }
        Ok(())
    }
}

/// How an interface spells the fields a conversion's errors name.
pub struct FieldNames {
    /// The destination dtype's field.
    pub dst_dtype: &'static str,
    /// The scheme's field.
    pub scheme: &'static str,
    /// The block size's field (or fields).
    pub block: &'static str,
    /// The scale layout's field, which also prefixes the errors of the scale layout's own
    /// validation.
    pub scale_layout: &'static str,
}

impl FieldNames {
    /// Case files (and the Rust API): `dst_dtype`, `quant.scheme`, …
    pub const CASE_FILE: FieldNames = FieldNames {
        dst_dtype: "dst_dtype",
        scheme: "quant.scheme",
        block: "quant.block",
        scale_layout: "quant.scale_layout",
    };
    /// The C structs (`ncclReshardTensor_t`, `ncclReshardQuant_t`).
    pub const C: FieldNames = FieldNames {
        dst_dtype: "dstDtype",
        scheme: "quant.scheme",
        block: "quant.blockRows × blockCols",
        scale_layout: "quant.scaleLayout",
    };
}

/// True for the FP8 element types.
pub fn is_fp8(dtype: DType) -> bool {
    matches!(dtype, DType::Float8E4M3 | DType::Float8E5M2)
}

/// The largest finite value of an FP8 type.
pub fn fp8_max(dtype: DType) -> Option<f32> {
    match dtype {
        DType::Float8E4M3 => Some(float::E4M3FN_MAX),
        DType::Float8E5M2 => Some(float::E5M2_MAX),
        _ => None,
    }
}

/// The scheme's name as case files spell it.
pub fn scheme_name(scheme: Scheme) -> &'static str {
    match scheme {
        Scheme::None => "none",
        Scheme::PerTensor => "per_tensor",
        Scheme::PerChannel => "per_channel",
        Scheme::Block { .. } => "block",
    }
}

/// How scales are encoded: format and inversion.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ScaleEncoding {
    /// How each scale is stored: 4 bytes of FP32 or one E8M0 byte.
    pub format: ScaleFormat,
    /// Whether `1 / scale` is stored instead of the scale ([`Conversion::scale_inverse`]).
    pub inverse: bool,
}

/// One block's scale: what its elements are divided by, and the bytes stored for it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BlockScale {
    /// `x / divisor` is converted to the destination type.
    pub divisor: f32,
    /// The stored scale, little-endian (4 bytes for FP32, 1 for E8M0).
    pub stored: [u8; 4],
}

/// The arithmetic of one converted tensor: source and destination element types and, for
/// scaled schemes, how its scales are encoded. The host executor's conversions and the GPU
/// kernel's implement exactly these functions.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Arithmetic {
    /// The source element type: float32, bfloat16 or float16 ([`Conversion::validate`]
    /// refuses others; [`Arithmetic::load`] panics on them).
    pub src: DType,
    /// The destination element type: bfloat16, float16 or an FP8 type.
    pub dst: DType,
    /// How scales are encoded; `None` for a plain cast, which writes no scales.
    pub scale: Option<ScaleEncoding>,
}

impl Arithmetic {
    /// Reads one source element (little-endian bytes) as FP32, exactly.
    pub fn load(&self, bytes: &[u8]) -> f32 {
        match self.src {
            DType::Float32 => f32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]),
            DType::Bfloat16 => float::bf16_to_f32(u16::from_le_bytes([bytes[0], bytes[1]])),
            DType::Float16 => float::f16_to_f32(u16::from_le_bytes([bytes[0], bytes[1]])),
            other => unreachable!("{other} is not a conversion source (validated)"),
        }
    }

    /// Writes `x` as one destination element (little-endian bytes).
    pub fn store(&self, x: f32, out: &mut [u8]) {
        match self.dst {
            DType::Bfloat16 => out[..2].copy_from_slice(&float::f32_to_bf16(x).to_le_bytes()),
            DType::Float16 => out[..2].copy_from_slice(&float::f32_to_f16(x).to_le_bytes()),
            DType::Float8E4M3 => out[0] = float::f32_to_e4m3fn(x),
            DType::Float8E5M2 => out[0] = float::f32_to_e5m2(x),
            other => unreachable!("{other} is not a conversion target (validated)"),
        }
    }

    /// The scale of a block whose largest magnitude is `amax` (see [`amax`]):
    /// `s = max(amax, 1e-4) / fmax` in FP32; E8M0 rounds `s` up to a power of two (exactly,
    /// from its bits). The elements are divided by `s` (the rounded one for E8M0); the stored
    /// value is `s`, or `1 / s` (FP32 division; for E8M0 the exact reciprocal) when inverted.
    pub fn block_scale(&self, amax: f32) -> BlockScale {
        let encoding = self.scale.expect("block_scale is for scaled conversions");
        let fmax = fp8_max(self.dst).expect("scaled conversions are to FP8 (validated)");
        let s = amax.max(AMAX_FLOOR) / fmax;
        match encoding.format {
            ScaleFormat::Float32 => {
                let stored = if encoding.inverse { 1.0 / s } else { s };
                BlockScale {
                    divisor: s,
                    stored: stored.to_le_bytes(),
                }
            }
            ScaleFormat::E8m0 => {
                if s.is_infinite() {
                    // E8M0 has no infinity; 0xff is its NaN.
                    return BlockScale {
                        divisor: f32::INFINITY,
                        stored: [0xff, 0, 0, 0],
                    };
                }
                // s ≥ 1e-4 / 57344 is a normal FP32 number below 2^120: its exponent plus one
                // when any mantissa bit is set is the power of two at or above it.
                let bits = s.to_bits();
                let exponent = (bits >> 23) + u32::from(bits & 0x007f_ffff != 0);
                let stored = if encoding.inverse {
                    254 - exponent
                } else {
                    exponent
                };
                BlockScale {
                    divisor: f32::from_bits(exponent << 23),
                    stored: [stored as u8, 0, 0, 0],
                }
            }
        }
    }

    /// The destination value of source value `x` in a block whose scale divides by
    /// `divisor` (unscaled conversions: pass 1, which changes nothing).
    pub fn convert(&self, x: f32, divisor: f32, out: &mut [u8]) {
        let y = if self.scale.is_some() { x / divisor } else { x };
        self.store(y, out);
    }
}

/// The largest magnitude among `values`, NaNs ignored (IEEE `maxNum`, as CUDA's `fmaxf`):
/// 0 when there is none.
pub fn amax(values: impl IntoIterator<Item = f32>) -> f32 {
    values
        .into_iter()
        .fold(0.0f32, |acc, v| if v.abs() > acc { v.abs() } else { acc })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn e4m3(scale: Option<ScaleEncoding>) -> Arithmetic {
        Arithmetic {
            src: DType::Bfloat16,
            dst: DType::Float8E4M3,
            scale,
        }
    }

    #[test]
    fn scales_follow_the_amax_floor_and_the_encodings() {
        let f32_scale = e4m3(Some(ScaleEncoding {
            format: ScaleFormat::Float32,
            inverse: false,
        }));
        let s = f32_scale.block_scale(448.0);
        assert_eq!((s.divisor, s.stored), (1.0, 1.0f32.to_le_bytes()));
        let zero = f32_scale.block_scale(0.0);
        assert_eq!(zero.divisor, AMAX_FLOOR / 448.0);
        let inverse = e4m3(Some(ScaleEncoding {
            format: ScaleFormat::Float32,
            inverse: true,
        }))
        .block_scale(896.0);
        assert_eq!(f32::from_le_bytes(inverse.stored), 0.5);
        let e8m0 = e4m3(Some(ScaleEncoding {
            format: ScaleFormat::E8m0,
            inverse: false,
        }));
        // 448 · 1.5 / 448 = 1.5 rounds up to 2 = 2^1: byte 128.
        let s = e8m0.block_scale(672.0);
        assert_eq!((s.divisor, s.stored[0]), (2.0, 128));
        // An exact power of two stays.
        assert_eq!(e8m0.block_scale(448.0).stored[0], 127);
        assert_eq!(e8m0.block_scale(f32::INFINITY).stored[0], 0xff);
    }

    #[test]
    fn amax_ignores_nan() {
        assert_eq!(amax([1.0, f32::NAN, -3.0]), 3.0);
        assert_eq!(amax([f32::NAN]), 0.0);
        assert_eq!(amax([-0.0, f32::INFINITY]), f32::INFINITY);
    }

    #[test]
    fn block_shapes_and_scale_shapes() {
        let block = Conversion::quantize(
            DType::Float8E4M3,
            Scheme::Block {
                rows: 128,
                cols: 128,
            },
        );
        assert_eq!(block.block_shape(&[7168, 2048]), [128, 128]);
        assert_eq!(block.scale_shape(&[7168, 2000]), [56, 16]);
        assert_eq!(block.scale_shape(&[8, 300, 200]), [8, 3, 2]);
        assert_eq!(block.scale_shape(&[300]), [3]);
        let channel = Conversion::quantize(DType::Float8E4M3, Scheme::PerChannel);
        assert_eq!(channel.scale_shape(&[4096, 1024]), [4096, 1]);
        let tensor = Conversion::quantize(DType::Float8E5M2, Scheme::PerTensor);
        assert_eq!(tensor.scale_shape(&[4096, 1024]), [1, 1]);
        assert_eq!(tensor.scale_shape(&[]), Vec::<u64>::new());
        assert_eq!(tensor.scale_shape(&[0, 5]), [0, 1]);
    }
}
