//! Element types the ops accept, with XLA's PrimitiveType numbering.
#![forbid(unsafe_code)]

/// An element type of an operand or result.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    F64,
    BF16,
    F16,
    /// `float8_e4m3fn`: fp8 operands of the CUDA backend (cuBLASLt, sm_90+)
    /// only; the CPU backend refuses them (`cpu::run`).
    F8E4M3FN,
    /// `float8_e5m2`, likewise.
    F8E5M2,
}

impl DType {
    pub fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F64 => 8,
            DType::BF16 | DType::F16 => 2,
            DType::F8E4M3FN | DType::F8E5M2 => 1,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "float32",
            DType::F64 => "float64",
            DType::BF16 => "bfloat16",
            DType::F16 => "float16",
            DType::F8E4M3FN => "float8_e4m3fn",
            DType::F8E5M2 => "float8_e5m2",
        }
    }

    pub fn is_fp8(self) -> bool {
        matches!(self, DType::F8E4M3FN | DType::F8E5M2)
    }

    /// The type the matmul accumulates in: f64 if either side is f64, else f32
    /// (bf16, f16 and fp8 accumulate in f32).
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
        19 => "float8_e5m2",
        20 => "float8_e4m3fn",
        _ => "an unsupported type",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn xla_type_codes_decode_to_the_types_of_their_names() {
        // XLA_FFI_DataType values from the committed bindings.
        use crate::xla::sys;
        let codes = [
            (sys::XLA_FFI_DataType_F32, DType::F32, 4),
            (sys::XLA_FFI_DataType_F64, DType::F64, 8),
            (sys::XLA_FFI_DataType_BF16, DType::BF16, 2),
            (sys::XLA_FFI_DataType_F16, DType::F16, 2),
            (sys::XLA_FFI_DataType_F8E4M3FN, DType::F8E4M3FN, 1),
            (sys::XLA_FFI_DataType_F8E5M2, DType::F8E5M2, 1),
        ];
        for (code, dtype, size) in codes {
            assert_eq!(crate::abi::dtype(code), Some(dtype), "code {code}");
            assert_eq!(dtype.size(), size, "{dtype:?}");
            assert_eq!(xla_type_name(code), dtype.name());
            assert_eq!(dtype.is_fp8(), size == 1);
            assert_eq!(DType::accumulator(dtype, DType::BF16), if dtype == DType::F64 { dtype } else { DType::F32 });
        }
        // Other fp8 formats are not taken (cuBLASLt's are e4m3fn and e5m2).
        for code in [sys::XLA_FFI_DataType_F8E4M3, sys::XLA_FFI_DataType_F8E4M3FNUZ, sys::XLA_FFI_DataType_F8E5M2FNUZ] {
            assert_eq!(crate::abi::dtype(code), None, "code {code}");
        }
    }
}
