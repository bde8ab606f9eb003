//! Element conversions between the I/O dtypes and the accumulator type.
#![forbid(unsafe_code)]

use crate::dtype::DType;
use crate::error::{Error, Result};
use half::{bf16, f16};

/// The types matmuls and sums run in: f32 (also for bf16/f16) or f64.
pub trait Accum: bytemuck::Pod + Default + Send + Sync + std::ops::AddAssign + 'static {
    const DTYPE: DType;
    fn one() -> Self;
    fn from_f32(v: f32) -> Self;
    fn from_f64(v: f64) -> Self;
    fn to_f32(self) -> f32;
    fn to_f64(self) -> f64;
}

impl Accum for f32 {
    const DTYPE: DType = DType::F32;
    fn one() -> Self {
        1.0
    }
    fn from_f32(v: f32) -> Self {
        v
    }
    fn from_f64(v: f64) -> Self {
        v as f32
    }
    fn to_f32(self) -> f32 {
        self
    }
    fn to_f64(self) -> f64 {
        self as f64
    }
}

impl Accum for f64 {
    const DTYPE: DType = DType::F64;
    fn one() -> Self {
        1.0
    }
    fn from_f32(v: f32) -> Self {
        v as f64
    }
    fn from_f64(v: f64) -> Self {
        v
    }
    fn to_f32(self) -> f32 {
        self as f32
    }
    fn to_f64(self) -> f64 {
        self
    }
}

/// Views bytes as elements; buffers from XLA and workspace regions are aligned.
/// `bytes` as `T`s. An empty buffer is an empty slice whatever its address
/// (XLA and `split_at` give empty buffers unaligned dangling pointers).
pub fn view<T: bytemuck::Pod>(bytes: &[u8]) -> Result<&[T]> {
    if bytes.is_empty() {
        return Ok(&[]);
    }
    bytemuck::try_cast_slice(bytes).map_err(|e| Error::Internal(format!("misaligned buffer: {e}")))
}

pub fn view_mut<T: bytemuck::Pod>(bytes: &mut [u8]) -> Result<&mut [T]> {
    if bytes.is_empty() {
        return Ok(&mut []);
    }
    bytemuck::try_cast_slice_mut(bytes).map_err(|e| Error::Internal(format!("misaligned buffer: {e}")))
}

/// `dst[i] = src[i]` converted from `dtype` to the accumulator type.
pub fn load<A: Accum>(src: &[u8], dtype: DType, dst: &mut [A]) -> Result<()> {
    match dtype {
        DType::F32 => dst.iter_mut().zip(view::<f32>(src)?).for_each(|(d, s)| *d = A::from_f32(*s)),
        DType::F64 => dst.iter_mut().zip(view::<f64>(src)?).for_each(|(d, s)| *d = A::from_f64(*s)),
        DType::BF16 => dst.iter_mut().zip(view::<bf16>(src)?).for_each(|(d, s)| *d = A::from_f32(s.to_f32())),
        DType::F16 => dst.iter_mut().zip(view::<f16>(src)?).for_each(|(d, s)| *d = A::from_f32(s.to_f32())),
        DType::F8E4M3FN | DType::F8E5M2 => return Err(super::fp8_on_cpu(dtype)),
    }
    Ok(())
}

/// `dst[i] = src[i]` converted from the accumulator type to `dtype` (rounding to nearest).
pub fn store<A: Accum>(src: &[A], dtype: DType, dst: &mut [u8]) -> Result<()> {
    match dtype {
        DType::F32 => view_mut::<f32>(dst)?.iter_mut().zip(src).for_each(|(d, s)| *d = s.to_f32()),
        DType::F64 => view_mut::<f64>(dst)?.iter_mut().zip(src).for_each(|(d, s)| *d = s.to_f64()),
        DType::BF16 => view_mut::<bf16>(dst)?.iter_mut().zip(src).for_each(|(d, s)| *d = bf16::from_f32(s.to_f32())),
        DType::F16 => view_mut::<f16>(dst)?.iter_mut().zip(src).for_each(|(d, s)| *d = f16::from_f32(s.to_f32())),
        DType::F8E4M3FN | DType::F8E5M2 => return Err(super::fp8_on_cpu(dtype)),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_through_each_dtype() {
        let values = [1.5f32, -2.25, 0.125, 3.0];
        for dtype in [DType::F32, DType::F64, DType::BF16, DType::F16] {
            let mut bytes = vec![0u64; 4]; // aligned storage
            let bytes = &mut bytemuck::cast_slice_mut::<u64, u8>(&mut bytes)[..4 * dtype.size()];
            store(&values, dtype, bytes).unwrap();
            let mut back = [0f32; 4];
            load(bytes, dtype, &mut back).unwrap();
            assert_eq!(back, values, "{dtype:?}");
        }
    }
}
