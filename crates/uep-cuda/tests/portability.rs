//! One kernel source for every target: only `kernels/port.cuh` (and the host build's
//! runtime it includes, `kernels/host/`) may name a target's intrinsics, builtin
//! variables or inline assembly; every kernel is written over the header.

use std::path::Path;

/// What only the portability header may spell.
const TARGET_ONLY: &[&str] = &[
    "asm",
    "__shfl",
    "__ballot",
    "__match_any",
    "__syncthreads",
    "__syncwarp",
    "threadIdx",
    "blockIdx",
    "blockDim",
    "gridDim",
    "warpSize",
    "__threadfence",
    "atomicAdd",
    "atomicMin",
    "atomicCAS",
    "__nanosleep",
    "clock64",
    "globaltimer",
    "__popc",
    "__ffs",
    "__ldg",
    "__fdiv_rn",
    "__fmul_rn",
    "__fadd_rn",
    "__float_as_uint",
    "__hip_atomic",
    "__builtin_amdgcn",
    "__CUDA_ARCH__",
    "__CUDACC__",
    "__HIP",
];

#[test]
fn no_kernel_names_a_target_outside_the_portability_header() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels");
    let mut checked = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        if path.is_dir() || name == "port.cuh" || !(name.ends_with(".cu") || name.ends_with(".cuh"))
        {
            continue;
        }
        let text = std::fs::read_to_string(&path).unwrap();
        for (n, line) in text.lines().enumerate() {
            let code = line.split("//").next().unwrap_or("");
            for word in TARGET_ONLY {
                let named = code
                    .match_indices(word)
                    .any(|(i, _)| !code[..i].ends_with(|c: char| c.is_alphanumeric() || c == '_'));
                assert!(
                    !named,
                    "{name}:{}: `{word}` outside port.cuh: {line}",
                    n + 1
                );
            }
        }
        checked += 1;
    }
    assert!(
        checked >= 8,
        "only {checked} kernel files found in {}",
        dir.display()
    );
}
