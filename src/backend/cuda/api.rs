//! The CUDA libraries' C functions the backend calls, as tables of typed
//! function pointers resolved from the libraries `libs` opened (the `sys`
//! layer), with cudarc's generated types for every handle, enum and struct;
//! and the mapping of their status codes onto [`Error`] (the `result`
//! layer). Each table is loaded once per process, on first use; a missing
//! library or symbol is UNIMPLEMENTED saying which and what provides it.
//! Nothing here calls into cudarc's own loader (see `libs`).

use super::libs::{self, Found, Lib};
use crate::error::{Error, Result};
use cudarc::cublas::sys as blas;
use cudarc::cublaslt::sys as lt;
use cudarc::driver::sys as cu;
use cudarc::nccl::sys as nccl;
use cudarc::nvrtc::sys as nvrtc;
use std::ffi::{c_char, c_int, c_uint, c_void};
use std::sync::OnceLock;

/// Declares a table of C functions and its loader: each field is resolved
/// from the library by the symbol name given.
macro_rules! functions {
    ($(#[$doc:meta])* $table:ident { $( $field:ident = $symbol:literal : fn($($arg:ty),* $(,)?) -> $ret:ty; )* }) => {
        $(#[$doc])*
        pub struct $table { $( pub $field: unsafe extern "C" fn($($arg),*) -> $ret, )* }

        impl $table {
            /// Resolves every function of the table.
            ///
            /// # Safety
            /// `library` must export each symbol with the signature declared.
            unsafe fn load(library: &libloading::os::unix::Library) -> std::result::Result<Self, String> {
                Ok(Self { $(
                    // SAFETY: the caller's contract.
                    $field: *unsafe {
                        library.get::<unsafe extern "C" fn($($arg),*) -> $ret>(concat!($symbol, "\0").as_bytes())
                    }.map_err(|_| format!("it has no function {}", $symbol))?,
                )* })
            }
        }
    };
}

functions! {
    /// The driver API (`libcuda.so.1`); the `_v2` names are what `cuda.h` maps the plain ones to.
    Driver {
        init = "cuInit": fn(c_uint) -> cu::CUresult;
        driver_get_version = "cuDriverGetVersion": fn(*mut c_int) -> cu::CUresult;
        device_get = "cuDeviceGet": fn(*mut cu::CUdevice, c_int) -> cu::CUresult;
        device_get_count = "cuDeviceGetCount": fn(*mut c_int) -> cu::CUresult;
        device_get_attribute = "cuDeviceGetAttribute": fn(*mut c_int, cu::CUdevice_attribute, cu::CUdevice) -> cu::CUresult;
        device_get_name = "cuDeviceGetName": fn(*mut c_char, c_int, cu::CUdevice) -> cu::CUresult;
        primary_ctx_retain = "cuDevicePrimaryCtxRetain": fn(*mut cu::CUcontext, cu::CUdevice) -> cu::CUresult;
        primary_ctx_release = "cuDevicePrimaryCtxRelease_v2": fn(cu::CUdevice) -> cu::CUresult;
        ctx_set_current = "cuCtxSetCurrent": fn(cu::CUcontext) -> cu::CUresult;
        ctx_get_device = "cuCtxGetDevice": fn(*mut cu::CUdevice) -> cu::CUresult;
        stream_get_ctx = "cuStreamGetCtx": fn(cu::CUstream, *mut cu::CUcontext) -> cu::CUresult;
        stream_create = "cuStreamCreate": fn(*mut cu::CUstream, c_uint) -> cu::CUresult;
        stream_destroy = "cuStreamDestroy_v2": fn(cu::CUstream) -> cu::CUresult;
        stream_wait_event = "cuStreamWaitEvent": fn(cu::CUstream, cu::CUevent, c_uint) -> cu::CUresult;
        stream_synchronize = "cuStreamSynchronize": fn(cu::CUstream) -> cu::CUresult;
        event_create = "cuEventCreate": fn(*mut cu::CUevent, c_uint) -> cu::CUresult;
        event_destroy = "cuEventDestroy_v2": fn(cu::CUevent) -> cu::CUresult;
        event_record = "cuEventRecord": fn(cu::CUevent, cu::CUstream) -> cu::CUresult;
        event_query = "cuEventQuery": fn(cu::CUevent) -> cu::CUresult;
        event_elapsed_time = "cuEventElapsedTime": fn(*mut f32, cu::CUevent, cu::CUevent) -> cu::CUresult;
        module_load_data = "cuModuleLoadData": fn(*mut cu::CUmodule, *const c_void) -> cu::CUresult;
        module_get_function = "cuModuleGetFunction": fn(*mut cu::CUfunction, cu::CUmodule, *const c_char) -> cu::CUresult;
        module_unload = "cuModuleUnload": fn(cu::CUmodule) -> cu::CUresult;
        launch_kernel = "cuLaunchKernel": fn(
            cu::CUfunction, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, cu::CUstream,
            *mut *mut c_void, *mut *mut c_void,
        ) -> cu::CUresult;
        mem_alloc = "cuMemAlloc_v2": fn(*mut cu::CUdeviceptr, usize) -> cu::CUresult;
        mem_free = "cuMemFree_v2": fn(cu::CUdeviceptr) -> cu::CUresult;
        memcpy_htod = "cuMemcpyHtoD_v2": fn(cu::CUdeviceptr, *const c_void, usize) -> cu::CUresult;
        memcpy_dtoh = "cuMemcpyDtoH_v2": fn(*mut c_void, cu::CUdeviceptr, usize) -> cu::CUresult;
        memset_d8_async = "cuMemsetD8Async": fn(cu::CUdeviceptr, u8, usize, cu::CUstream) -> cu::CUresult;
        memcpy_2d_async = "cuMemcpy2DAsync_v2": fn(*const cu::CUDA_MEMCPY2D, cu::CUstream) -> cu::CUresult;
        memcpy_dtod_async = "cuMemcpyDtoDAsync_v2": fn(cu::CUdeviceptr, cu::CUdeviceptr, usize, cu::CUstream) -> cu::CUresult;
        device_can_access_peer = "cuDeviceCanAccessPeer": fn(*mut c_int, cu::CUdevice, cu::CUdevice) -> cu::CUresult;
        ctx_enable_peer_access = "cuCtxEnablePeerAccess": fn(cu::CUcontext, c_uint) -> cu::CUresult;
        launch_host_func = "cuLaunchHostFunc": fn(cu::CUstream, cu::CUhostFn, *mut c_void) -> cu::CUresult;
    }
}

functions! {
    /// cuBLAS (`libcublas.so.13` / `.12`).
    Cublas {
        create = "cublasCreate_v2": fn(*mut blas::cublasHandle_t) -> blas::cublasStatus_t;
        destroy = "cublasDestroy_v2": fn(blas::cublasHandle_t) -> blas::cublasStatus_t;
        set_stream = "cublasSetStream_v2": fn(blas::cublasHandle_t, blas::cudaStream_t) -> blas::cublasStatus_t;
        get_property = "cublasGetProperty": fn(c_int, *mut c_int) -> blas::cublasStatus_t;
        gemm_ex = "cublasGemmEx": fn(
            blas::cublasHandle_t, blas::cublasOperation_t, blas::cublasOperation_t, c_int, c_int, c_int,
            *const c_void, *const c_void, blas::cudaDataType, c_int, *const c_void, blas::cudaDataType, c_int,
            *const c_void, *mut c_void, blas::cudaDataType, c_int, blas::cublasComputeType_t, blas::cublasGemmAlgo_t,
        ) -> blas::cublasStatus_t;
    }
}

functions! {
    /// cuBLASLt (`libcublasLt.so.13` / `.12`): the fp8 GEMMs.
    CublasLt {
        get_version = "cublasLtGetVersion": fn() -> usize;
        create = "cublasLtCreate": fn(*mut lt::cublasLtHandle_t) -> lt::cublasStatus_t;
        destroy = "cublasLtDestroy": fn(lt::cublasLtHandle_t) -> lt::cublasStatus_t;
        matmul_desc_create = "cublasLtMatmulDescCreate":
            fn(*mut lt::cublasLtMatmulDesc_t, lt::cublasComputeType_t, lt::cudaDataType_t) -> lt::cublasStatus_t;
        matmul_desc_destroy = "cublasLtMatmulDescDestroy": fn(lt::cublasLtMatmulDesc_t) -> lt::cublasStatus_t;
        matmul_desc_set_attribute = "cublasLtMatmulDescSetAttribute": fn(
            lt::cublasLtMatmulDesc_t, lt::cublasLtMatmulDescAttributes_t, *const c_void, usize,
        ) -> lt::cublasStatus_t;
        matrix_layout_create = "cublasLtMatrixLayoutCreate":
            fn(*mut lt::cublasLtMatrixLayout_t, lt::cudaDataType, u64, u64, i64) -> lt::cublasStatus_t;
        matrix_layout_destroy = "cublasLtMatrixLayoutDestroy": fn(lt::cublasLtMatrixLayout_t) -> lt::cublasStatus_t;
        preference_create = "cublasLtMatmulPreferenceCreate": fn(*mut lt::cublasLtMatmulPreference_t) -> lt::cublasStatus_t;
        preference_destroy = "cublasLtMatmulPreferenceDestroy": fn(lt::cublasLtMatmulPreference_t) -> lt::cublasStatus_t;
        preference_set_attribute = "cublasLtMatmulPreferenceSetAttribute": fn(
            lt::cublasLtMatmulPreference_t, lt::cublasLtMatmulPreferenceAttributes_t, *const c_void, usize,
        ) -> lt::cublasStatus_t;
        algo_get_heuristic = "cublasLtMatmulAlgoGetHeuristic": fn(
            lt::cublasLtHandle_t, lt::cublasLtMatmulDesc_t, lt::cublasLtMatrixLayout_t, lt::cublasLtMatrixLayout_t,
            lt::cublasLtMatrixLayout_t, lt::cublasLtMatrixLayout_t, lt::cublasLtMatmulPreference_t, c_int,
            *mut lt::cublasLtMatmulHeuristicResult_t, *mut c_int,
        ) -> lt::cublasStatus_t;
        matmul = "cublasLtMatmul": fn(
            lt::cublasLtHandle_t, lt::cublasLtMatmulDesc_t, *const c_void, *const c_void, lt::cublasLtMatrixLayout_t,
            *const c_void, lt::cublasLtMatrixLayout_t, *const c_void, *const c_void, lt::cublasLtMatrixLayout_t,
            *mut c_void, lt::cublasLtMatrixLayout_t, *const lt::cublasLtMatmulAlgo_t, *mut c_void, usize,
            lt::cudaStream_t,
        ) -> lt::cublasStatus_t;
    }
}

functions! {
    /// NCCL (`libnccl.so.2`): communicators and point-to-point transfers.
    Nccl {
        get_version = "ncclGetVersion": fn(*mut c_int) -> nccl::ncclResult_t;
        get_unique_id = "ncclGetUniqueId": fn(*mut nccl::ncclUniqueId) -> nccl::ncclResult_t;
        comm_init_rank_config = "ncclCommInitRankConfig": fn(
            *mut nccl::ncclComm_t, c_int, nccl::ncclUniqueId, c_int, *mut nccl::ncclConfig_t,
        ) -> nccl::ncclResult_t;
        comm_get_async_error = "ncclCommGetAsyncError": fn(nccl::ncclComm_t, *mut nccl::ncclResult_t) -> nccl::ncclResult_t;
        comm_abort = "ncclCommAbort": fn(nccl::ncclComm_t) -> nccl::ncclResult_t;
        group_start = "ncclGroupStart": fn() -> nccl::ncclResult_t;
        group_end = "ncclGroupEnd": fn() -> nccl::ncclResult_t;
        send = "ncclSend": fn(
            *const c_void, usize, nccl::ncclDataType_t, c_int, nccl::ncclComm_t, nccl::cudaStream_t,
        ) -> nccl::ncclResult_t;
        recv = "ncclRecv": fn(
            *mut c_void, usize, nccl::ncclDataType_t, c_int, nccl::ncclComm_t, nccl::cudaStream_t,
        ) -> nccl::ncclResult_t;
    }
}

functions! {
    /// NVRTC (`libnvrtc.so.13` / `.12`): compiles `kernels/` to CUBIN.
    Nvrtc {
        version = "nvrtcVersion": fn(*mut c_int, *mut c_int) -> nvrtc::nvrtcResult;
        get_num_supported_archs = "nvrtcGetNumSupportedArchs": fn(*mut c_int) -> nvrtc::nvrtcResult;
        get_supported_archs = "nvrtcGetSupportedArchs": fn(*mut c_int) -> nvrtc::nvrtcResult;
        create_program = "nvrtcCreateProgram": fn(
            *mut nvrtc::nvrtcProgram, *const c_char, *const c_char, c_int, *const *const c_char, *const *const c_char,
        ) -> nvrtc::nvrtcResult;
        compile_program = "nvrtcCompileProgram": fn(nvrtc::nvrtcProgram, c_int, *const *const c_char) -> nvrtc::nvrtcResult;
        get_program_log_size = "nvrtcGetProgramLogSize": fn(nvrtc::nvrtcProgram, *mut usize) -> nvrtc::nvrtcResult;
        get_program_log = "nvrtcGetProgramLog": fn(nvrtc::nvrtcProgram, *mut c_char) -> nvrtc::nvrtcResult;
        get_cubin_size = "nvrtcGetCUBINSize": fn(nvrtc::nvrtcProgram, *mut usize) -> nvrtc::nvrtcResult;
        get_cubin = "nvrtcGetCUBIN": fn(nvrtc::nvrtcProgram, *mut c_char) -> nvrtc::nvrtcResult;
        get_ptx_size = "nvrtcGetPTXSize": fn(nvrtc::nvrtcProgram, *mut usize) -> nvrtc::nvrtcResult;
        get_ptx = "nvrtcGetPTX": fn(nvrtc::nvrtcProgram, *mut c_char) -> nvrtc::nvrtcResult;
        destroy_program = "nvrtcDestroyProgram": fn(*mut nvrtc::nvrtcProgram) -> nvrtc::nvrtcResult;
    }
}

/// A table with the library it came from, open for the life of the process.
pub struct Loaded<T> {
    pub table: T,
    /// The file the loader mapped (`dladdr` of a function in it).
    pub path: Option<String>,
    pub found: Found,
    _library: libloading::os::unix::Library,
}

type Slot<T> = OnceLock<std::result::Result<Loaded<T>, String>>;

/// Opens `lib` and resolves its table once; afterwards returns the same.
fn loaded<T>(
    slot: &'static Slot<T>,
    lib: Lib,
    resolve: unsafe fn(&libloading::os::unix::Library) -> std::result::Result<T, String>,
    probe: fn(&T) -> *const c_void,
) -> Result<&'static Loaded<T>> {
    slot.get_or_init(|| {
        let opened = libs::open(lib)?;
        // SAFETY: the library was found under its own soname; the tables
        // declare the signatures of its public headers.
        let table =
            unsafe { resolve(&opened.library) }.map_err(|e| format!("{} is unusable: {e}", opened.soname_or_file))?;
        // SAFETY: the address of a function the table just resolved.
        let path = unsafe { libs::file_of(probe(&table)) };
        Ok(Loaded { table, path, found: opened.found, _library: opened.library })
    })
    .as_ref()
    .map_err(|e| Error::Unimplemented(format!("the CUDA backend cannot load {}: {e}", lib.key())))
}

static DRIVER: Slot<Driver> = OnceLock::new();
static CUBLAS: Slot<Cublas> = OnceLock::new();
static CUBLASLT: Slot<CublasLt> = OnceLock::new();
static NCCL: Slot<Nccl> = OnceLock::new();
static NVRTC: Slot<Nvrtc> = OnceLock::new();

pub fn driver_lib() -> Result<&'static Loaded<Driver>> {
    loaded(&DRIVER, Lib::Driver, Driver::load, |t| t.init as *const c_void)
}
pub fn cublas_lib() -> Result<&'static Loaded<Cublas>> {
    loaded(&CUBLAS, Lib::Cublas, Cublas::load, |t| t.create as *const c_void)
}
pub fn cublaslt_lib() -> Result<&'static Loaded<CublasLt>> {
    loaded(&CUBLASLT, Lib::CublasLt, CublasLt::load, |t| t.create as *const c_void)
}
pub fn nccl_lib() -> Result<&'static Loaded<Nccl>> {
    loaded(&NCCL, Lib::Nccl, Nccl::load, |t| t.get_version as *const c_void)
}
pub fn nvrtc_lib() -> Result<&'static Loaded<Nvrtc>> {
    loaded(&NVRTC, Lib::Nvrtc, Nvrtc::load, |t| t.version as *const c_void)
}

/// The driver's table (`cuInit` done once).
pub fn driver() -> Result<&'static Driver> {
    static INIT: OnceLock<std::result::Result<(), String>> = OnceLock::new();
    let d = &driver_lib()?.table;
    // SAFETY: `cuInit(0)` may be called any number of times from any thread.
    INIT.get_or_init(|| check_cu(unsafe { (d.init)(0) }, "cuInit").map_err(|e| e.message().to_string()))
        .clone()
        .map_err(Error::Internal)?;
    Ok(d)
}
pub fn cublas() -> Result<&'static Cublas> {
    Ok(&cublas_lib()?.table)
}
pub fn cublaslt() -> Result<&'static CublasLt> {
    Ok(&cublaslt_lib()?.table)
}
pub fn nccl() -> Result<&'static Nccl> {
    Ok(&nccl_lib()?.table)
}
pub fn nvrtc() -> Result<&'static Nvrtc> {
    Ok(&nvrtc_lib()?.table)
}

/// `Ok` when every library in `libs` loads, else the first one's UNIMPLEMENTED.
pub fn require(libs: &[Lib]) -> Result<()> {
    for lib in libs {
        match lib {
            Lib::Driver => driver().map(drop)?,
            Lib::Cublas => cublas().map(drop)?,
            Lib::CublasLt => cublaslt().map(drop)?,
            Lib::Nccl => nccl().map(drop)?,
            Lib::Nvrtc => nvrtc().map(drop)?,
        }
    }
    Ok(())
}

// ---- status codes -------------------------------------------------------------

/// A driver status as INTERNAL naming the call and the raw code.
pub fn check_cu(status: cu::CUresult, what: &str) -> Result<()> {
    match status {
        cu::CUresult::CUDA_SUCCESS => Ok(()),
        other => Err(Error::Internal(format!("CUDA driver {what}: {other:?} (code {})", other as u32))),
    }
}

/// A cuBLAS status as INTERNAL naming the call and the raw code.
pub fn check_blas(status: blas::cublasStatus_t, what: &str) -> Result<()> {
    match status {
        blas::cublasStatus_t::CUBLAS_STATUS_SUCCESS => Ok(()),
        other => Err(Error::Internal(format!("cuBLAS {what}: {other:?} (code {})", other as u32))),
    }
}

/// A cuBLASLt status (cuBLAS's codes) as INTERNAL naming the call.
pub fn check_lt(status: lt::cublasStatus_t, what: &str) -> Result<()> {
    match status {
        lt::cublasStatus_t::CUBLAS_STATUS_SUCCESS => Ok(()),
        other => Err(Error::Internal(format!("cuBLASLt {what}: {other:?} (code {})", other as u32))),
    }
}

/// An NCCL status as INTERNAL naming the call; `ncclInProgress` is success
/// here (non-blocking communicators report completion by polling).
pub fn check_nccl(status: nccl::ncclResult_t, what: &str) -> Result<()> {
    match status {
        nccl::ncclResult_t::ncclSuccess | nccl::ncclResult_t::ncclInProgress => Ok(()),
        other => Err(Error::Internal(format!("NCCL {what}: {other:?} (code {})", other as u32))),
    }
}

/// An NVRTC status as INTERNAL naming the call.
pub fn check_nvrtc(status: nvrtc::nvrtcResult, what: &str) -> Result<()> {
    match status {
        nvrtc::nvrtcResult::NVRTC_SUCCESS => Ok(()),
        other => Err(Error::Internal(format!("NVRTC {what}: {other:?} (code {})", other as u32))),
    }
}

// ---- the driver calls the backend makes, checked ---------------------------------

pub fn device_get(ordinal: i32) -> Result<cu::CUdevice> {
    let mut dev: cu::CUdevice = 0;
    // SAFETY: a valid out-pointer; the driver checks the ordinal.
    check_cu(unsafe { (driver()?.device_get)(&mut dev, ordinal) }, "cuDeviceGet")?;
    Ok(dev)
}

pub fn device_count() -> Result<i32> {
    let mut n: c_int = 0;
    // SAFETY: a valid out-pointer.
    check_cu(unsafe { (driver()?.device_get_count)(&mut n) }, "cuDeviceGetCount")?;
    Ok(n)
}

pub fn device_attribute(dev: cu::CUdevice, attribute: cu::CUdevice_attribute) -> Result<i32> {
    let mut v: c_int = 0;
    // SAFETY: a valid out-pointer; the driver checks the device and attribute.
    check_cu(unsafe { (driver()?.device_get_attribute)(&mut v, attribute, dev) }, "cuDeviceGetAttribute")?;
    Ok(v)
}

pub fn device_name(dev: cu::CUdevice) -> Result<String> {
    let mut name = [0 as c_char; 256];
    // SAFETY: the buffer holds the 256 bytes passed.
    check_cu(unsafe { (driver()?.device_get_name)(name.as_mut_ptr(), 256, dev) }, "cuDeviceGetName")?;
    // SAFETY: the driver wrote a NUL-terminated string into the buffer.
    Ok(unsafe { std::ffi::CStr::from_ptr(name.as_ptr()) }.to_string_lossy().into_owned())
}

/// Makes `ctx` current on this thread.
///
/// # Safety
/// `ctx` is a live context.
pub unsafe fn set_current(ctx: cu::CUcontext) -> Result<()> {
    // SAFETY: the caller's contract.
    check_cu(unsafe { (driver()?.ctx_set_current)(ctx) }, "cuCtxSetCurrent")
}

/// The context and device of `stream`, made current on this thread.
///
/// # Safety
/// `stream` is a live stream.
pub unsafe fn bind_stream(stream: cu::CUstream) -> Result<(cu::CUcontext, cu::CUdevice)> {
    let d = driver()?;
    let mut ctx: cu::CUcontext = std::ptr::null_mut();
    let mut dev: cu::CUdevice = 0;
    // SAFETY: the caller's contract; the out-pointers are valid locals.
    unsafe {
        check_cu((d.stream_get_ctx)(stream, &mut ctx), "cuStreamGetCtx")?;
        check_cu((d.ctx_set_current)(ctx), "cuCtxSetCurrent")?;
        check_cu((d.ctx_get_device)(&mut dev), "cuCtxGetDevice")?;
    }
    Ok((ctx, dev))
}

/// # Safety
/// Both handles are live and of one context.
pub unsafe fn event_record(event: cu::CUevent, stream: cu::CUstream, what: &str) -> Result<()> {
    // SAFETY: the caller's contract.
    check_cu(unsafe { (driver()?.event_record)(event, stream) }, what)
}

/// Enqueues zeroing `bytes` bytes at `addr` on `stream`.
///
/// # Safety
/// `addr..addr + bytes` is device memory alive until the stream passes the
/// memset, and `stream` is live in the current context.
pub unsafe fn zero_async(addr: u64, bytes: usize, stream: cu::CUstream) -> Result<()> {
    if bytes == 0 {
        return Ok(());
    }
    // SAFETY: the caller's contract.
    check_cu(unsafe { (driver()?.memset_d8_async)(addr, 0, bytes, stream) }, "cuMemsetD8Async")
}

/// Enqueues one device-to-device 2-D copy on `stream` (a copy engine's work).
///
/// # Safety
/// Every row of the copy lies in device memory alive until the stream
/// passes it, and `stream` is live in the current context.
pub unsafe fn copy_2d_async(copy: &crate::reshard::device::Copy2d, stream: cu::CUstream) -> Result<()> {
    if copy.width == 0 || copy.height == 0 {
        return Ok(());
    }
    let d = driver()?;
    // One row, or pitches past what cuMemcpy2D takes (CU_DEVICE_ATTRIBUTE_MAX_PITCH,
    // 2^31 - 1 on current GPUs): row by row.
    if copy.height == 1 || copy.src_pitch.max(copy.dst_pitch) > i32::MAX as usize {
        for row in 0..copy.height as u64 {
            let (src, dst) = (copy.src + row * copy.src_pitch as u64, copy.dst + row * copy.dst_pitch as u64);
            // SAFETY: the caller's contract, row by row.
            check_cu(unsafe { (d.memcpy_dtod_async)(dst, src, copy.width, stream) }, "cuMemcpyDtoDAsync")?;
        }
        return Ok(());
    }
    let device = cu::CUmemorytype::CU_MEMORYTYPE_DEVICE;
    let params = cu::CUDA_MEMCPY2D {
        srcXInBytes: 0,
        srcY: 0,
        srcMemoryType: device,
        srcHost: std::ptr::null(),
        srcDevice: copy.src,
        srcArray: std::ptr::null_mut(),
        srcPitch: copy.src_pitch,
        dstXInBytes: 0,
        dstY: 0,
        dstMemoryType: device,
        dstHost: std::ptr::null_mut(),
        dstDevice: copy.dst,
        dstArray: std::ptr::null_mut(),
        dstPitch: copy.dst_pitch,
        WidthInBytes: copy.width,
        Height: copy.height,
    };
    // SAFETY: the caller's contract; `params` outlives the call (the driver copies it).
    check_cu(unsafe { (d.memcpy_2d_async)(&params, stream) }, "cuMemcpy2DAsync")
}

/// # Safety
/// Both handles are live.
pub unsafe fn stream_wait_event(stream: cu::CUstream, event: cu::CUevent) -> Result<()> {
    // SAFETY: the caller's contract; flags 0 is CU_EVENT_WAIT_DEFAULT.
    check_cu(unsafe { (driver()?.stream_wait_event)(stream, event, 0) }, "cuStreamWaitEvent")
}

/// Whether the work before `event` is done (`false`: not yet; a device
/// error counts as done: XLA reports it from its own stream).
///
/// # Safety
/// `event` is live and its context current.
pub unsafe fn event_done(event: cu::CUevent) -> bool {
    // SAFETY: the caller's contract.
    let status = driver().map(|d| unsafe { (d.event_query)(event) });
    !matches!(status, Ok(cu::CUresult::CUDA_ERROR_NOT_READY))
}

/// # Safety
/// `stream` is live.
pub unsafe fn stream_synchronize(stream: cu::CUstream) -> Result<()> {
    // SAFETY: the caller's contract.
    check_cu(unsafe { (driver()?.stream_synchronize)(stream) }, "cuStreamSynchronize")
}

// ---- versions ------------------------------------------------------------------

/// The version a loaded library reports of itself (none needs a GPU).
pub fn version(lib: Lib) -> Result<String> {
    let mut a: c_int = 0;
    let mut b: c_int = 0;
    let mut c: c_int = 0;
    // SAFETY: each function writes plain integers through valid out-pointers.
    unsafe {
        match lib {
            Lib::Driver => {
                let d = &driver_lib()?.table;
                check_cu((d.driver_get_version)(&mut a), "cuDriverGetVersion")?;
                Ok(format!("{}.{}", a / 1000, (a % 1000) / 10))
            }
            Lib::Cublas => {
                let t = cublas()?;
                // libraryPropertyType: MAJOR_VERSION 0, MINOR_VERSION 1, PATCH_LEVEL 2.
                check_blas((t.get_property)(0, &mut a), "cublasGetProperty")?;
                check_blas((t.get_property)(1, &mut b), "cublasGetProperty")?;
                check_blas((t.get_property)(2, &mut c), "cublasGetProperty")?;
                Ok(format!("{a}.{b}.{c}"))
            }
            Lib::CublasLt => {
                let v = (cublaslt()?.get_version)();
                Ok(format!("{}.{}.{}", v / 10000, (v / 100) % 100, v % 100))
            }
            Lib::Nccl => {
                check_nccl((nccl()?.get_version)(&mut a), "ncclGetVersion")?;
                Ok(nccl_version_string(a))
            }
            Lib::Nvrtc => {
                check_nvrtc((nvrtc()?.version)(&mut a, &mut b), "nvrtcVersion")?;
                Ok(format!("{a}.{b}"))
            }
        }
    }
}

/// `ncclGetVersion`'s integer as `major.minor.patch` (2.9 changed the code:
/// 22809 is 2.28.9, 2804 was 2.8.4).
pub fn nccl_version_string(code: i32) -> String {
    if code >= 20900 {
        format!("{}.{}.{}", code / 10000, (code / 100) % 100, code % 100)
    } else {
        format!("{}.{}.{}", code / 1000, (code / 100) % 10, code % 100)
    }
}

/// One library's entry of `commfuse.cuda_libraries()`.
pub struct Report {
    pub lib: Lib,
    pub path: Option<String>,
    pub found: Option<Found>,
    pub version: Option<String>,
    pub error: Option<String>,
}

/// Every library: the file loaded, its version, or why it was not loaded.
pub fn report() -> Vec<Report> {
    Lib::ALL
        .iter()
        .map(|&lib| {
            let where_ = match lib {
                Lib::Driver => driver_lib().map(|l| (l.path.clone(), l.found)),
                Lib::Cublas => cublas_lib().map(|l| (l.path.clone(), l.found)),
                Lib::CublasLt => cublaslt_lib().map(|l| (l.path.clone(), l.found)),
                Lib::Nccl => nccl_lib().map(|l| (l.path.clone(), l.found)),
                Lib::Nvrtc => nvrtc_lib().map(|l| (l.path.clone(), l.found)),
            };
            match where_ {
                Ok((path, found)) => {
                    let version = version(lib);
                    Report {
                        lib,
                        path,
                        found: Some(found),
                        error: version.as_ref().err().map(|e| e.message().to_string()),
                        version: version.ok(),
                    }
                }
                Err(e) => Report { lib, path: None, found: None, version: None, error: Some(e.message().to_string()) },
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every CUDA call goes through these tables: a call of one of cudarc's
    /// own wrappers would use cudarc's loader, which panics where it finds no
    /// library by its bare names (see `libs`).
    #[test]
    fn no_code_calls_through_cudarcs_loader() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src/backend/cuda");
        let mut found = Vec::new();
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            let text = std::fs::read_to_string(&path).unwrap();
            for (n, line) in text.lines().enumerate() {
                let code = line.split("//").next().unwrap_or_default().replace("std::result::", "");
                let wrapper = code.split("sys::").skip(1).any(|rest| {
                    let ident: String = rest.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
                    let prefixed = ["cu", "nccl", "nvrtc", "cublas"].iter().any(|p| ident.starts_with(p));
                    prefixed && rest[ident.len()..].starts_with('(')
                });
                // cudarc's `result` modules and NVRTC helpers (spelt in pieces
                // so that this line does not match itself).
                let helpers = [["::", "result::"].concat(), ["result", " as "].concat(), ["compile", "_ptx"].concat()];
                if wrapper || helpers.iter().any(|h| code.contains(h.as_str())) {
                    found.push(format!("{}:{}: {}", path.display(), n + 1, line.trim()));
                }
            }
        }
        assert!(found.is_empty(), "calls through cudarc's loader:\n{}", found.join("\n"));
    }

    /// `unsafe` lives in the library layers only (`api`, `libs`, and the safe
    /// layers `driver`, `blas`, `nccl`, `nvrtc`); every other module of the
    /// backend forbids it.
    #[test]
    fn unsafe_code_lives_in_the_library_layers_only() {
        const LAYERS: [&str; 6] = ["api.rs", "libs.rs", "driver.rs", "blas.rs", "nccl.rs", "nvrtc.rs"];
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src/backend/cuda");
        let mut wrong = Vec::new();
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            if LAYERS.contains(&name.as_str()) || name == "mod.rs" {
                continue;
            }
            let text = std::fs::read_to_string(&path).unwrap();
            if !text.contains(&["#![forbid(", "unsafe_code)]"].concat()) {
                wrong.push(format!("{name} does not forbid unsafe code"));
            }
        }
        assert!(wrong.is_empty(), "{}", wrong.join("\n"));
    }

    #[test]
    fn nccl_version_codes() {
        assert_eq!(nccl_version_string(22809), "2.28.9");
        assert_eq!(nccl_version_string(23004), "2.30.4");
        assert_eq!(nccl_version_string(2804), "2.8.4");
    }

    /// Whatever this machine has, each library either loads with a version
    /// or reports why not, never a panic; a missing one is UNIMPLEMENTED
    /// naming what provides it.
    #[test]
    fn every_library_loads_or_says_why() {
        for r in report() {
            match (&r.version, &r.error) {
                (Some(v), None) => assert!(!v.is_empty() && r.path.is_some(), "{:?}", r.lib),
                (None, Some(e)) => {
                    assert!(e.contains(r.lib.key()), "{e}");
                    if r.found.is_none() {
                        assert!(e.contains(r.lib.sonames()[0]) && e.contains(libs::OVERRIDE_VAR), "{e}");
                    }
                }
                _ => panic!("{:?}: a version and an error", r.lib),
            }
        }
    }
}
