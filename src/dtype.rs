//! Element types the ops accept, with XLA's PrimitiveType numbering.
#![forbid(unsafe_code)]

/// An element type of an operand or result.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    F64,
    BF16,
    F16,
}

impl DType {
    /// From XLA's PrimitiveType number (`XLA_FFI_DataType`); `None` for types the ops do not take.
    pub fn from_xla(code: u32) -> Option<DType> {
        match code {
            11 => Some(DType::F32),
            12 => Some(DType::F64),
            16 => Some(DType::BF16),
            10 => Some(DType::F16),
            _ => None,
        }
    }

    pub fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F64 => 8,
            DType::BF16 | DType::F16 => 2,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "float32",
            DType::F64 => "float64",
            DType::BF16 => "bfloat16",
            DType::F16 => "float16",
        }
    }

    /// The type the matmul accumulates in: f64 if either side is f64, else f32
    /// (bf16 and f16 accumulate in f32).
    pub fn accumulator(input: DType, output: DType) -> DType {
        if input == DType::F64 || output == DType::F64 {
            DType::F64
        } else {
            DType::F32
        }
    }
}

/// XLA's name for a PrimitiveType number, for error messages.
pub fn xla_type_name(code: u32) -> &'static str {
    match code {
        1 => "bool",
        2 => "int8",
        3 => "int16",
        4 => "int32",
        5 => "int64",
        6 => "uint8",
        7 => "uint16",
        8 => "uint32",
        9 => "uint64",
        10 => "float16",
        11 => "float32",
        12 => "float64",
        16 => "bfloat16",
        _ => "an unsupported type",
    }
}
