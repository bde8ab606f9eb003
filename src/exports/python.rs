//! The plain C functions Python calls through ctypes (`python/commfuse/_native.py`,
//! `_abi.py`, `_planner/price.py`): the trace-time `prepare`, the pricing of
//! a compiled step, the contract's tables, settings,
//! tracing, and the CUDA libraries. Each catches panics; none crosses the ABI.

use std::panic::catch_unwind;

/// Answers one trace-time request (`prepare::prepare_json`; `request` is a
/// NUL-terminated JSON object): writes the JSON answer, NUL-terminated, to
/// `out[..out_len]` when it fits and returns its length in bytes (call again
/// with a larger buffer when that is >= `out_len`), or returns -1 with the
/// reason written there instead.
///
/// # Safety
/// `request` must be a NUL-terminated string and `out` a writable buffer of
/// `out_len` bytes (or null).
#[no_mangle]
pub unsafe extern "C" fn commfuse_prepare(request: *const std::ffi::c_char, out: *mut u8, out_len: usize) -> i64 {
    let result = catch_unwind(|| {
        if request.is_null() {
            return Err("null request".to_string());
        }
        // SAFETY: the caller passes a NUL-terminated string.
        let request = unsafe { std::ffi::CStr::from_ptr(request) }.to_str().map_err(|e| e.to_string())?;
        crate::prepare::prepare_json(request).map_err(|e| e.to_string())
    });
    // SAFETY: forwarded contract.
    unsafe { answer(result, "panic while preparing the call", out, out_len) }
}

/// Prices one device's compiled program on a machine (`sim::step::price_json`;
/// `request` is a NUL-terminated JSON object): answers as `commfuse_prepare` does.
///
/// # Safety
/// `request` must be a NUL-terminated string and `out` a writable buffer of
/// `out_len` bytes (or null).
#[no_mangle]
pub unsafe extern "C" fn commfuse_price_step(request: *const std::ffi::c_char, out: *mut u8, out_len: usize) -> i64 {
    let result = catch_unwind(|| {
        if request.is_null() {
            return Err("null request".to_string());
        }
        // SAFETY: the caller passes a NUL-terminated string.
        let request = unsafe { std::ffi::CStr::from_ptr(request) }.to_str().map_err(|e| e.to_string())?;
        crate::sim::step::price_json(request).map_err(|e| e.to_string())
    });
    // SAFETY: forwarded contract.
    unsafe { answer(result, "panic while pricing the step", out, out_len) }
}

/// The contract's tables (`abi::tables`) as JSON, written as
/// `commfuse_prepare` writes its answer.
///
/// # Safety
/// `out` must be a writable buffer of `out_len` bytes (or null).
#[no_mangle]
pub unsafe extern "C" fn commfuse_abi_tables(out: *mut u8, out_len: usize) -> i64 {
    let result = catch_unwind(|| Ok(crate::abi::tables().to_string()));
    // SAFETY: forwarded contract.
    unsafe { answer(result, "panic while writing the tables", out, out_len) }
}

/// Writes a text answer or its error to `out` (see `commfuse_prepare`).
///
/// # Safety
/// `out` must be a writable buffer of `out_len` bytes (or null).
unsafe fn answer(
    result: std::thread::Result<Result<String, String>>,
    panicked: &str,
    out: *mut u8,
    out_len: usize,
) -> i64 {
    let (code, text) = match result {
        Ok(Ok(text)) => (i64::try_from(text.len()).unwrap_or(i64::MAX), text),
        Ok(Err(e)) => (-1, e),
        Err(_) => (-1, panicked.to_string()),
    };
    if code < 0 || text.len() < out_len {
        // SAFETY: the caller guarantees `out_len` writable bytes at `out` (or null).
        unsafe { write_c_string(out, out_len, &text) };
    }
    code
}

/// Writes `text` to `buffer[..len]`, truncated and NUL-terminated; nothing
/// when `buffer` is null or `len` is 0.
///
/// # Safety
/// `buffer` must be null or writable for `len` bytes.
unsafe fn write_c_string(buffer: *mut u8, len: usize, text: &str) {
    if buffer.is_null() || len == 0 {
        return;
    }
    let n = text.len().min(len - 1);
    // SAFETY: the caller guarantees `len` writable bytes at `buffer`.
    let out = unsafe { std::slice::from_raw_parts_mut(buffer, len) };
    out[..n].copy_from_slice(&text.as_bytes()[..n]);
    out[n] = 0;
}

/// Sets the deadline of cross-device waits in milliseconds; 0 returns to
/// `COMMFUSE_TIMEOUT_S` (or the default).
#[no_mangle]
pub extern "C" fn commfuse_set_timeout_ms(ms: u64) {
    let timeout = (ms > 0).then(|| std::time::Duration::from_millis(ms));
    let _ = catch_unwind(|| crate::config::set_timeout(timeout));
}

/// Sets the GPU transport by name (`config::Transport::NAMES`); null returns
/// to `COMMFUSE_TRANSPORT` (or `auto`). Returns 0, or -1 for an unknown name.
///
/// # Safety
/// `name` is null or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn commfuse_set_transport(name: *const std::ffi::c_char) -> i32 {
    if name.is_null() {
        let _ = catch_unwind(|| crate::config::set_transport(None));
        return 0;
    }
    // SAFETY: the caller's contract.
    let text = unsafe { std::ffi::CStr::from_ptr(name) }.to_string_lossy();
    match crate::config::Transport::parse(&text) {
        Some(t) => catch_unwind(|| crate::config::set_transport(Some(t))).map_or(-1, |()| 0),
        None => -1,
    }
}

/// The GPU transport a call would use now, by name, into `out[..out_len]`
/// (NUL-terminated); the error's text and -1 when `COMMFUSE_TRANSPORT` is
/// malformed.
///
/// # Safety
/// `out` is null or writable for `out_len` bytes.
#[no_mangle]
pub unsafe extern "C" fn commfuse_transport(out: *mut u8, out_len: usize) -> i32 {
    let chosen = catch_unwind(crate::config::transport);
    let (code, text) = match chosen {
        Ok(Ok(t)) => {
            (0, crate::config::Transport::NAMES.iter().find(|(_, v)| *v == t).map_or("auto", |(n, _)| *n).to_string())
        }
        Ok(Err(e)) => (-1, e.message().to_string()),
        Err(_) => (-1, "commfuse_transport panicked".to_string()),
    };
    // SAFETY: the caller's contract.
    unsafe { write_c_string(out, out_len, &text) };
    code
}

/// The deadline of cross-device waits in milliseconds as a call would use it
/// now (`config::timeout`); the default when `COMMFUSE_TIMEOUT_S` is malformed
/// (the op's first call reports that).
#[no_mangle]
pub extern "C" fn commfuse_timeout_ms() -> u64 {
    let timeout = catch_unwind(|| crate::config::timeout().unwrap_or(crate::config::DEFAULT_TIMEOUT));
    timeout.map_or(0, |t| u64::try_from(t.as_millis()).unwrap_or(u64::MAX))
}

/// Ends every wait across devices under way now (`config::interrupt`):
/// Python's SIGINT handler calls this, so a Ctrl-C does not wait for a
/// deadline. Calls begun afterwards are not affected.
#[no_mangle]
pub extern "C" fn commfuse_interrupt() {
    crate::config::interrupt();
}

/// 1 if the library was built with the CUDA backend, else 0.
#[no_mangle]
pub extern "C" fn commfuse_cuda_built() -> i32 {
    i32::from(cfg!(feature = "cuda"))
}

/// Starts recording a timeline of every fused op's steps (see `trace`):
/// 0, or -1 if a recording is already on.
#[no_mangle]
pub extern "C" fn commfuse_trace_start() -> i32 {
    match catch_unwind(crate::trace::start) {
        Ok(Ok(())) => 0,
        _ => -1,
    }
}

/// Stops recording (waiting for runs in flight) and returns how many events
/// are buffered, or -1 after a panic.
#[no_mangle]
pub extern "C" fn commfuse_trace_stop() -> i64 {
    catch_unwind(crate::trace::stop).map_or(-1, |n| i64::try_from(n).unwrap_or(i64::MAX))
}

/// Stops recording and writes the buffered events as a Perfetto trace to the
/// NUL-terminated UTF-8 `path`; returns the bytes written, or -1 with the
/// reason written, NUL-terminated and truncated, to `error[..error_len]`.
///
/// # Safety
/// `path` must be a NUL-terminated string, and `error` a writable buffer of
/// `error_len` bytes (or null).
#[no_mangle]
pub unsafe extern "C" fn commfuse_trace_write(path: *const std::ffi::c_char, error: *mut u8, error_len: usize) -> i64 {
    let result = catch_unwind(|| {
        if path.is_null() {
            return Err("null path".to_string());
        }
        // SAFETY: the caller passes a NUL-terminated string.
        let path = unsafe { std::ffi::CStr::from_ptr(path) };
        let path = path.to_str().map_err(|e| format!("the trace path is not UTF-8: {e}"))?;
        crate::trace::write(std::path::Path::new(path)).map_err(|e| e.to_string())
    });
    let message = match result {
        Ok(Ok(bytes)) => return i64::try_from(bytes).unwrap_or(i64::MAX),
        Ok(Err(e)) => e,
        Err(_) => "panic while writing the trace".to_string(),
    };
    // SAFETY: the caller guarantees `error_len` writable bytes at `error` (or null).
    unsafe { write_c_string(error, error_len, &message) };
    -1
}

/// Writes a fresh NCCL unique id (`ncclGetUniqueId`, 128 bytes) to
/// `out[..out_len]` for the lowering of a group spanning processes. Returns
/// 0 on success; 1 when this library cannot make one (built without the
/// `cuda` feature, or NCCL cannot be loaded: Python raises
/// NotImplementedError); 2 on any other failure. On failure the reason is
/// written, NUL-terminated and truncated, to `error[..error_len]`.
///
/// # Safety
/// `out` must be a writable buffer of `out_len` bytes (or null), and `error`
/// a writable buffer of `error_len` bytes (or null).
#[no_mangle]
pub unsafe extern "C" fn commfuse_nccl_unique_id(
    out: *mut u8,
    out_len: usize,
    error: *mut u8,
    error_len: usize,
) -> i32 {
    let (code, message) = match catch_unwind(nccl_unique_id) {
        Ok(Ok(id)) if !out.is_null() && out_len == id.len() => {
            // SAFETY: the caller guarantees `out_len` writable bytes at `out`.
            unsafe { std::slice::from_raw_parts_mut(out, out_len) }.copy_from_slice(&id);
            return 0;
        }
        Ok(Ok(id)) => (2, format!("the output buffer must hold {} bytes, got {out_len}", id.len())),
        Ok(Err(crate::error::Error::Unimplemented(m))) => (1, m),
        Ok(Err(e)) => (2, e.to_string()),
        Err(_) => (2, "panic while making an NCCL unique id".to_string()),
    };
    // SAFETY: the caller guarantees `error_len` writable bytes at `error` (or null).
    unsafe { write_c_string(error, error_len, &message) };
    code
}

#[cfg(feature = "cuda")]
fn nccl_unique_id() -> crate::error::Result<[u8; 128]> {
    crate::backend::cuda::handler::nccl_unique_id()
}

#[cfg(not(feature = "cuda"))]
fn nccl_unique_id() -> crate::error::Result<[u8; 128]> {
    Err(crate::error::Error::Unimplemented(
        "this commfuse library was built without the `cuda` feature (--no-default-features): it cannot make NCCL \
         unique ids; the default build can"
            .into(),
    ))
}

/// Hands the CUDA backend the directories to search for its libraries (the
/// pip `nvidia` packages' `lib/` folders, `\n`-separated, in order of
/// preference) and the CUDA major of JAX's plugin (0: unknown), before the
/// backend's first use (see `backend::cuda::libs`). A no-op without the
/// `cuda` feature.
///
/// # Safety
/// `dirs` must be null or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn commfuse_cuda_set_search(dirs: *const std::ffi::c_char, jax_cuda_major: u32) {
    let dirs = if dirs.is_null() {
        String::new()
    } else {
        // SAFETY: the caller passes a NUL-terminated string.
        unsafe { std::ffi::CStr::from_ptr(dirs) }.to_string_lossy().into_owned()
    };
    let _ = catch_unwind(|| set_cuda_search(&dirs, jax_cuda_major));
}

#[cfg(feature = "cuda")]
fn set_cuda_search(dirs: &str, jax_cuda_major: u32) {
    let dirs = dirs.lines().filter(|l| !l.is_empty()).map(std::path::PathBuf::from).collect();
    crate::backend::cuda::libs::set_search(dirs, jax_cuda_major);
}

#[cfg(not(feature = "cuda"))]
fn set_cuda_search(_dirs: &str, _jax_cuda_major: u32) {}

/// The CUDA libraries as the backend finds them, one line per library:
/// `key \t path \t version \t found-by \t error` (empty fields for none).
/// Written, NUL-terminated, to `out[..out_len]` when it fits; returns its
/// length in bytes (call again with a larger buffer when that is >=
/// `out_len`), or -1 after a panic.
///
/// # Safety
/// `out` must be a writable buffer of `out_len` bytes (or null).
#[no_mangle]
pub unsafe extern "C" fn commfuse_cuda_libraries(out: *mut u8, out_len: usize) -> i64 {
    let Ok(text) = catch_unwind(cuda_libraries) else { return -1 };
    if text.len() < out_len {
        // SAFETY: the caller guarantees `out_len` writable bytes at `out` (or null).
        unsafe { write_c_string(out, out_len, &text) };
    }
    i64::try_from(text.len()).unwrap_or(i64::MAX)
}

#[cfg(feature = "cuda")]
fn cuda_libraries() -> String {
    let field = |s: Option<&str>| s.unwrap_or("").replace(['\t', '\n'], " ");
    crate::backend::cuda::api::report()
        .iter()
        .map(|r| {
            let fields = [
                r.lib.key().to_string(),
                field(r.path.as_deref()),
                field(r.version.as_deref()),
                field(r.found.map(|f| f.describe())),
                field(r.error.as_deref()),
            ];
            fields.join("\t") + "\n"
        })
        .collect()
}

#[cfg(not(feature = "cuda"))]
fn cuda_libraries() -> String {
    let why = "this commfuse library was built without the `cuda` feature (--no-default-features); the default build \
               has it";
    ["cuda", "cublas", "cublasLt", "nccl", "nvrtc"].iter().map(|k| format!("{k}\t\t\t\t{why}\n")).collect()
}

/// Runs one case of the one-rank benchmark on GPU 0
/// (`backend::cuda::solo_device::bench_json`; `request` is a NUL-terminated
/// JSON object) and writes its JSON answer as `commfuse_prepare` does: its
/// length, or -1 with the reason (no GPU, no CUDA backend, bad request).
///
/// # Safety
/// `request` must be a NUL-terminated string and `out` a writable buffer of
/// `out_len` bytes (or null).
#[no_mangle]
pub unsafe extern "C" fn commfuse_one_rank_bench(
    request: *const std::ffi::c_char,
    out: *mut u8,
    out_len: usize,
) -> i64 {
    let result = catch_unwind(|| {
        if request.is_null() {
            return Err("null request".to_string());
        }
        // SAFETY: the caller passes a NUL-terminated string.
        let request = unsafe { std::ffi::CStr::from_ptr(request) }.to_str().map_err(|e| e.to_string())?;
        one_rank_bench(request)
    });
    // SAFETY: forwarded contract.
    unsafe { answer(result, "panic in the one-rank benchmark", out, out_len) }
}

#[cfg(feature = "cuda")]
fn one_rank_bench(request: &str) -> Result<String, String> {
    crate::backend::cuda::solo_device::bench_json(request).map_err(|e| e.to_string())
}

#[cfg(not(feature = "cuda"))]
fn one_rank_bench(_request: &str) -> Result<String, String> {
    Err("this commfuse library was built without the `cuda` feature: the one-rank benchmark needs it".into())
}

/// How this process kept its fused ops' call sites (`call::counts`): writes
/// instances whose state XLA keeps, sites decoded into them, and sites
/// decoded into the process's map to `out[0..3]`.
///
/// # Safety
/// `out` must point at 3 writable `i64`s.
#[no_mangle]
pub unsafe extern "C" fn commfuse_site_counts(out: *mut i64) {
    if out.is_null() {
        return;
    }
    for (i, n) in crate::call::counts::now().into_iter().enumerate() {
        // SAFETY: the caller gives 3 writable i64s.
        unsafe { *out.add(i) = i64::try_from(n).unwrap_or(i64::MAX) };
    }
}

/// How many devices had their kernels loaded inside an EXECUTE call rather
/// than at the INITIALIZE stage (0 without the `cuda` feature).
#[no_mangle]
pub extern "C" fn commfuse_cuda_loads_during_execute() -> i64 {
    #[cfg(feature = "cuda")]
    {
        use std::sync::atomic::Ordering;
        let n = crate::backend::cuda::device::LOADED_DURING_EXECUTE.load(Ordering::Relaxed);
        i64::try_from(n).unwrap_or(i64::MAX)
    }
    #[cfg(not(feature = "cuda"))]
    0
}

/// The `n` device ids at `devices`; none for a null pointer.
///
/// # Safety
/// `devices` points to `n` readable `i64`s that outlive the slice, or is null.
unsafe fn device_ids<'a>(devices: *const i64, n: usize) -> &'a [i64] {
    if devices.is_null() {
        return &[];
    }
    // SAFETY: the caller's contract.
    unsafe { std::slice::from_raw_parts(devices, n) }
}

/// Whether the GPU reshard communicator of the `n` device ids at `devices`
/// (the union of two meshes) is live and connected (`backend::cuda::reshard::connected`);
/// 0 without the `cuda` feature.
///
/// # Safety
/// `devices` points to `n` readable `i64`s, or is null.
#[no_mangle]
pub unsafe extern "C" fn commfuse_reshard_cuda_connected(devices: *const i64, n: usize) -> i32 {
    // SAFETY: the caller's contract.
    let _devices = unsafe { device_ids(devices, n) };
    #[cfg(feature = "cuda")]
    return catch_unwind(|| crate::backend::cuda::reshard::connected(_devices)).map_or(0, i32::from);
    #[cfg(not(feature = "cuda"))]
    0
}

/// Aborts the GPU reshard communicator of the `n` device ids at `devices`
/// (`backend::cuda::reshard::abort`); returns 1 if there was one, else 0
/// (always without the `cuda` feature).
///
/// # Safety
/// `devices` points to `n` readable `i64`s, or is null.
#[no_mangle]
pub unsafe extern "C" fn commfuse_reshard_cuda_abort(devices: *const i64, n: usize) -> i32 {
    // SAFETY: the caller's contract.
    let _devices = unsafe { device_ids(devices, n) };
    #[cfg(feature = "cuda")]
    return catch_unwind(|| crate::backend::cuda::reshard::abort(_devices)).map_or(0, i32::from);
    #[cfg(not(feature = "cuda"))]
    0
}

/// Drops what the send part of reshard call `call_id` at call site `site`
/// posted for receivers that will never come (its Python handle was dropped
/// without `result()`); returns how many sessions it dropped.
#[no_mangle]
pub extern "C" fn commfuse_reshard_abandon(site: i64, call_id: u32) -> i64 {
    let dropped = catch_unwind(|| crate::backend::cpu::transport::abandon(site, call_id.into())).unwrap_or(0);
    i64::try_from(dropped).unwrap_or(i64::MAX)
}

/// This host's single-thread f32 GEMM rate in GFLOP/s (measured once per
/// process), which calibrates the cost model's `cpu_here` machine.
#[no_mangle]
pub extern "C" fn commfuse_cpu_gemm_gflops() -> f64 {
    catch_unwind(crate::backend::cpu::gemm_gflops).unwrap_or(0.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(out_len: usize) -> (i32, Vec<u8>, String) {
        let mut out = vec![0u8; out_len];
        let mut error = [0u8; 256];
        // SAFETY: both buffers are live and of the lengths passed.
        let code = unsafe { commfuse_nccl_unique_id(out.as_mut_ptr(), out.len(), error.as_mut_ptr(), error.len()) };
        let end = error.iter().position(|&b| b == 0).unwrap_or(error.len());
        (code, out, String::from_utf8_lossy(&error[..end]).into_owned())
    }

    /// Without the feature, or without NCCL, the answer is 1 with the reason;
    /// with NCCL present it is an id (or 2 if NCCL's bootstrap fails here).
    #[test]
    fn nccl_unique_id_says_why_it_cannot_make_one() {
        let (code, out, message) = call(128);
        match code {
            0 => assert!(message.is_empty()),
            1 => {
                assert!(out.iter().all(|&b| b == 0));
                assert!(message.contains("cuda") || message.contains("libnccl"), "{message}");
            }
            _ => assert!(!message.is_empty()),
        }
        #[cfg(not(feature = "cuda"))]
        assert_eq!(code, 1);
        if code != 1 {
            let (short, _, message) = call(64);
            assert_eq!(short, 2);
            assert!(message.contains("128 bytes"), "{message}");
        }
    }
}
