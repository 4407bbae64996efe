//! What inference stores when it differs from training (`--infer-dtype`): the conversion of
//! each parameter of a refit, so the reshard casts or quantizes on the way
//! (docs/quantization.md).

use super::inventory::{Kind, Param, Role};
use ncclreshard::layout::DType;
use ncclreshard::quant::{Conversion, Scheme};

/// The inference side's storage of the weights.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InferDtype {
    /// Every parameter whose dtype the checkpoint does not fix, cast to this type.
    Cast(DType),
    /// DeepSeek-V3's FP8 checkpoint: decoder-layer linear weights as float8_e4m3fn in
    /// `rows × cols` blocks with FP32 scales (the dequantization multipliers,
    /// `weight_scale_inv`); the embedding, lm_head, norms and router stay as trained.
    Fp8Block { rows: u64, cols: u64 },
    /// The same weights as float8_e4m3fn with one FP32 scale per output channel.
    Fp8PerChannel,
}

impl InferDtype {
    /// `fp8-block128` (128 × 128), `fp8-block64x128`, `fp8-per-channel`, or a torch dtype
    /// name for a plain cast.
    pub fn parse(text: &str) -> Result<InferDtype, String> {
        if text == "fp8-per-channel" {
            return Ok(InferDtype::Fp8PerChannel);
        }
        if let Some(size) = text.strip_prefix("fp8-block") {
            let number = |s: &str| s.parse::<u64>().ok().filter(|&n| n > 0);
            let (rows, cols) = match size.split_once('x') {
                Some((r, c)) => (number(r), number(c)),
                None => (number(size), number(size)),
            };
            return match (rows, cols) {
                (Some(rows), Some(cols)) => Ok(InferDtype::Fp8Block { rows, cols }),
                _ => Err(format!(
                    "{text:?}: expected fp8-blockN or fp8-blockRxC with positive sizes (fp8-block128)"
                )),
            };
        }
        DType::from_name(text).map(InferDtype::Cast).ok_or_else(|| {
            format!("{text:?}: expected fp8-block128, fp8-blockRxC, fp8-per-channel or a dtype (bfloat16, float16, float8_e4m3fn, …)")
        })
    }

    /// How the command line spells it.
    pub fn name(&self) -> String {
        match self {
            InferDtype::Cast(d) => d.torch_name().to_string(),
            InferDtype::Fp8Block { rows, cols } if rows == cols => format!("fp8-block{rows}"),
            InferDtype::Fp8Block { rows, cols } => format!("fp8-block{rows}x{cols}"),
            InferDtype::Fp8PerChannel => "fp8-per-channel".to_string(),
        }
    }
}

/// Whether a parameter is one DeepSeek-V3's FP8 checkpoint quantizes: a decoder layer's linear
/// weight (attention, MLA, MLP, shared and routed experts), not the router, norms, biases, the
/// embedding or lm_head.
fn quantized(param: &Param) -> bool {
    param.kind == Kind::Weight
        && param.layer.is_some()
        && param.shape.len() >= 2
        && param.dtype.is_none()
        && !matches!(
            param.role,
            Role::Router | Role::RouterBias | Role::Norm | Role::Embedding | Role::LmHead
        )
}

/// Each parameter's conversion from `trained` (the refit's dtype) to `infer`, in `params`
/// order (a refit's tensor order); `None` where a parameter arrives as it is.
pub fn infer_conversions(
    params: &[Param],
    trained: DType,
    infer: InferDtype,
) -> Vec<Option<Conversion>> {
    params
        .iter()
        .map(|p| match infer {
            InferDtype::Cast(d) => (p.dtype.is_none() && d != trained).then(|| Conversion::cast(d)),
            InferDtype::Fp8Block { rows, cols } => quantized(p)
                .then(|| Conversion::quantize(DType::Float8E4M3, Scheme::Block { rows, cols })),
            InferDtype::Fp8PerChannel => {
                quantized(p).then(|| Conversion::quantize(DType::Float8E4M3, Scheme::PerChannel))
            }
        })
        .collect()
}
