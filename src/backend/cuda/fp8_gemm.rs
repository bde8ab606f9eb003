//! fp8 GEMMs through cuBLASLt (sm_90): e4m3/e5m2 operands with per-tensor
//! float32 scales, f32 accumulation, bf16/f16/f32 output.
//!
//! One GEMM computes, row-major,
//! `out[m, n] (+)= x_scale * w_scale * (x[m, k] · w[k, n])`, where `x` is
//! stored `[m, k]` (row stride `ldx`) and `w` is stored **K-major**, `[n, k]`
//! (row stride `ldw`): cuBLASLt's fp8 kernels only take the "TN" layout
//! (A transposed, B not), which in the column-major view of these row-major
//! buffers means both operands contiguous along `k`. `x_scale` and `w_scale`
//! are device addresses of one float32 each (`CUBLASLT_MATMUL_DESC_B/A_SCALE_POINTER`),
//! read by the kernel, so scales computed on the device never go through the
//! host.
//!
//! [`Fp8Gemm::lower`] (pure, tested without a device) checks cuBLASLt's fp8
//! rules and gives the descriptors' contents; `blas::LtHandle::matmul` builds
//! them and enqueues `cublasLtMatmul`. `addresses::Resolver::fp8_gemm` builds them from
//! the plans' GEMM views (the lowering asks XLA for `w` in K-major layout).
#![forbid(unsafe_code)]

use crate::error::{Error, Result};

/// An fp8 format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fp8 {
    /// `float8_e4m3fn`: more precision (activations and weights).
    E4M3,
    /// `float8_e5m2`: more range (gradients).
    E5M2,
}

/// The output (and accumulated-into) type of an fp8 GEMM.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutType {
    Bf16,
    F16,
    F32,
}

/// cuBLASLt's data types, as `cudaDataType_t` values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LtType {
    E4M3,
    E5M2,
    Bf16,
    F16,
    F32,
}

impl From<Fp8> for LtType {
    fn from(f: Fp8) -> LtType {
        match f {
            Fp8::E4M3 => LtType::E4M3,
            Fp8::E5M2 => LtType::E5M2,
        }
    }
}

impl From<OutType> for LtType {
    fn from(o: OutType) -> LtType {
        match o {
            OutType::Bf16 => LtType::Bf16,
            OutType::F16 => LtType::F16,
            OutType::F32 => LtType::F32,
        }
    }
}

/// One operand or result: an address (`A`: a device address, or
/// `addresses::Addr` as lowered for a site), its element type, its row stride.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Matrix<T, A = u64> {
    pub addr: A,
    pub dtype: T,
    /// Elements between consecutive rows (row-major).
    pub ld: usize,
}

/// One fp8 GEMM (see the module comment for the layouts), addressed as `A`
/// (see `Matrix`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fp8Gemm<A = u64> {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    /// `[m, k]`, row stride `ld`.
    pub x: Matrix<Fp8, A>,
    /// `[n, k]` (K-major), row stride `ld`.
    pub w: Matrix<Fp8, A>,
    /// `[m, n]`, row stride `ld`.
    pub out: Matrix<OutType, A>,
    /// Addresses of one float32 each.
    pub x_scale: A,
    pub w_scale: A,
    /// Adds to `out` (beta = 1) instead of overwriting it.
    pub accumulate: bool,
}

/// A column-major matrix layout (`cublasLtMatrixLayoutCreate`'s arguments).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    pub dtype: LtType,
    pub rows: u64,
    pub cols: u64,
    pub ld: i64,
}

/// The contents of one `cublasLtMatmul` call: D = alpha·op(A)·op(B) + beta·C
/// with C = D, compute type `CUBLAS_COMPUTE_32F`, scale type float32,
/// `transa` = T, `transb` = N, and the scales of A and B as device pointers.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LtCall {
    pub a: u64,
    pub a_layout: Layout,
    pub a_scale: u64,
    pub b: u64,
    pub b_layout: Layout,
    pub b_scale: u64,
    pub d: u64,
    pub d_layout: Layout,
    pub beta: f32,
}

impl LtType {
    pub fn size(self) -> usize {
        match self {
            LtType::E4M3 | LtType::E5M2 => 1,
            LtType::Bf16 | LtType::F16 => 2,
            LtType::F32 => 4,
        }
    }
}

impl LtCall {
    /// Where A, B and D start and how many bytes each spans (the stored
    /// column-major matrices, before the transpose: `(cols - 1) * ld + rows`
    /// elements), for the safe layer's and the emulation's checks.
    pub fn extents(&self) -> Result<[(u64, usize); 3]> {
        let span = |l: &Layout| -> Result<usize> {
            let (rows, cols, ld) = (l.rows as usize, l.cols as usize, l.ld as usize);
            if rows == 0 || cols == 0 {
                return Err(Error::Internal(format!("an empty fp8 GEMM operand {l:?}")));
            }
            Ok(((cols - 1) * ld + rows) * l.dtype.size())
        };
        Ok([(self.a, span(&self.a_layout)?), (self.b, span(&self.b_layout)?), (self.d, span(&self.d_layout)?)])
    }
}

/// Bytes every fp8 operand pointer is aligned to, and that `k` and every
/// leading dimension are multiples of (in fp8 elements: one byte each), as
/// cuBLASLt's fp8 kernels require.
pub const FP8_ALIGN: usize = 16;

impl Fp8Gemm {
    /// Checks the GEMM against cuBLASLt's fp8 rules on a device of compute
    /// capability `(major, minor)` and maps it onto one `cublasLtMatmul`:
    /// out^T[n, m] = (w_kmajor)^T · x^T in the column-major view, i.e.
    /// A = `w` (k × n, ld `ldw`, transposed), B = `x` (k × m, ld `ldx`), D = C
    /// = `out` (n × m, ld `ldo`); A's scale is `w_scale`, B's `x_scale`.
    pub fn lower(&self, capability: (i32, i32)) -> Result<LtCall> {
        if capability.0 < 9 {
            return Err(Error::Unimplemented(format!(
                "fp8 GEMMs need compute capability 9.0 (sm_90) or newer; this device is sm_{}{}",
                capability.0, capability.1
            )));
        }
        if self.x.dtype == Fp8::E5M2 && self.w.dtype == Fp8::E5M2 {
            return Err(Error::Unimplemented(
                "cuBLASLt has no fp8 GEMM with both operands float8_e5m2; make one of them float8_e4m3fn".into(),
            ));
        }
        if self.m == 0 || self.n == 0 || self.k == 0 {
            return Err(Error::InvalidArgument(format!(
                "fp8 GEMM of an empty shape (m {}, n {}, k {})",
                self.m, self.n, self.k
            )));
        }
        let misaligned = |what: &str, v: usize| {
            (v % FP8_ALIGN != 0).then(|| format!("{what} ({v}) is not a multiple of {FP8_ALIGN}"))
        };
        let problems: Vec<String> = [
            misaligned("k", self.k),
            misaligned("x's row stride", self.x.ld),
            misaligned("w's row stride", self.w.ld),
            misaligned("x's address", self.x.addr as usize),
            misaligned("w's address", self.w.addr as usize),
        ]
        .into_iter()
        .flatten()
        .collect();
        if !problems.is_empty() {
            return Err(Error::InvalidArgument(format!(
                "cuBLASLt's fp8 GEMMs need 16-byte aligned operands: {}",
                problems.join("; ")
            )));
        }
        if self.x.ld < self.k || self.w.ld < self.k || self.out.ld < self.n {
            return Err(Error::InvalidArgument(format!(
                "row strides too small: x {} and w {} (k {}), out {} (n {})",
                self.x.ld, self.w.ld, self.k, self.out.ld, self.n
            )));
        }
        if self.x_scale == 0 || self.w_scale == 0 {
            return Err(Error::InvalidArgument("fp8 GEMM without a scale address".into()));
        }
        let dim = |v: usize| u64::try_from(v).map_err(|_| Error::InvalidArgument(format!("{v} out of range")));
        let ld = |v: usize| i64::try_from(v).map_err(|_| Error::InvalidArgument(format!("{v} out of range")));
        Ok(LtCall {
            a: self.w.addr,
            a_layout: Layout { dtype: self.w.dtype.into(), rows: dim(self.k)?, cols: dim(self.n)?, ld: ld(self.w.ld)? },
            a_scale: self.w_scale,
            b: self.x.addr,
            b_layout: Layout { dtype: self.x.dtype.into(), rows: dim(self.k)?, cols: dim(self.m)?, ld: ld(self.x.ld)? },
            b_scale: self.x_scale,
            d: self.out.addr,
            d_layout: Layout {
                dtype: self.out.dtype.into(),
                rows: dim(self.n)?,
                cols: dim(self.m)?,
                ld: ld(self.out.ld)?,
            },
            beta: if self.accumulate { 1.0 } else { 0.0 },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gemm(m: usize, n: usize, k: usize) -> Fp8Gemm {
        Fp8Gemm {
            m,
            n,
            k,
            x: Matrix { addr: 0x1000, dtype: Fp8::E4M3, ld: k },
            w: Matrix { addr: 0x8000, dtype: Fp8::E4M3, ld: k },
            out: Matrix { addr: 0x10000, dtype: OutType::Bf16, ld: n },
            x_scale: 0x20000,
            w_scale: 0x20004,
            accumulate: false,
        }
    }

    #[test]
    fn row_major_fp8_gemms_map_to_tn_column_major_calls() {
        let call = gemm(48, 80, 64).lower((9, 0)).unwrap();
        // A = w, K-major: k x n column-major with ld k, transposed by the call.
        assert_eq!((call.a, call.a_scale), (0x8000, 0x20004));
        assert_eq!(call.a_layout, Layout { dtype: LtType::E4M3, rows: 64, cols: 80, ld: 64 });
        // B = x: k x m column-major with ld k.
        assert_eq!((call.b, call.b_scale), (0x1000, 0x20000));
        assert_eq!(call.b_layout, Layout { dtype: LtType::E4M3, rows: 64, cols: 48, ld: 64 });
        // D = C = out^T: n x m column-major with ld n.
        assert_eq!(call.d_layout, Layout { dtype: LtType::Bf16, rows: 80, cols: 48, ld: 80 });
        assert_eq!(call.beta, 0.0);
        let mut acc = gemm(16, 16, 16);
        acc.accumulate = true;
        acc.out = Matrix { addr: 0x40000, dtype: OutType::F32, ld: 32 };
        let call = acc.lower((10, 0)).unwrap();
        assert_eq!(call.beta, 1.0);
        assert_eq!(call.d_layout, Layout { dtype: LtType::F32, rows: 16, cols: 16, ld: 32 });
    }

    /// The column-major call computes the row-major product: evaluate the
    /// call's D = op(A)·op(B) on host data laid out as `lower` says.
    #[test]
    fn the_lowered_call_computes_x_times_w() {
        let (m, n, k) = (3usize, 5usize, 16usize);
        let (ldx, ldw, ldo) = (32usize, 16usize, 7usize);
        let x: Vec<f32> = (0..m * ldx).map(|i| (i % 7) as f32).collect();
        let w_kmajor: Vec<f32> = (0..n * ldw).map(|i| (i % 5) as f32 - 2.0).collect();
        let mut g = gemm(m, n, k);
        g.x.ld = ldx;
        g.w.ld = ldw;
        g.out.ld = ldo;
        let call = g.lower((9, 0)).unwrap();
        // Column-major element (r, c) of a layout is at c * ld + r.
        let a = |r: usize, c: usize| w_kmajor[c * call.a_layout.ld as usize + r]; // k x n
        let b = |r: usize, c: usize| x[c * call.b_layout.ld as usize + r]; // k x m
        let mut d = vec![0f32; m * ldo];
        for c in 0..call.d_layout.cols as usize {
            for r in 0..call.d_layout.rows as usize {
                // op(A) = A^T (n x k): op(A)(r, kk) = A(kk, r).
                d[c * call.d_layout.ld as usize + r] = (0..k).map(|kk| a(kk, r) * b(kk, c)).sum();
            }
        }
        for i in 0..m {
            for j in 0..n {
                let want: f32 = (0..k).map(|kk| x[i * ldx + kk] * w_kmajor[j * ldw + kk]).sum();
                assert_eq!(d[i * ldo + j], want, "out[{i}, {j}]");
            }
        }
    }

    #[test]
    fn cublaslt_fp8_rules_are_checked_with_clear_errors() {
        let e = gemm(16, 16, 16).lower((8, 0)).unwrap_err();
        assert!(matches!(&e, Error::Unimplemented(m) if m.contains("sm_80")), "{e}");
        let mut both = gemm(16, 16, 16);
        both.x.dtype = Fp8::E5M2;
        both.w.dtype = Fp8::E5M2;
        assert!(matches!(both.lower((9, 0)), Err(Error::Unimplemented(_))));
        both.w.dtype = Fp8::E4M3;
        assert_eq!(both.lower((9, 0)).unwrap().b_layout.dtype, LtType::E5M2);
        let e = gemm(16, 16, 24).lower((9, 0)).unwrap_err();
        assert!(matches!(&e, Error::InvalidArgument(m) if m.contains("k (24)")), "{e}");
        let mut odd = gemm(16, 16, 16);
        odd.x.addr += 8;
        odd.w.ld = 40;
        let e = odd.lower((9, 0)).unwrap_err();
        assert!(e.message().contains("x's address") && e.message().contains("w's row stride"), "{e}");
        let mut short = gemm(16, 32, 32);
        short.out.ld = 16;
        assert!(matches!(short.lower((9, 0)), Err(Error::InvalidArgument(_))));
        let mut unscaled = gemm(16, 16, 16);
        unscaled.x_scale = 0;
        assert!(matches!(unscaled.lower((9, 0)), Err(Error::InvalidArgument(_))));
        assert!(matches!(gemm(0, 16, 16).lower((9, 0)), Err(Error::InvalidArgument(_))));
    }

    #[test]
    fn data_types_are_cudas() {
        // cudaDataType_t values from library_types.h.
        let codes = [(LtType::E4M3, 28), (LtType::E5M2, 29), (LtType::Bf16, 14), (LtType::F16, 2), (LtType::F32, 0)];
        for (t, code) in codes {
            assert_eq!(crate::backend::cuda::blas::data_type_code(t), code, "{t:?}");
        }
    }
}
