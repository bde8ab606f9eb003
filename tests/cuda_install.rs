//! The CUDA backend against a pip install of one CUDA major, without a GPU:
//! every library but the driver is found where the install put it, with
//! the version it reports of itself, and NVRTC compiles every kernel of
//! `kernels/` to CUBIN for sm_80, sm_90 and sm_100, without register spills.
//!
//! Needs the pip packages of one major installed into a directory (`pip
//! install --target DIR ...`, as `.ci/run` does for CUDA 12 and 13), named
//! by `COMMFUSE_TEST_CUDA_ROOT`, with `COMMFUSE_TEST_CUDA_MAJOR` (12 or 13).
//! The tests are ignored by default; `.ci/run` runs them once per major,
//! each in a fresh process, with `--ignored`.
#![cfg(feature = "cuda")]

use commfuse::backend::cuda::api;
use commfuse::backend::cuda::kernels::{compile, Target, SOURCES};
use commfuse::backend::cuda::libs::{self, Lib};
use std::path::{Path, PathBuf};

/// The pip install under test and its CUDA major; the `lib/` folders of its
/// `nvidia` packages handed to the backend as Python hands them over.
fn install() -> (PathBuf, u32) {
    let root = std::env::var("COMMFUSE_TEST_CUDA_ROOT")
        .expect("COMMFUSE_TEST_CUDA_ROOT must name a pip --target directory of CUDA packages (see .ci/run)");
    let major: u32 = std::env::var("COMMFUSE_TEST_CUDA_MAJOR")
        .expect("COMMFUSE_TEST_CUDA_MAJOR must be 12 or 13")
        .parse()
        .expect("COMMFUSE_TEST_CUDA_MAJOR must be a number");
    let root = PathBuf::from(root);
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(root.join("nvidia"))
        .expect("the root holds an nvidia/ package directory")
        .map(|e| e.unwrap().path().join("lib"))
        .filter(|d| d.is_dir())
        .collect();
    dirs.sort();
    libs::set_search(dirs, major);
    (root, major)
}

#[test]
#[ignore = "needs pip's CUDA libraries: .ci/run runs it with COMMFUSE_TEST_CUDA_ROOT for CUDA 12 and 13"]
fn every_library_but_the_driver_is_found_in_the_install_with_its_version() {
    let (root, major) = install();
    let root = std::fs::canonicalize(root).unwrap();
    for r in api::report() {
        println!(
            "{:<9} {:<8} {:<70} {}",
            r.lib.key(),
            r.version.as_deref().unwrap_or("-"),
            r.path.as_deref().unwrap_or("-"),
            r.error.as_deref().unwrap_or("")
        );
        if r.lib == Lib::Driver {
            continue; // the driver comes with a GPU, never from pip
        }
        let path = r.path.as_deref().unwrap_or_else(|| panic!("{}: not loaded: {:?}", r.lib.key(), r.error));
        assert!(Path::new(path).starts_with(&root), "{}: loaded {path}, not from {}", r.lib.key(), root.display());
        let version = r.version.as_deref().unwrap_or_else(|| panic!("{}: no version: {:?}", r.lib.key(), r.error));
        let first: u32 = version.split('.').next().unwrap().parse().unwrap();
        match r.lib {
            Lib::Nccl => assert_eq!(first, 2, "NCCL {version}"),
            _ => assert_eq!(first, major, "{} {version} from the CUDA {major} install", r.lib.key()),
        }
    }
}

/// (kernel, registers, spill store bytes, spill load bytes) from NVRTC's ptxas report.
fn resources(log: &str) -> Vec<(String, u32, u32, u32)> {
    let number_before = |line: &str, unit: &str| -> u32 {
        line.find(unit).and_then(|at| line[..at].split_whitespace().last()?.parse().ok()).unwrap_or(0)
    };
    let mut rows = Vec::new();
    let mut current: Option<(String, u32, u32)> = None;
    for line in log.lines() {
        if let Some(rest) = line.split("Function properties for ").nth(1) {
            current = Some((rest.trim().to_string(), 0, 0));
        } else if line.contains("spill stores") {
            if let Some(c) = current.as_mut() {
                c.1 = number_before(line, "bytes spill stores");
                c.2 = number_before(line, "bytes spill loads");
            }
        } else if line.contains("Used") && line.contains("registers") {
            let (name, stores, loads) = current.take().unwrap_or_default();
            rows.push((name, number_before(line, "registers"), stores, loads));
        }
    }
    rows
}

#[test]
#[ignore = "needs pip's NVRTC: .ci/run runs it with COMMFUSE_TEST_CUDA_ROOT for CUDA 12 and 13"]
fn every_kernel_compiles_to_cubin_for_sm80_sm90_and_sm100() {
    let (_, major) = install();
    println!("NVRTC {} (CUDA {major} install)", api::version(Lib::Nvrtc).unwrap());
    // Every .cu file of kernels/ is one the backend embeds.
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels");
    let mut files: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|f| f.ends_with(".cu"))
        .collect();
    files.sort();
    let mut embedded: Vec<String> = SOURCES.iter().map(|s| s.name.to_string()).collect();
    embedded.sort();
    assert_eq!(files, embedded, "kernels/ and kernels::SOURCES differ");
    let mut spills = Vec::new();
    for source in SOURCES {
        for sm in [80, 90, 100] {
            let out = compile(source, &Target::Cubin(sm), &["--ptxas-options=-v"])
                .unwrap_or_else(|e| panic!("{} for sm_{sm}: {e}", source.name));
            // An ELF image, not PTX text.
            assert_eq!(&out.image[..4], b"\x7fELF", "{} sm_{sm} is not a CUBIN", source.name);
            let rows = resources(&out.log);
            assert!(!rows.is_empty(), "no ptxas report for {} sm_{sm}:\n{}", source.name, out.log);
            println!("{} sm_{sm}: {} bytes of CUBIN", source.name, out.image.len());
            for (kernel, registers, stores, loads) in rows {
                println!("  {kernel:<20} {registers:>3} registers, spills {stores}/{loads} bytes");
                if stores > 0 || loads > 0 {
                    spills.push(format!("{} sm_{sm} {kernel}", source.name));
                }
            }
        }
    }
    assert!(spills.is_empty(), "kernels spill registers: {spills:?}");
}

/// The parameters `driver::SumKernels::launch` passes are those NVRTC gives
/// each sum kernel: a pointer, `Terms` by value (eight 8-byte pointers,
/// 8-aligned), an int and a u64 (read from the PTX).
#[test]
#[ignore = "needs pip's NVRTC: .ci/run runs it with COMMFUSE_TEST_CUDA_ROOT for CUDA 12 and 13"]
fn sum_kernels_take_the_parameters_the_launch_passes() {
    use commfuse::backend::cuda::{addresses::MAX_TERMS, driver::SumKernels};
    install();
    let ptx = compile(SOURCES[0], &Target::Ptx(80), &[]).unwrap().image;
    let ptx = String::from_utf8_lossy(&ptx);
    for name in SumKernels::NAMES {
        let start = ptx.find(&format!(".entry {name}(")).unwrap_or_else(|| panic!("no kernel {name}"));
        let params: Vec<String> = ptx[start..]
            .split_once('(')
            .and_then(|(_, rest)| rest.split_once(')'))
            .map(|(list, _)| list.split(',').map(|p| p.split_whitespace().collect::<Vec<_>>().join(" ")).collect())
            .unwrap();
        let expected = [
            format!(".param .u64 {name}_param_0"),
            format!(".param .align 8 .b8 {name}_param_1[{}]", 8 * MAX_TERMS),
            format!(".param .u32 {name}_param_2"),
            format!(".param .u64 {name}_param_3"),
        ];
        assert_eq!(params, expected, "{name}");
    }
}

/// The parameter `driver::PaceKernels` passes is the one NVRTC gives the
/// timer kernel: `commfuse_stamp(u64*)`.
#[test]
#[ignore = "needs pip's NVRTC: .ci/run runs it with COMMFUSE_TEST_CUDA_ROOT for CUDA 12 and 13"]
fn the_timer_kernel_takes_the_parameter_the_launch_passes() {
    use commfuse::backend::cuda::kernels::PACE;
    install();
    let ptx = compile(PACE, &Target::Ptx(80), &[]).unwrap().image;
    let ptx = String::from_utf8_lossy(&ptx);
    let start = ptx.find(".entry commfuse_stamp(").expect("no kernel commfuse_stamp");
    let params: Vec<String> = ptx[start..]
        .split_once('(')
        .and_then(|(_, rest)| rest.split_once(')'))
        .map(|(list, _)| list.split(',').map(|p| p.split_whitespace().collect::<Vec<_>>().join(" ")).collect())
        .unwrap();
    assert_eq!(params, [".param .u64 commfuse_stamp_param_0"]);
}
