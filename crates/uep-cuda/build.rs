//! Builds the kernels two of the three ways `kernels/port.cuh` knows (the third,
//! hipcc for AMD GPUs, is `./dev hip-check`):
//! * always, the host build: every `kernels/*.cu` compiled as C++ by the system
//!   compiler with the host runtime (`kernels/host/`), linked into the crate for the
//!   emulated device; `UEP_EMU_SANITIZE=address` or `thread` builds it under that
//!   sanitizer (and links the crate's tests with it);
//! * with the `cuda` feature, `nvcc` compiles each `kernels/*.cu` into a fat binary for
//!   sm_90 and sm_80 that the crate embeds, with warnings as errors, and prints ptxas's
//!   resource report (registers, stack, spills) in the build log. A kernel that spills
//!   fails the build.

use std::env;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The kernels' sources (`kernels/{name}.cu`): one fat binary each for a GPU (embedded
/// by `src/gpu.rs`), one object each in the host build.
const KERNELS: &[&str] = &[
    "layout",
    "cast",
    "reduce",
    "ll_place",
    "ll_pack",
    "ll_unpack",
    "ll_combine_pack",
    "normal_notify",
    "normal_pack",
    "relay",
    "normal_combine_send",
    "fifo_bench",
    "ll_send",
    "selftest",
];

/// Targets: Hopper (the H100/H200 the device check runs on) and Ampere.
const ARCHS: &[&str] = &["90", "80"];

fn main() {
    println!("cargo:rerun-if-changed=kernels");
    println!("cargo:rerun-if-env-changed=UEP_NVCC");
    println!("cargo:rerun-if-env-changed=CUDA_HOME");
    println!("cargo:rerun-if-env-changed=UEP_EMU_SANITIZE");
    host_build();
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

/// The host build: the kernels, their entry points and the runtime that runs a grid
/// on CPU threads, plus the headers' numerics checks, as one static library. Optimised
/// whatever the profile (the emulated device runs every kernel through it), with the
/// flags that keep every f32 operation as written and device-style type punning defined.
fn host_build() {
    let mut build = cc::Build::new();
    build
        .cpp(true)
        .include("kernels")
        .opt_level(2)
        .flag("-std=c++17")
        .flag("-ffp-contract=off")
        .flag("-fno-strict-aliasing")
        .flag("-Wextra")
        .warnings_into_errors(true)
        // Every source is C++, the `.cu` ones included.
        .flag("-x")
        .flag("c++");
    if let Some(sanitizer) = env::var_os("UEP_EMU_SANITIZE") {
        let sanitizer = sanitizer.to_string_lossy().into_owned();
        assert!(
            ["address", "thread"].contains(&sanitizer.as_str()),
            "UEP_EMU_SANITIZE is address or thread, not {sanitizer}"
        );
        build
            .flag(format!("-fsanitize={sanitizer}"))
            .flag("-fno-omit-frame-pointer");
        // Rust links with -nodefaultlibs: name the compiler's runtime itself (the tests
        // run with it preloaded, `./dev test`'s long tier, so it comes first).
        let runtime = if sanitizer == "address" {
            "asan"
        } else {
            "tsan"
        };
        let lib = Command::new(env::var("CXX").unwrap_or_else(|_| "c++".into()))
            .arg(format!("-print-file-name=lib{runtime}.so"))
            .output()
            .expect("asking the C++ compiler where its sanitizer runtime is");
        let lib = PathBuf::from(String::from_utf8_lossy(&lib.stdout).trim());
        if let Some(dir) = lib.parent() {
            println!("cargo:rustc-link-search=native={}", dir.display());
        }
        println!("cargo:rustc-link-lib=dylib={runtime}");
    }
    for kernel in KERNELS {
        build.file(format!("kernels/{kernel}.cu"));
    }
    build
        .file("kernels/host/runtime.cpp")
        .file("kernels/host/entry.cpp")
        .file("kernels/host_check.cpp")
        .compile("uep_cuda_host");
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
