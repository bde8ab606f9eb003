//! The CUDA C++ sources of `kernels/`, compiled with NVRTC to CUBIN for a
//! device's exact compute capability, and cached per (target, source): each
//! source is compiled once per process and architecture, whatever the
//! number of devices.
//!
//! CUBIN, not PTX: the driver JIT-compiles PTX and refuses PTX newer than
//! itself, and pip installs the newest NVRTC (12.9 emits PTX 8.8, 13.x PTX
//! 9.x), often newer than the driver. PTX remains the fallback for a device
//! newer than every architecture the NVRTC knows (the driver then compiles
//! it for the device). NVRTC itself is called through `nvrtc`.
#![forbid(unsafe_code)]

use super::nvrtc::{self, Compiled, Output};
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
pub const SOURCES: [Source; 2] = [ELEMENTWISE, PACE];

/// The sums (`driver::SumKernels`).
pub const ELEMENTWISE: Source =
    Source { name: "elementwise.cu", text: include_str!("../../../kernels/elementwise.cu") };

/// The one-rank mode's timer kernels (`driver::PaceKernels`).
pub const PACE: Source = Source { name: "pace.cu", text: include_str!("../../../kernels/pace.cu") };

/// The oldest architecture the kernels support (bf16 `cvt` needs sm_80).
const OLDEST: i32 = 80;

/// What NVRTC produces for a device.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Target {
    /// Machine code for exactly this architecture (`sm_90`).
    Cubin(i32),
    /// PTX for this virtual architecture (`compute_120`), JIT-compiled by the driver.
    Ptx(i32),
}

impl Target {
    /// NVRTC's `--gpu-architecture` value.
    pub fn arch(&self) -> String {
        match self {
            Target::Cubin(sm) => format!("sm_{sm}"),
            Target::Ptx(sm) => format!("compute_{sm}"),
        }
    }

    /// The target for a device of compute capability `major.minor`, given the
    /// architectures this NVRTC supports (`nvrtcGetSupportedArchs`): CUBIN for
    /// the device's own architecture when NVRTC has it, else PTX for NVRTC's
    /// newest when the device is newer still.
    pub fn for_device(major: i32, minor: i32, supported: &[i32]) -> Result<Target> {
        let sm = major * 10 + minor;
        if sm < OLDEST {
            return Err(Error::Unimplemented(format!(
                "compute capability {major}.{minor} is not supported (the kernels need sm_{OLDEST} or newer)"
            )));
        }
        if supported.contains(&sm) {
            return Ok(Target::Cubin(sm));
        }
        match supported.iter().copied().max() {
            Some(newest) if newest < sm && newest >= OLDEST => Ok(Target::Ptx(newest)),
            _ => Err(Error::Unimplemented(format!(
                "this NVRTC cannot compile for compute capability {major}.{minor} (it supports sm {supported:?}); \
                 install the NVRTC of JAX's CUDA version"
            ))),
        }
    }
}

/// Compiles `source` for `target` with NVRTC (`extra`: more NVRTC options).
pub fn compile(source: Source, target: &Target, extra: &[&str]) -> Result<Compiled> {
    let output = match target {
        Target::Cubin(_) => Output::Cubin,
        Target::Ptx(_) => Output::Ptx,
    };
    nvrtc::compile(source.text, source.name, &target.arch(), output, extra)
}

/// The architectures the loaded NVRTC can compile for (`[75, 80, ..., 120]`).
pub fn supported_archs() -> Result<Vec<i32>> {
    nvrtc::supported_archs()
}

type ImageKey = (Target, &'static str);

/// Compiled images per (target, source name).
#[derive(Default)]
pub struct ImageCache {
    entries: Mutex<HashMap<ImageKey, Arc<Vec<u8>>>>,
}

impl ImageCache {
    /// The image of `source` for `target`, compiled on first use.
    pub fn get(&self, target: &Target, source: Source) -> Result<Arc<Vec<u8>>> {
        let mut entries = crate::sync::lock(&self.entries);
        if let Some(image) = entries.get(&(target.clone(), source.name)) {
            return Ok(Arc::clone(image));
        }
        let image = Arc::new(compile(source, target, &[])?.image);
        entries.insert((target.clone(), source.name), Arc::clone(&image));
        Ok(image)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cubin_for_known_devices_ptx_for_newer_ones() {
        let nvrtc_12_9 = [75, 80, 86, 87, 89, 90, 100, 101, 103, 120, 121];
        assert_eq!(Target::for_device(9, 0, &nvrtc_12_9).unwrap(), Target::Cubin(90));
        assert_eq!(Target::for_device(10, 3, &nvrtc_12_9).unwrap(), Target::Cubin(103));
        assert_eq!(Target::for_device(12, 1, &nvrtc_12_9).unwrap(), Target::Cubin(121));
        // A device newer than this NVRTC: PTX for the newest it knows.
        assert_eq!(Target::for_device(13, 0, &nvrtc_12_9).unwrap(), Target::Ptx(121));
        assert_eq!(Target::for_device(13, 0, &nvrtc_12_9).unwrap().arch(), "compute_121");
        assert_eq!(Target::Cubin(90).arch(), "sm_90");
        assert!(matches!(Target::for_device(7, 5, &nvrtc_12_9), Err(Error::Unimplemented(_))));
        // An arch missing in the middle of the list is refused, not silently JIT-compiled.
        assert!(matches!(Target::for_device(8, 8, &nvrtc_12_9), Err(Error::Unimplemented(_))));
    }
}
