//! Finding and opening the CUDA libraries: the copy JAX already mapped, else
//! the one a standard install puts where JAX's CUDA plugin finds it.
//!
//! cudarc's own loader opens libraries by a fixed list of bare names and
//! cannot take a path: it never tries `libnccl.so.2` (the soname of every
//! NCCL 2.x, pip's included), and it tries an unversioned `libcublas.so`
//! (a system toolkit's) before the `.so.13` JAX mapped, loading a second
//! copy. So the backend opens each library itself (here) and calls it
//! through its own function tables (`api`), using cudarc's generated types.
//!
//! Search order, first hit wins:
//! 1. `COMMFUSE_CUDA_LIBRARY_PATH`: `:`-separated files or directories (for
//!    unusual installs); an entry naming this library that fails to open is
//!    an error, not a reason to look elsewhere;
//! 2. a copy already mapped in this process under one of the sonames
//!    (`dlopen` with `RTLD_NOLOAD`): JAX's CUDA plugin preloads pip's
//!    libraries by absolute path when its backend starts, so the process
//!    keeps one copy, JAX's;
//! 3. the directories Python hands over before the first use
//!    ([`set_search`]): the `lib/` folders of the pip `nvidia` packages, the
//!    CUDA major of JAX's plugin first;
//! 4. the CUDA toolkit: `$CUDA_HOME`, `$CUDA_PATH`, `$CUDA_ROOT`, `/usr/local/cuda`;
//! 5. the dynamic loader's own search (`LD_LIBRARY_PATH`, the ld.so cache).

use libloading::os::unix::{Library, RTLD_LAZY, RTLD_LOCAL};
use std::ffi::c_void;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// The libraries the backend loads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Lib {
    /// The driver API (`libcuda`): contexts, streams, events, modules, launches.
    Driver,
    /// cuBLAS: the GEMMs.
    Cublas,
    /// cuBLASLt: the fp8 GEMMs (`lt`).
    CublasLt,
    /// NCCL: point-to-point transfers.
    Nccl,
    /// NVRTC: compiles `kernels/` for each device.
    Nvrtc,
}

/// The environment variable of step 1 of the search.
pub const OVERRIDE_VAR: &str = "COMMFUSE_CUDA_LIBRARY_PATH";

impl Lib {
    pub const ALL: [Lib; 5] = [Lib::Driver, Lib::Cublas, Lib::CublasLt, Lib::Nccl, Lib::Nvrtc];

    /// The key of `commfuse.cuda_libraries()`.
    pub fn key(self) -> &'static str {
        match self {
            Lib::Driver => "cuda",
            Lib::Cublas => "cublas",
            Lib::CublasLt => "cublasLt",
            Lib::Nccl => "nccl",
            Lib::Nvrtc => "nvrtc",
        }
    }

    /// The sonames JAX's CUDA 13 and 12 plugins load, newest major first
    /// (no install ships an unversioned `libX.so` outside a toolkit's dev
    /// files, and that one may be of another major).
    pub fn sonames(self) -> &'static [&'static str] {
        match self {
            Lib::Driver => &["libcuda.so.1"],
            Lib::Cublas => &["libcublas.so.13", "libcublas.so.12"],
            Lib::CublasLt => &["libcublasLt.so.13", "libcublasLt.so.12"],
            Lib::Nccl => &["libnccl.so.2"],
            Lib::Nvrtc => &["libnvrtc.so.13", "libnvrtc.so.12"],
        }
    }

    /// What provides the library for JAX's CUDA `major` (0: unknown), for messages.
    pub fn provider(self, major: u32) -> String {
        let pip = |cu13: &str, cu12: &str| match major {
            13 => format!("pip `{cu13}` (what `jax[cuda13]` installs)"),
            12 => format!("pip `{cu12}` (what `jax[cuda12]` installs)"),
            _ => format!("pip `{cu13}` (CUDA 13, as `jax[cuda13]` does) or `{cu12}` (CUDA 12)"),
        };
        match self {
            Lib::Driver => "the NVIDIA driver (no pip package provides it)".into(),
            Lib::Cublas | Lib::CublasLt => pip("nvidia-cublas", "nvidia-cublas-cu12"),
            Lib::Nccl => pip("nvidia-nccl-cu13", "nvidia-nccl-cu12"),
            Lib::Nvrtc => pip("nvidia-cuda-nvrtc", "nvidia-cuda-nvrtc-cu12"),
        }
    }

    /// Whether `file_name` is a file of this library (`libnccl.so.2`, `libnccl.so`).
    fn names(self, file_name: &str) -> bool {
        let stem = self.sonames()[0].split(".so").next().unwrap_or_default();
        file_name.strip_prefix(stem).is_some_and(|rest| rest == ".so" || rest.starts_with(".so."))
    }
}

/// Where the search found a library.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Found {
    Override,
    AlreadyLoaded,
    PipPackage,
    Toolkit,
    LoaderPath,
}

impl Found {
    pub fn describe(self) -> &'static str {
        match self {
            Found::Override => OVERRIDE_VAR,
            Found::AlreadyLoaded => "already loaded in this process",
            Found::PipPackage => "a pip nvidia package",
            Found::Toolkit => "the CUDA toolkit",
            Found::LoaderPath => "the dynamic loader's search path",
        }
    }
}

/// An opened library: kept open for the life of the process (its function
/// tables point into it).
pub struct Opened {
    pub library: Library,
    pub soname_or_file: String,
    pub found: Found,
}

/// What Python hands over before the first use (see [`set_search`]).
#[derive(Default, Clone)]
struct Search {
    dirs: Vec<PathBuf>,
    jax_cuda_major: u32,
}

static SEARCH: Mutex<Option<Search>> = Mutex::new(None);

/// Sets the pip package directories to search (step 3) and the CUDA major of
/// JAX's plugin (0: none or unknown), which the error messages name.
pub fn set_search(dirs: Vec<PathBuf>, jax_cuda_major: u32) {
    *crate::sync::lock(&SEARCH) = Some(Search { dirs, jax_cuda_major });
}

fn search() -> Search {
    crate::sync::lock(&SEARCH).clone().unwrap_or_default()
}

/// The CUDA major of JAX's plugin as Python reported it (0: unknown).
pub fn jax_cuda_major() -> u32 {
    search().jax_cuda_major
}

/// `dlopen`s `name` (a path, or a bare soname searched by the loader).
fn open_file(name: &str, flags: i32) -> std::result::Result<Library, String> {
    // SAFETY: the CUDA libraries' initialisers only set up their own state.
    unsafe { Library::open(Some(name), flags) }.map_err(|e| e.to_string())
}

/// The toolkit directories of step 4.
fn toolkit_dirs() -> Vec<PathBuf> {
    let mut roots: Vec<PathBuf> =
        ["CUDA_HOME", "CUDA_PATH", "CUDA_ROOT"].iter().filter_map(std::env::var_os).map(PathBuf::from).collect();
    roots.push("/usr/local/cuda".into());
    roots.iter().flat_map(|r| [r.join("lib64"), r.join("lib"), r.join("targets/x86_64-linux/lib")]).collect()
}

/// Opens `lib` (see the module comment). The error says what was tried
/// and what would provide it.
pub fn open(lib: Lib) -> std::result::Result<Opened, String> {
    let search = search();
    let found = |library, name: &str, found| Ok(Opened { library, soname_or_file: name.to_string(), found });

    // 1. The explicit override.
    let overrides = std::env::var(OVERRIDE_VAR).unwrap_or_default();
    for entry in overrides.split(':').filter(|e| !e.is_empty()) {
        let path = Path::new(entry);
        let named = path.file_name().and_then(|f| f.to_str()).is_some_and(|f| lib.names(f));
        if named && !path.is_dir() {
            return open_file(entry, RTLD_LAZY | RTLD_LOCAL)
                .and_then(|l| found(l, entry, Found::Override))
                .map_err(|e| format!("{OVERRIDE_VAR} names {entry}, which failed to load: {e}"));
        }
        for soname in lib.sonames() {
            let file = path.join(soname);
            if file.exists() {
                let file = file.to_string_lossy().into_owned();
                return open_file(&file, RTLD_LAZY | RTLD_LOCAL)
                    .and_then(|l| found(l, &file, Found::Override))
                    .map_err(|e| format!("{file} (from {OVERRIDE_VAR}) failed to load: {e}"));
            }
        }
    }
    // 2. The copy this process already mapped.
    for soname in lib.sonames() {
        if let Ok(l) = open_file(soname, RTLD_LAZY | RTLD_LOCAL | libc::RTLD_NOLOAD) {
            return found(l, soname, Found::AlreadyLoaded);
        }
    }
    // 3 and 4. The pip packages, then the toolkit.
    let mut errors = Vec::new();
    let dirs = search.dirs.iter().map(|d| (d.clone(), Found::PipPackage));
    for (dir, from) in dirs.chain(toolkit_dirs().into_iter().map(|d| (d, Found::Toolkit))) {
        for soname in lib.sonames() {
            let file = dir.join(soname);
            if !file.exists() {
                continue;
            }
            let file = file.to_string_lossy().into_owned();
            match open_file(&file, RTLD_LAZY | RTLD_LOCAL) {
                Ok(l) => return found(l, &file, from),
                Err(e) => errors.push(e),
            }
        }
    }
    // 5. The loader's search path.
    for soname in lib.sonames() {
        if let Ok(l) = open_file(soname, RTLD_LAZY | RTLD_LOCAL) {
            return found(l, soname, Found::LoaderPath);
        }
    }
    let looked: Vec<String> = search.dirs.iter().map(|d| d.display().to_string()).collect();
    Err(format!(
        "{} not found (looked in: {OVERRIDE_VAR}{}, the copies already loaded, pip package directories [{}], the CUDA \
         toolkit, LD_LIBRARY_PATH and the ld.so cache){}; install {}, or set {OVERRIDE_VAR} to its directory",
        lib.sonames().join(" or "),
        if overrides.is_empty() { " (unset)" } else { "" },
        looked.join(", "),
        if errors.is_empty() { String::new() } else { format!("; files found but not loaded: {}", errors.join("; ")) },
        lib.provider(search.jax_cuda_major),
    ))
}

/// The file a symbol of an opened library lives in (`dladdr`), as the
/// loader mapped it.
///
/// # Safety
/// `symbol` is an address inside a loaded library (or any address: `dladdr`
/// only looks it up).
pub unsafe fn file_of(symbol: *const c_void) -> Option<String> {
    let mut info = libc::Dl_info {
        dli_fname: std::ptr::null(),
        dli_fbase: std::ptr::null_mut(),
        dli_sname: std::ptr::null(),
        dli_saddr: std::ptr::null_mut(),
    };
    // SAFETY: `dladdr` only reads the loader's tables; `info` is a valid out-pointer.
    let ok = unsafe { libc::dladdr(symbol, &mut info) } != 0;
    if !ok || info.dli_fname.is_null() {
        return None;
    }
    // SAFETY: the loader's NUL-terminated file name, valid while the library is loaded.
    let name = unsafe { std::ffi::CStr::from_ptr(info.dli_fname) };
    let name = name.to_string_lossy().into_owned();
    Some(std::fs::canonicalize(&name).map(|p| p.display().to_string()).unwrap_or(name))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_names_of_each_library() {
        assert!(Lib::Nccl.names("libnccl.so.2"));
        assert!(Lib::Nccl.names("libnccl.so"));
        assert!(!Lib::Nccl.names("libnccl_static.a"));
        assert!(Lib::Cublas.names("libcublas.so.13"));
        assert!(!Lib::Cublas.names("libcublasLt.so.13"));
        assert!(Lib::CublasLt.names("libcublasLt.so.12"));
        assert!(!Lib::Nvrtc.names("libnvrtc-builtins.so.13.0"));
        assert!(Lib::Driver.names("libcuda.so.1"));
        assert!(!Lib::Driver.names("libcudart.so.13"));
    }

    #[test]
    fn messages_name_the_pip_package_of_jaxs_cuda_major() {
        assert!(Lib::Nccl.provider(13).contains("nvidia-nccl-cu13"));
        assert!(Lib::Nccl.provider(12).contains("nvidia-nccl-cu12"));
        assert!(Lib::Cublas.provider(13).contains("`nvidia-cublas`"));
        assert!(Lib::Nvrtc.provider(12).contains("nvidia-cuda-nvrtc-cu12"));
        let unknown = Lib::Nvrtc.provider(0);
        assert!(unknown.contains("nvidia-cuda-nvrtc") && unknown.contains("nvidia-cuda-nvrtc-cu12"), "{unknown}");
    }
}
