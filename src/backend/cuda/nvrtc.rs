//! The safe layer over NVRTC (`api`'s NVRTC table): what it can compile for,
//! and one compilation of a `kernels/` source, its program released on drop.

use super::api::{self, check_nvrtc};
use crate::error::{Error, Result};
use cudarc::nvrtc::sys::nvrtcProgram;
use std::ffi::{c_char, CString};

/// The architectures the loaded NVRTC can compile for (`[75, 80, ..., 120]`).
pub fn supported_archs() -> Result<Vec<i32>> {
    let nvrtc = api::nvrtc()?;
    let mut n = 0;
    // SAFETY: valid out-pointers; the array holds the count NVRTC reported.
    unsafe {
        check_nvrtc((nvrtc.get_num_supported_archs)(&mut n), "nvrtcGetNumSupportedArchs")?;
        let mut archs = vec![0; usize::try_from(n).unwrap_or(0)];
        check_nvrtc((nvrtc.get_supported_archs)(archs.as_mut_ptr()), "nvrtcGetSupportedArchs")?;
        Ok(archs)
    }
}

/// A compiled source: the bytes `cuModuleLoadData` takes (PTX NUL-terminated),
/// and NVRTC's log (ptxas's resource report with `extra` options that ask for it).
#[derive(Debug)]
pub struct Compiled {
    pub image: Vec<u8>,
    pub log: String,
}

/// An NVRTC program, destroyed on drop.
struct Program(nvrtcProgram);

impl Drop for Program {
    fn drop(&mut self) {
        if let Ok(nvrtc) = api::nvrtc() {
            // SAFETY: created by `compile`, destroyed once.
            let _ = unsafe { (nvrtc.destroy_program)(&mut self.0) };
        }
    }
}

/// What a compilation gives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Output {
    /// Device code for the architecture (`sm_XY`).
    Cubin,
    /// PTX for a virtual architecture (`compute_XY`), NUL-terminated.
    Ptx,
}

/// Compiles the CUDA C++ `text` (file `name`) for `arch` (an NVRTC
/// `--gpu-architecture` value) to `output` (`extra`: more NVRTC options).
pub fn compile(text: &str, name: &str, arch: &str, output: Output, extra: &[&str]) -> Result<Compiled> {
    let nvrtc = api::nvrtc()?;
    let cstr = |s: &str| CString::new(s).map_err(|_| Error::Internal(format!("NUL byte in {s:?}")));
    let (text, cname) = (cstr(text)?, cstr(name)?);
    let mut options = vec![cstr("--std=c++17")?, cstr(&format!("--gpu-architecture={arch}"))?];
    for o in extra {
        options.push(cstr(o)?);
    }
    let option_ptrs: Vec<*const c_char> = options.iter().map(|o| o.as_ptr()).collect();
    let mut program = Program(std::ptr::null_mut());
    // SAFETY: every pointer is a live NUL-terminated string for the calls;
    // the out-buffers are sized from NVRTC's own size queries.
    unsafe {
        let created = (nvrtc.create_program)(
            &mut program.0,
            text.as_ptr(),
            cname.as_ptr(),
            0,
            std::ptr::null(),
            std::ptr::null(),
        );
        check_nvrtc(created, "nvrtcCreateProgram")?;
        let compiled = (nvrtc.compile_program)(program.0, option_ptrs.len() as i32, option_ptrs.as_ptr());
        let mut log_size = 0usize;
        check_nvrtc((nvrtc.get_program_log_size)(program.0, &mut log_size), "nvrtcGetProgramLogSize")?;
        let mut log = vec![0u8; log_size.max(1)];
        check_nvrtc((nvrtc.get_program_log)(program.0, log.as_mut_ptr().cast()), "nvrtcGetProgramLog")?;
        let log = String::from_utf8_lossy(&log).trim_end_matches('\0').trim().to_string();
        check_nvrtc(compiled, "nvrtcCompileProgram")
            .map_err(|e| Error::Internal(format!("{name} for {arch}: {}\n{log}", e.message())))?;
        let mut size = 0usize;
        let image = match output {
            Output::Cubin => {
                check_nvrtc((nvrtc.get_cubin_size)(program.0, &mut size), "nvrtcGetCUBINSize")?;
                let mut image = vec![0u8; size];
                check_nvrtc((nvrtc.get_cubin)(program.0, image.as_mut_ptr().cast()), "nvrtcGetCUBIN")?;
                image
            }
            Output::Ptx => {
                // The size counts the terminating NUL, which `cuModuleLoadData` needs.
                check_nvrtc((nvrtc.get_ptx_size)(program.0, &mut size), "nvrtcGetPTXSize")?;
                let mut image = vec![0u8; size];
                check_nvrtc((nvrtc.get_ptx)(program.0, image.as_mut_ptr().cast()), "nvrtcGetPTX")?;
                image
            }
        };
        Ok(Compiled { image, log })
    }
}
