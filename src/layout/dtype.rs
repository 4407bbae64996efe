//! Element types: NCCL's `ncclDataType_t` codes, torch's names and byte sizes, in one table.

/// The element type of a tensor. Moving a tensor as it is needs only its size; the type decides
/// what it may convert to on the way (`quant::Conversion`), and descriptors on both sides are
/// checked to agree on it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    /// Signed 8-bit integer (`torch.int8`, `ncclInt8`).
    Int8,
    /// Unsigned 8-bit integer (`torch.uint8`, `ncclUint8`).
    Uint8,
    /// Signed 32-bit integer (`torch.int32`, `ncclInt32`).
    Int32,
    /// Unsigned 32-bit integer (`torch.uint32`, `ncclUint32`).
    Uint32,
    /// Signed 64-bit integer (`torch.int64`, `ncclInt64`).
    Int64,
    /// Unsigned 64-bit integer (`torch.uint64`, `ncclUint64`).
    Uint64,
    /// IEEE 754 binary16 (`torch.float16`, `ncclFloat16`).
    Float16,
    /// IEEE 754 binary32 (`torch.float32`, `ncclFloat32`).
    Float32,
    /// IEEE 754 binary64 (`torch.float64`, `ncclFloat64`).
    Float64,
    /// bfloat16, the top 16 bits of a binary32 (`torch.bfloat16`, `ncclBfloat16`).
    Bfloat16,
    /// FP8 E4M3FN: no infinities, largest finite value 448 (`torch.float8_e4m3fn`,
    /// `ncclFloat8e4m3`).
    Float8E4M3,
    /// FP8 E5M2: largest finite value 57344 (`torch.float8_e5m2`, `ncclFloat8e5m2`).
    Float8E5M2,
}

/// (type, `ncclDataType_t` value, torch name, size in bytes). NCCL's enum values are part of its
/// ABI (nccl.h: ncclInt8 = 0 … ncclFloat8e5m2 = 11).
const TABLE: [(DType, i32, &str, u32); 12] = [
    (DType::Int8, 0, "int8", 1),
    (DType::Uint8, 1, "uint8", 1),
    (DType::Int32, 2, "int32", 4),
    (DType::Uint32, 3, "uint32", 4),
    (DType::Int64, 4, "int64", 8),
    (DType::Uint64, 5, "uint64", 8),
    (DType::Float16, 6, "float16", 2),
    (DType::Float32, 7, "float32", 4),
    (DType::Float64, 8, "float64", 8),
    (DType::Bfloat16, 9, "bfloat16", 2),
    (DType::Float8E4M3, 10, "float8_e4m3fn", 1),
    (DType::Float8E5M2, 11, "float8_e5m2", 1),
];

impl DType {
    /// Every element type, in the order of their `ncclDataType_t` values (0 to 11).
    pub const ALL: [DType; 12] = [
        DType::Int8,
        DType::Uint8,
        DType::Int32,
        DType::Uint32,
        DType::Int64,
        DType::Uint64,
        DType::Float16,
        DType::Float32,
        DType::Float64,
        DType::Bfloat16,
        DType::Float8E4M3,
        DType::Float8E5M2,
    ];

    fn row(self) -> &'static (DType, i32, &'static str, u32) {
        TABLE
            .iter()
            .find(|row| row.0 == self)
            .expect("every DType has a table row")
    }

    /// Bytes per element.
    pub fn size(self) -> u32 {
        self.row().3
    }

    /// The `ncclDataType_t` value.
    pub fn nccl_code(self) -> i32 {
        self.row().1
    }

    /// torch's name (`torch.bfloat16` → `"bfloat16"`).
    pub fn torch_name(self) -> &'static str {
        self.row().2
    }

    /// The type whose `ncclDataType_t` value is `code`, or `None` for a value outside 0–11.
    pub fn from_nccl_code(code: i32) -> Option<DType> {
        TABLE.iter().find(|row| row.1 == code).map(|row| row.0)
    }

    /// Accepts torch's names, with or without the `torch.` prefix, and the common aliases
    /// (`half`, `float`, `double`, `bf16`, `fp32`, …).
    pub fn from_name(name: &str) -> Option<DType> {
        let name = name.strip_prefix("torch.").unwrap_or(name);
        let canonical = match name {
            "half" | "fp16" => "float16",
            "float" | "fp32" => "float32",
            "double" | "fp64" => "float64",
            "bf16" => "bfloat16",
            "int" => "int32",
            "long" => "int64",
            "char" => "int8",
            "float8_e4m3" | "fp8_e4m3" => "float8_e4m3fn",
            "fp8_e5m2" => "float8_e5m2",
            other => other,
        };
        TABLE.iter().find(|row| row.2 == canonical).map(|row| row.0)
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.torch_name())
    }
}
