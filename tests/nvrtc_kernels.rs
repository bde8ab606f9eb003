//! Compiles every CUDA source in `kernels/` with NVRTC for sm_80 and sm_90, as
//! the CUDA backend does at run time, and fails on any error. With
//! ptxas available, prints each kernel's registers, shared memory and spills,
//! and fails on spills. Needs no GPU: NVRTC and ptxas come from the pip
//! packages `nvidia-cuda-nvrtc-cu12` and `nvidia-cuda-nvcc-cu12`; the test is
//! skipped, saying so, only when the NVRTC package is not installed.
#![cfg(feature = "cuda")]

use cudarc::nvrtc::{compile_ptx_with_opts, CompileOptions};
use std::path::{Path, PathBuf};
use std::process::Command;

const ARCHS: [&str; 2] = ["sm_80", "sm_90"];

/// The directory of a pip package of the `nvidia` namespace, if installed.
fn pip_package_dir(module: &str) -> Option<PathBuf> {
    let python = std::env::var("PYTHON").unwrap_or_else(|_| "python3".into());
    let code = format!("import nvidia.{module} as m; print(list(m.__path__)[0])");
    let out = Command::new(python).args(["-c", &code]).output().ok()?;
    let dir = String::from_utf8(out.stdout).ok()?;
    let dir = PathBuf::from(dir.trim());
    (out.status.success() && dir.is_dir()).then_some(dir)
}

/// Loads pip's libnvrtc by its path and keeps it loaded: cudarc's later
/// `dlopen("libnvrtc.so.12")` then finds it by soname instead of searching
/// `LD_LIBRARY_PATH`, which a running process cannot change for itself.
fn load_nvrtc(lib_dir: &Path) -> Result<(), String> {
    let path = lib_dir.join("libnvrtc.so.12");
    // SAFETY: libnvrtc's initialisers only set up the library; it is never unloaded.
    let lib = unsafe { libloading::Library::new(&path) }.map_err(|e| format!("loading {}: {e}", path.display()))?;
    std::mem::forget(lib);
    Ok(())
}

/// ptxas's per-kernel report: (kernel, registers, shared bytes, spill store bytes, spill load bytes).
fn ptxas_report(ptxas: &Path, ptx: &str, arch: &str, dir: &Path) -> Vec<(String, u32, u32, u32, u32)> {
    let input = dir.join(format!("kernels_{arch}.ptx"));
    std::fs::write(&input, ptx).unwrap();
    let out = Command::new(ptxas)
        .args(["-v", "--warn-on-spills", "--gpu-name", arch, "-o"])
        .arg(dir.join(format!("kernels_{arch}.cubin")))
        .arg(&input)
        .output()
        .expect("run ptxas");
    let text = String::from_utf8_lossy(&out.stderr).into_owned() + &String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "ptxas failed for {arch}:\n{text}");
    let number_before = |line: &str, unit: &str| -> u32 {
        let at = match line.find(unit) {
            Some(at) => at,
            None => return 0,
        };
        line[..at].split_whitespace().last().and_then(|w| w.parse().ok()).unwrap_or(0)
    };
    let mut rows = Vec::new();
    let mut current: Option<(String, u32, u32)> = None; // (name, spill stores, spill loads)
    for line in text.lines() {
        if let Some(rest) = line.split("Function properties for ").nth(1) {
            current = Some((rest.trim().to_string(), 0, 0));
        } else if line.contains("spill stores") {
            if let Some(c) = current.as_mut() {
                c.1 = number_before(line, "bytes spill stores");
                c.2 = number_before(line, "bytes spill loads");
            }
        } else if line.contains("Used") && line.contains("registers") {
            let (name, stores, loads) = current.take().unwrap_or_default();
            let registers = number_before(line, "registers");
            let shared = number_before(line, "bytes smem");
            rows.push((name, registers, shared, stores, loads));
        }
    }
    rows
}

#[test]
fn every_kernel_compiles_for_sm80_and_sm90() {
    let Some(nvrtc) = pip_package_dir("cuda_nvrtc") else {
        eprintln!("SKIPPED: NVRTC is not installed (pip install nvidia-cuda-nvrtc-cu12); kernels/ was not compiled");
        return;
    };
    load_nvrtc(&nvrtc.join("lib")).unwrap();
    let ptxas = pip_package_dir("cuda_nvcc").map(|d| d.join("bin").join("ptxas")).filter(|p| p.is_file());
    if ptxas.is_none() {
        eprintln!("note: ptxas not installed (pip install nvidia-cuda-nvcc-cu12); no resource report");
    }
    let kernels = Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&kernels)
        .expect("kernels/ exists")
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "cu"))
        .collect();
    files.sort();
    assert!(!files.is_empty(), "no .cu files in {}", kernels.display());
    let scratch = std::env::temp_dir().join(format!("commfuse-nvrtc-{}", std::process::id()));
    std::fs::create_dir_all(&scratch).unwrap();
    let mut spills = Vec::new();
    for file in &files {
        let src = std::fs::read_to_string(file).unwrap();
        let name = file.file_name().unwrap().to_string_lossy().into_owned();
        for arch in ARCHS {
            let opts = CompileOptions {
                arch: Some(arch),
                name: Some(name.clone()),
                options: vec!["--std=c++17".into()],
                ..Default::default()
            };
            let ptx = compile_ptx_with_opts(&src, opts)
                .unwrap_or_else(|e| panic!("NVRTC failed on {name} for {arch}: {e}"))
                .to_src();
            let entries = ptx.lines().filter(|l| l.contains(".entry")).count();
            println!("nvrtc: {name} {arch}: ok, {entries} kernels, {} bytes of PTX", ptx.len());
            assert!(entries > 0, "{name} has no kernels");
            if let Some(ptxas) = &ptxas {
                println!(
                    "  {:<20} {:>9} {:>11} {:>12} {:>11}",
                    "kernel", "registers", "shared (B)", "spill st (B)", "spill ld (B)"
                );
                let rows = ptxas_report(ptxas, &ptx, arch, &scratch);
                assert_eq!(rows.len(), entries, "ptxas reported {} of {entries} kernels", rows.len());
                for (kernel, registers, shared, stores, loads) in rows {
                    println!("  {kernel:<20} {registers:>9} {shared:>11} {stores:>12} {loads:>11}");
                    if stores > 0 || loads > 0 {
                        spills.push(format!("{name} {arch} {kernel}"));
                    }
                }
            }
        }
    }
    let _ = std::fs::remove_dir_all(&scratch);
    assert!(spills.is_empty(), "kernels spill registers: {spills:?}");
}
