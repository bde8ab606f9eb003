//! The CUDA C++ sources of `kernels/`, compiled at run time with NVRTC for the
//! device's architecture and cached per (architecture, source): each source is
//! compiled once per process and architecture, whatever the number of devices.

use super::libs::{require, Lib};
use crate::error::{Error, Result};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// A source file of `kernels/`, embedded in the library.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Source {
    pub name: &'static str,
    pub text: &'static str,
}

/// Every source the backend uses (the NVRTC test compiles all of `kernels/`).
pub const SOURCES: [Source; 1] =
    [Source { name: "elementwise.cu", text: include_str!("../../../kernels/elementwise.cu") }];

/// The NVRTC architectures the backend compiles for: `sm_XY` from a compute capability.
pub fn arch(major: i32, minor: i32) -> Result<&'static str> {
    match (major, minor) {
        (8, 0) => Ok("sm_80"),
        (8, 6) => Ok("sm_86"),
        (8, 7) => Ok("sm_87"),
        (8, 9) => Ok("sm_89"),
        (9, 0) => Ok("sm_90"),
        (10, 0) => Ok("sm_100"),
        (12, 0) => Ok("sm_120"),
        _ => Err(Error::Unimplemented(format!(
            "compute capability {major}.{minor} is not supported (the kernels need sm_80 or newer)"
        ))),
    }
}

/// PTX per (architecture, source name).
#[derive(Default)]
pub struct PtxCache {
    entries: Mutex<HashMap<(&'static str, &'static str), Arc<String>>>,
}

impl PtxCache {
    /// The PTX of `source` for `arch`, compiled on first use.
    pub fn get(&self, arch: &'static str, source: Source) -> Result<Arc<String>> {
        let mut entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(ptx) = entries.get(&(arch, source.name)) {
            return Ok(Arc::clone(ptx));
        }
        require(&[Lib::Nvrtc])?;
        let opts = cudarc::nvrtc::CompileOptions {
            arch: Some(arch),
            name: Some(source.name.to_string()),
            options: vec!["--std=c++17".into()],
            ..Default::default()
        };
        let ptx = cudarc::nvrtc::compile_ptx_with_opts(source.text, opts)
            .map_err(|e| Error::Internal(format!("NVRTC failed on {} for {arch}: {e}", source.name)))?;
        let ptx = Arc::new(ptx.to_src());
        entries.insert((arch, source.name), Arc::clone(&ptx));
        Ok(ptx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn architectures_and_missing_nvrtc() {
        assert_eq!(arch(9, 0).unwrap(), "sm_90");
        assert!(matches!(arch(7, 5), Err(Error::Unimplemented(_))));
        // Without NVRTC on the loader path the cache reports it instead of panicking.
        let cache = PtxCache::default();
        match cache.get("sm_80", SOURCES[0]) {
            Ok(ptx) => assert!(ptx.contains(".entry add_f32")),
            Err(e) => assert!(matches!(e, Error::Unimplemented(_)), "{e}"),
        }
    }
}
