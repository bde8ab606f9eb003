//! Presence checks of the CUDA libraries, before their first use.
//!
//! cudarc's dynamic loading panics when a library is missing. Every entry
//! point of the backend calls [`require`] first, which probes with cudarc's
//! own loader (`is_culib_present`, which only tries to open each candidate
//! name) under `catch_unwind`, and turns absence into `Error::Unimplemented`.

use crate::error::{Error, Result};
use std::panic::catch_unwind;
use std::sync::OnceLock;

/// The libraries the backend loads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Lib {
    /// The driver API (`libcuda`): streams, events, modules, launches.
    Driver,
    /// cuBLAS: the GEMMs.
    Cublas,
    /// cuBLASLt: the fp8 GEMMs (`lt`).
    CublasLt,
    /// NCCL: point-to-point transfers.
    Nccl,
    /// NVRTC: compiles `kernels/` at run time.
    Nvrtc,
}

impl Lib {
    pub const ALL: [Lib; 5] = [Lib::Driver, Lib::Cublas, Lib::CublasLt, Lib::Nccl, Lib::Nvrtc];

    /// The library's file name stem and what provides it, for messages.
    pub fn describe(self) -> (&'static str, &'static str) {
        match self {
            Lib::Driver => ("libcuda", "the NVIDIA driver"),
            Lib::Cublas => ("libcublas", "the CUDA toolkit or pip `nvidia-cublas-cu12`"),
            Lib::CublasLt => ("libcublasLt", "the CUDA toolkit or pip `nvidia-cublas-cu12`"),
            Lib::Nccl => ("libnccl", "pip `nvidia-nccl-cu12` (a CUDA jaxlib installs it)"),
            Lib::Nvrtc => ("libnvrtc", "the CUDA toolkit or pip `nvidia-cuda-nvrtc-cu12`"),
        }
    }

    fn probe(self) -> bool {
        // SAFETY: each probe only calls `dlopen` on cudarc's candidate names
        // and drops what it opened; no symbol is used.
        let found = catch_unwind(|| unsafe {
            match self {
                Lib::Driver => cudarc::driver::sys::is_culib_present(),
                Lib::Cublas => cudarc::cublas::sys::is_culib_present(),
                Lib::CublasLt => cudarc::cublaslt::sys::is_culib_present(),
                Lib::Nccl => cudarc::nccl::sys::is_culib_present(),
                Lib::Nvrtc => cudarc::nvrtc::sys::is_culib_present(),
            }
        });
        found.unwrap_or(false)
    }

    /// Whether the library can be loaded (probed once per process).
    pub fn present(self) -> bool {
        static FOUND: [OnceLock<bool>; 5] = [const { OnceLock::new() }; 5];
        let i = Lib::ALL.iter().position(|&l| l == self).expect("listed");
        *FOUND[i].get_or_init(|| self.probe())
    }
}

/// `Ok` when every library in `libs` can be loaded, else `Unimplemented`
/// naming each missing one, where it comes from, and `LD_LIBRARY_PATH`.
pub fn require(libs: &[Lib]) -> Result<()> {
    let missing: Vec<String> = libs
        .iter()
        .filter(|l| !l.present())
        .map(|l| {
            let (name, from) = l.describe();
            format!("{name} (from {from})")
        })
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    Err(Error::Unimplemented(format!(
        "the CUDA backend cannot load {}; install it or add its directory to LD_LIBRARY_PATH",
        missing.join(", ")
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_libraries_are_an_unimplemented_error_not_a_panic() {
        // Whatever this machine has, the probe answers without panicking and
        // the error names exactly the missing libraries.
        for lib in Lib::ALL {
            let result = require(&[lib]);
            assert_eq!(result.is_ok(), lib.present(), "{lib:?}");
            if let Err(e) = result {
                assert!(matches!(e, Error::Unimplemented(_)), "{e}");
                assert!(e.message().contains(lib.describe().0), "{e}");
                assert!(e.message().contains("LD_LIBRARY_PATH"), "{e}");
            }
        }
        assert!(require(&[]).is_ok());
    }
}
