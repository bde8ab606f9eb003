//! cuBLAS GEMMs on the strided row-major views of `Problem::gemms`, directly
//! on XLA's buffers.
//!
//! cuBLAS is column-major. A row-major matrix with row stride `s` is, read
//! column-major, its transpose with leading dimension `s`. So the row-major
//! `C[m,n] (+)= A[m,k] B[k,n]` is issued as the column-major
//! `Cᵀ[n,m] (+)= Bᵀ[n,k] Aᵀ[k,m]`: cuBLAS's first operand is B, its second A,
//! no transposes, leading dimensions the row strides. [`ColMajor::of`] is the
//! pure part (unit-tested against a host model of cuBLAS's semantics); the
//! call itself is `blas::BlasHandle::gemm`.
#![forbid(unsafe_code)]

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::problem::{Gemm, View};

/// One `cublasGemmEx` call without pointers: `C = alpha·op(A)·op(B) + beta·C`
/// column-major, no transposes, with element offsets into the buffers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ColMajor {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    /// cuBLAS's A is the row-major right operand.
    pub a_offset: usize,
    pub lda: usize,
    /// cuBLAS's B is the row-major left operand.
    pub b_offset: usize,
    pub ldb: usize,
    pub c_offset: usize,
    pub ldc: usize,
}

fn ld(view: &View) -> usize {
    view.row_stride.max(view.cols).max(1)
}

impl ColMajor {
    /// The call for `g`, or `None` when it has nothing to compute (an empty output).
    pub fn of(g: &Gemm) -> Result<Option<ColMajor>> {
        let (lhs, rhs, dst) = (g.lhs.1, g.rhs.1, g.dst);
        if lhs.cols != rhs.rows || dst.rows != lhs.rows || dst.cols != rhs.cols {
            return Err(Error::Internal(format!("GEMM shapes do not chain: {lhs:?} @ {rhs:?} -> {dst:?}")));
        }
        for v in [&lhs, &rhs, &dst] {
            if v.rows > 1 && v.row_stride < v.cols {
                return Err(Error::Internal(format!("row stride shorter than a row: {v:?}")));
            }
        }
        if dst.rows == 0 || dst.cols == 0 {
            return Ok(None);
        }
        let fits = |x: usize| i32::try_from(x).is_ok();
        let call = ColMajor {
            m: dst.cols,
            n: dst.rows,
            k: lhs.cols,
            a_offset: rhs.offset,
            lda: ld(&rhs),
            b_offset: lhs.offset,
            ldb: ld(&lhs),
            c_offset: dst.offset,
            ldc: ld(&dst),
        };
        if ![call.m, call.n, call.k, call.lda, call.ldb, call.ldc].into_iter().all(fits) {
            return Err(Error::Unimplemented(format!("a GEMM dimension exceeds cuBLAS's 32-bit sizes: {call:?}")));
        }
        Ok(Some(call))
    }
}

impl ColMajor {
    /// Device addresses of cuBLAS's A (the row-major right operand), B (the
    /// left one) and C for `ops`' buffers.
    pub fn addresses(&self, ops: Operands) -> (u64, u64, u64) {
        let at = |(base, dtype): (u64, DType), offset: usize| base + (offset * dtype.size()) as u64;
        (at(ops.rhs, self.a_offset), at(ops.lhs, self.b_offset), at(ops.dst, self.c_offset))
    }

    /// Where A, B and C start and how many bytes each spans: column-major
    /// `rows x cols` with leading dimension `ld` ends `(cols - 1) * ld + rows`
    /// elements in (the safe layer checks these against the call's memory,
    /// the host emulation against its buffers).
    pub fn extents(&self, ops: Operands) -> [(u64, usize); 3] {
        let (a, b, c) = self.addresses(ops);
        let span = |rows: usize, cols: usize, ld: usize, dtype: DType| ((cols - 1) * ld + rows) * dtype.size();
        [
            (a, span(self.m, self.k, self.lda, ops.rhs.1)),
            (b, span(self.k, self.n, self.ldb, ops.lhs.1)),
            (c, span(self.m, self.n, self.ldc, ops.dst.1)),
        ]
    }
}

/// cuBLAS's name for an element type (f64 is not offered on the GPU path).
pub fn cuda_type(dtype: DType) -> Result<cudarc::cublas::sys::cudaDataType> {
    use cudarc::cublas::sys::cudaDataType::*;
    match dtype {
        DType::F32 => Ok(CUDA_R_32F),
        DType::BF16 => Ok(CUDA_R_16BF),
        DType::F16 => Ok(CUDA_R_16F),
        DType::F64 => Err(Error::Unimplemented("the CUDA backend does not take float64".into())),
        // Resolver::lower sends fp8 GEMMs to cuBLASLt (`fp8_gemm`), never here.
        DType::F8E4M3FN | DType::F8E5M2 => Err(Error::Internal(format!("{} GEMM through cublasGemmEx", dtype.name()))),
    }
}

/// Buffers of one GEMM: base addresses and element types. `A` is how they
/// are addressed: `addresses::Addr` as lowered for a site, device addresses
/// once bound to a call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Operands<A = u64> {
    pub lhs: (A, DType),
    pub rhs: (A, DType),
    pub dst: (A, DType),
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::{plan, Action, Schedule};
    use crate::problem::{Operand, Problem, Side};

    /// cuBLAS's documented semantics, column-major, no transposes, on host arrays.
    fn host_gemm(c: &ColMajor, a: &[f64], b: &[f64], out: &mut [f64], beta: f64) {
        for j in 0..c.n {
            for i in 0..c.m {
                let mut acc = 0.0;
                for p in 0..c.k {
                    acc += a[c.a_offset + i + p * c.lda] * b[c.b_offset + p + j * c.ldb];
                }
                let o = &mut out[c.c_offset + i + j * c.ldc];
                *o = acc + beta * *o;
            }
        }
    }

    /// The row-major product the view describes, directly.
    fn row_major(g: &Gemm, lhs: &[f64], rhs: &[f64], out: &mut [f64], accumulate: bool) {
        let (l, r, d) = (g.lhs.1, g.rhs.1, g.dst);
        for i in 0..d.rows {
            for j in 0..d.cols {
                let mut acc = 0.0;
                for p in 0..l.cols {
                    acc += lhs[l.offset + i * l.row_stride + p] * rhs[r.offset + p * r.row_stride + j];
                }
                let o = &mut out[d.offset + i * d.row_stride + j];
                *o = acc + if accumulate { *o } else { 0.0 };
            }
        }
    }

    #[test]
    fn the_transpose_trick_computes_every_gemm_of_every_op() {
        let cases = crate::problem::tests::cases();
        let mut checked = 0;
        for (kind, x, w, out, d) in cases {
            let op = |dims| Operand { dims, dtype: DType::F32 };
            let p = Problem::new(kind, op(&x), op(&w), op(&out), d, 4).unwrap();
            let len = |dims: &[i64]| dims.iter().product::<i64>() as usize;
            // Distinct values everywhere, so a wrong offset or stride shows.
            let fill = |n: usize, salt: f64| (0..n).map(|i| ((i * 7 + 3) % 11) as f64 - 5.0 + salt).collect::<Vec<_>>();
            let (xs, ws) = (fill(len(&x), 0.25), fill(len(&w), 0.5));
            let out_len = len(&out).max(len(&x)).max(len(&w)) * 4;
            for rank in 0..4 {
                for step in plan(p.pattern(), Schedule::Ring, 4, rank).steps {
                    let Action::Matmul { block, src, dst, accumulate, .. } = step.action else { continue };
                    for g in p.gemms(block, src, dst) {
                        let side = |s: Side| if s == Side::Src { &xs } else { &ws };
                        let (lhs, rhs) = (side(g.lhs.0), side(g.rhs.0));
                        let c = ColMajor::of(&g).unwrap().expect("non-empty");
                        let start = fill(out_len, 0.125);
                        let (mut want, mut got) = (start.clone(), start);
                        row_major(&g, lhs, rhs, &mut want, accumulate);
                        host_gemm(&c, rhs, lhs, &mut got, if accumulate { 1.0 } else { 0.0 });
                        assert_eq!(want, got, "{kind:?} rank {rank} {g:?}");
                        checked += 1;
                    }
                }
            }
        }
        assert!(checked > 100, "{checked}");
    }

    #[test]
    fn empty_and_inconsistent_gemms() {
        let v = |rows, cols| View { offset: 0, rows, cols, row_stride: cols };
        let empty = Gemm { lhs: (Side::Src, v(0, 4)), rhs: (Side::W, v(4, 3)), dst: v(0, 3) };
        assert_eq!(ColMajor::of(&empty).unwrap(), None);
        let bad = Gemm { lhs: (Side::Src, v(2, 4)), rhs: (Side::W, v(5, 3)), dst: v(2, 3) };
        assert!(ColMajor::of(&bad).is_err());
        assert!(cuda_type(DType::F64).is_err());
    }
}
