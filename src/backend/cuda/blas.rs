//! The safe layer over cuBLAS and cuBLASLt (`api`'s tables): the handles the
//! backend creates, released on drop, and the GEMMs it enqueues with them on
//! a call's memory, each operand's extent checked against the call's
//! [`CallMemory`] first (see `driver` for the rule on when that memory may be
//! used, which is why the GEMMs are visible to the CUDA backend only).

use super::api::{self, check_blas, check_lt};
use super::driver::{CallMemory, Queue, Stream};
use super::fp8_gemm::{LtCall, LtType};
use super::gemm::{cuda_type, ColMajor, Operands};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::problem::Gemm;
use cudarc::cublas::sys as blas_sys;
use cudarc::cublaslt::sys as lt_sys;
use std::ffi::c_void;
use std::ptr;
use std::sync::Arc;

/// A cuBLAS handle bound to one stream, which it keeps alive.
pub struct BlasHandle {
    raw: blas_sys::cublasHandle_t,
    stream: Arc<Stream>,
}

// SAFETY: a cuBLAS handle may be used from any thread, one at a time (the
// device's lock serialises its users).
unsafe impl Send for BlasHandle {}
// SAFETY: as above.
unsafe impl Sync for BlasHandle {}

impl BlasHandle {
    /// A handle in the current context whose GEMMs go to `stream`.
    pub fn new(stream: &Arc<Stream>) -> Result<BlasHandle> {
        let blas = api::cublas()?;
        let mut raw: blas_sys::cublasHandle_t = ptr::null_mut();
        // SAFETY: a valid out-pointer, in the current context.
        check_blas(unsafe { (blas.create)(&mut raw) }, "cublasCreate")?;
        let handle = BlasHandle { raw, stream: Arc::clone(stream) };
        // SAFETY: the handle was just created; the stream is live.
        check_blas(unsafe { (blas.set_stream)(raw, stream.raw() as blas_sys::cudaStream_t) }, "cublasSetStream")?;
        Ok(handle)
    }

    /// Whether the handle's GEMMs go to `stream`.
    pub fn is_on(&self, stream: &impl Queue) -> bool {
        self.stream.raw() == stream.raw()
    }

    /// Enqueues `g` on the handle's stream: f32 compute (bf16/f16 inputs
    /// accumulate in f32; f32 inputs use TF32 tensor cores when `tf32`, as
    /// XLA's own dot does at default precision), overwriting or
    /// (`accumulate`) adding to `dst`, after checking that every element of
    /// every operand lies in `memory`.
    pub(super) fn gemm(
        &self,
        g: &Gemm,
        ops: Operands,
        accumulate: bool,
        tf32: bool,
        memory: &CallMemory<'_>,
    ) -> Result<()> {
        let Some(c) = ColMajor::of(g)? else { return Ok(()) };
        let [(a, a_bytes), (b, b_bytes), (dst, dst_bytes)] = c.extents(ops);
        memory.check_read(a, a_bytes, "a GEMM's right operand")?;
        memory.check_read(b, b_bytes, "a GEMM's left operand")?;
        memory.check_write(dst, dst_bytes, "a GEMM's result")?;
        let gemm_ex = api::cublas()?.gemm_ex;
        let compute = if tf32 && ops.lhs.1 == DType::F32 && ops.rhs.1 == DType::F32 {
            blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32
        } else {
            blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F
        };
        let (alpha, beta) = (1.0f32, if accumulate { 1.0f32 } else { 0.0 });
        // The sizes fit in an int: checked by `ColMajor::of`.
        let int = |x: usize| x as std::ffi::c_int;
        // SAFETY: the handle is live; every operand lies in the call's
        // memory (checked above); alpha and beta are host f32 as COMPUTE_32F
        // requires, alive for the call.
        let status = unsafe {
            gemm_ex(
                self.raw,
                blas_sys::cublasOperation_t::CUBLAS_OP_N,
                blas_sys::cublasOperation_t::CUBLAS_OP_N,
                int(c.m),
                int(c.n),
                int(c.k),
                (&alpha as *const f32).cast(),
                a as *const c_void,
                cuda_type(ops.rhs.1)?,
                int(c.lda),
                b as *const c_void,
                cuda_type(ops.lhs.1)?,
                int(c.ldb),
                (&beta as *const f32).cast(),
                dst as *mut c_void,
                cuda_type(ops.dst.1)?,
                int(c.ldc),
                compute,
                blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        };
        check_blas(status, &format!("cublasGemmEx for {c:?}"))
    }
}

impl Drop for BlasHandle {
    fn drop(&mut self) {
        if let Ok(blas) = api::cublas() {
            // SAFETY: created in `new`, destroyed once.
            let _ = unsafe { (blas.destroy)(self.raw) };
        }
    }
}

fn data_type(t: LtType) -> lt_sys::cudaDataType {
    match t {
        LtType::E4M3 => lt_sys::cudaDataType::CUDA_R_8F_E4M3,
        LtType::E5M2 => lt_sys::cudaDataType::CUDA_R_8F_E5M2,
        LtType::Bf16 => lt_sys::cudaDataType::CUDA_R_16BF,
        LtType::F16 => lt_sys::cudaDataType::CUDA_R_16F,
        LtType::F32 => lt_sys::cudaDataType::CUDA_R_32F,
    }
}

/// The cudaDataType of each `LtType` (checked against cuBLASLt's values).
#[cfg(test)]
pub fn data_type_code(t: LtType) -> u32 {
    data_type(t) as u32
}

/// Host-side cuBLASLt descriptors, destroyed on drop (after
/// `cublasLtMatmul` has returned: it reads them while enqueueing only).
struct Descriptors<'a> {
    lt: &'a api::CublasLt,
    desc: lt_sys::cublasLtMatmulDesc_t,
    layouts: Vec<lt_sys::cublasLtMatrixLayout_t>,
    pref: lt_sys::cublasLtMatmulPreference_t,
}

impl Drop for Descriptors<'_> {
    fn drop(&mut self) {
        // SAFETY: each handle was created by this struct and is destroyed once.
        unsafe {
            for &l in &self.layouts {
                let _ = (self.lt.matrix_layout_destroy)(l);
            }
            if !self.desc.is_null() {
                let _ = (self.lt.matmul_desc_destroy)(self.desc);
            }
            if !self.pref.is_null() {
                let _ = (self.lt.preference_destroy)(self.pref);
            }
        }
    }
}

/// A cuBLASLt handle (not bound to a stream: each GEMM names its own).
pub struct LtHandle(lt_sys::cublasLtHandle_t);

// SAFETY: a cuBLASLt handle may be used from any thread, one at a time (the
// device's lock serialises its users).
unsafe impl Send for LtHandle {}
// SAFETY: as above.
unsafe impl Sync for LtHandle {}

impl LtHandle {
    pub fn new() -> Result<LtHandle> {
        let mut raw: lt_sys::cublasLtHandle_t = ptr::null_mut();
        // SAFETY: a valid out-pointer, in the current context.
        check_lt(unsafe { (api::cublaslt()?.create)(&mut raw) }, "cublasLtCreate")?;
        Ok(LtHandle(raw))
    }

    /// Enqueues `call` on `stream`, letting cuBLASLt use up to `workspace.1`
    /// bytes at `workspace.0`, after checking that the operands, the result,
    /// the two float32 scales and the workspace lie in `memory`.
    pub(super) fn matmul(
        &self,
        stream: &impl Queue,
        call: &LtCall,
        workspace: (u64, usize),
        memory: &CallMemory<'_>,
    ) -> Result<()> {
        let [(a, a_bytes), (b, b_bytes), (d, d_bytes)] = call.extents()?;
        memory.check_read(a, a_bytes, "an fp8 GEMM's A")?;
        memory.check_read(b, b_bytes, "an fp8 GEMM's B")?;
        memory.check_write(d, d_bytes, "an fp8 GEMM's D")?;
        memory.check_read(call.a_scale, 4, "an fp8 GEMM's scale of A")?;
        memory.check_read(call.b_scale, 4, "an fp8 GEMM's scale of B")?;
        memory.check_write(workspace.0, workspace.1, "an fp8 GEMM's workspace")?;
        let lt = api::cublaslt()?;
        let mut d = Descriptors { lt, desc: ptr::null_mut(), layouts: Vec::with_capacity(3), pref: ptr::null_mut() };
        let (compute, scale) = (lt_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F, lt_sys::cudaDataType::CUDA_R_32F);
        // SAFETY: a valid out-pointer.
        check_lt(unsafe { (lt.matmul_desc_create)(&mut d.desc, compute, scale) }, "cublasLtMatmulDescCreate")?;
        use lt_sys::cublasLtMatmulDescAttributes_t as A;
        // cublasOperation_t values: CUBLAS_OP_T = 1, CUBLAS_OP_N = 0.
        let (transa, transb): (i32, i32) = (1, 0);
        let (a_scale, b_scale) = (call.a_scale as *const c_void, call.b_scale as *const c_void);
        let attrs: [(A, *const c_void, usize); 4] = [
            (A::CUBLASLT_MATMUL_DESC_TRANSA, (&transa as *const i32).cast(), 4),
            (A::CUBLASLT_MATMUL_DESC_TRANSB, (&transb as *const i32).cast(), 4),
            (A::CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, (&a_scale as *const *const c_void).cast(), 8),
            (A::CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, (&b_scale as *const *const c_void).cast(), 8),
        ];
        for (attr, value, size) in attrs {
            // SAFETY: `d.desc` is live; `value` points at `size` bytes of the
            // attribute's type, alive for the call (cuBLASLt copies it).
            let status = unsafe { (lt.matmul_desc_set_attribute)(d.desc, attr, value, size) };
            check_lt(status, "cublasLtMatmulDescSetAttribute")?;
        }
        for l in [call.a_layout, call.b_layout, call.d_layout] {
            let mut layout = ptr::null_mut();
            // SAFETY: a valid out-pointer; the layout is destroyed with `d`.
            let status = unsafe { (lt.matrix_layout_create)(&mut layout, data_type(l.dtype), l.rows, l.cols, l.ld) };
            check_lt(status, "cublasLtMatrixLayoutCreate")?;
            d.layouts.push(layout);
        }
        // SAFETY: a valid out-pointer.
        check_lt(unsafe { (lt.preference_create)(&mut d.pref) }, "cublasLtMatmulPreferenceCreate")?;
        let max_workspace = workspace.1;
        // SAFETY: `d.pref` is live; the value is a `usize` (uint64_t) for the call.
        let status = unsafe {
            (lt.preference_set_attribute)(
                d.pref,
                lt_sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                (&max_workspace as *const usize).cast(),
                std::mem::size_of::<usize>(),
            )
        };
        check_lt(status, "cublasLtMatmulPreferenceSetAttribute")?;
        let (a, b, dl) = (d.layouts[0], d.layouts[1], d.layouts[2]);
        // SAFETY: an all-zero heuristic result is a valid bit pattern (plain integers and arrays).
        let mut heuristic: lt_sys::cublasLtMatmulHeuristicResult_t = unsafe { std::mem::zeroed() };
        let mut found = 0;
        // SAFETY: every descriptor is live; C and D share a layout; one result is asked for.
        let status =
            unsafe { (lt.algo_get_heuristic)(self.0, d.desc, a, b, dl, dl, d.pref, 1, &mut heuristic, &mut found) };
        check_lt(status, "cublasLtMatmulAlgoGetHeuristic")?;
        if found < 1 {
            return Err(Error::Internal("cuBLASLt has no fp8 algorithm for this shape and workspace".into()));
        }
        let (alpha, beta) = (1.0f32, call.beta);
        // SAFETY: every address was checked to lie in the call's memory, the
        // handle and stream are live while borrowed; alpha and beta are host floats (the default pointer mode), alive
        // for the call; the algorithm comes from this very configuration.
        let status = unsafe {
            (lt.matmul)(
                self.0,
                d.desc,
                (&alpha as *const f32).cast(),
                call.a as *const c_void,
                a,
                call.b as *const c_void,
                b,
                (&beta as *const f32).cast(),
                call.d as *const c_void,
                dl,
                call.d as *mut c_void,
                dl,
                &heuristic.algo,
                workspace.0 as *mut c_void,
                workspace.1,
                stream.raw() as lt_sys::cudaStream_t,
            )
        };
        check_lt(status, "cublasLtMatmul")
    }
}

impl Drop for LtHandle {
    fn drop(&mut self) {
        if let Ok(lt) = api::cublaslt() {
            // SAFETY: created in `new`, destroyed once.
            let _ = unsafe { (lt.destroy)(self.0) };
        }
    }
}
