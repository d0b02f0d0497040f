//! Builds the kernels' host check (always) and, with the `cuda` feature, the kernels
//! themselves: `nvcc` compiles each `kernels/*.cu` into a fat binary for sm_90 and
//! sm_80 that the crate embeds, with warnings as errors, and prints ptxas's resource
//! report (registers, stack, spills) in the build log. A kernel that spills fails the
//! build.

use std::env;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The kernels, one fat binary each (file stem = the module name in `src/kernels.rs`).
const KERNELS: &[&str] = &["fifo_bench", "quant", "layout", "combine", "ll_send"];

/// Targets: Hopper (the H100/H200 the device check runs on) and Ampere.
const ARCHS: &[&str] = &["90", "80"];

fn main() {
    println!("cargo:rerun-if-changed=kernels");
    println!("cargo:rerun-if-env-changed=UEP_NVCC");
    println!("cargo:rerun-if-env-changed=CUDA_HOME");
    host_check();
    if env::var_os("CARGO_FEATURE_CUDA").is_some() {
        let nvcc = find_nvcc().unwrap_or_else(|| {
            panic!(
                "the `cuda` feature needs nvcc: run `./dev cuda-setup` (installs NVIDIA's \
                 13.0 compiler from PyPI into .cuda/), or set UEP_NVCC or CUDA_HOME"
            )
        });
        let out = PathBuf::from(env::var("OUT_DIR").unwrap());
        for kernel in KERNELS {
            compile(&nvcc, kernel, &out);
        }
    }
}

/// The kernels' headers compiled for the host, so tests compare their numerics and
/// command encoding with the Rust definitions without a GPU.
fn host_check() {
    cc::Build::new()
        .cpp(true)
        .file("kernels/host_check.cpp")
        .include("kernels")
        .flag_if_supported("-std=c++17")
        .flag_if_supported("-ffp-contract=off")
        .warnings_into_errors(true)
        .compile("uep_cuda_host_check");
}

/// `UEP_NVCC`, then the compiler `./dev cuda-setup` installs, then `CUDA_HOME`, then
/// the usual places and `PATH`.
fn find_nvcc() -> Option<PathBuf> {
    if let Some(path) = env::var_os("UEP_NVCC") {
        return Some(PathBuf::from(path));
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let mut candidates = vec![root.join(".cuda/nvidia/cu13/bin/nvcc")];
    if let Some(home) = env::var_os("CUDA_HOME") {
        candidates.push(PathBuf::from(home).join("bin/nvcc"));
    }
    candidates.push(PathBuf::from("/usr/local/cuda/bin/nvcc"));
    if let Some(found) = candidates.into_iter().find(|p| p.is_file()) {
        return Some(found);
    }
    let which = Command::new("sh")
        .args(["-c", "command -v nvcc"])
        .output()
        .ok()?;
    let path = String::from_utf8(which.stdout).ok()?;
    (!path.trim().is_empty()).then(|| PathBuf::from(path.trim()))
}

fn compile(nvcc: &Path, kernel: &str, out: &Path) {
    let src = format!("kernels/{kernel}.cu");
    let dst = out.join(format!("{kernel}.fatbin"));
    let mut cmd = Command::new(nvcc);
    cmd.args([
        "-fatbin",
        "-std=c++17",
        "-O3",
        "-Xptxas",
        "-v",
        "-Werror",
        "all-warnings",
    ]);
    for arch in ARCHS {
        cmd.arg(format!("-gencode=arch=compute_{arch},code=sm_{arch}"));
    }
    cmd.arg("-Ikernels").arg(&src).arg("-o").arg(&dst);
    let output = cmd
        .output()
        .unwrap_or_else(|e| panic!("running {}: {e}", nvcc.display()));
    let report = String::from_utf8_lossy(&output.stderr);
    if !output.status.success() {
        panic!("nvcc failed on {src}:\n{report}");
    }
    let mut spills = Vec::new();
    let mut entry = String::new();
    for line in report.lines().filter(|l| !l.contains("Compile time")) {
        println!("cargo:warning=[{kernel}] {}", line.trim());
        if let Some(rest) = line.split("Compiling entry function '").nth(1) {
            entry = rest.split('\'').next().unwrap_or("").to_string();
        }
        if line.contains("spill stores") && !line.contains(" 0 bytes spill stores") {
            spills.push(format!("{entry}: {}", line.trim()));
        }
    }
    if !spills.is_empty() {
        panic!("kernels in {src} spill registers:\n{}", spills.join("\n"));
    }
}
