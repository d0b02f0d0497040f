//! Where there is no GPU, the CUDA device says so clearly instead of failing later:
//! without the `cuda` feature every entry point says the build lacks it; with it, a
//! machine without a driver gets "no CUDA driver". On a GPU machine the second check
//! is skipped with a printed reason (`uep gpu` covers that side).

#[test]
fn probe_says_why_there_is_no_device() {
    match uep_cuda::probe() {
        Ok(info) => {
            println!("skipped: this machine has a CUDA device ({})", info.name);
        }
        Err(e) if !uep_cuda::BUILT => {
            assert!(matches!(e, uep_cuda::CudaError::NotBuilt), "{e}");
            assert!(e.to_string().contains("--features cuda"), "{e}");
        }
        Err(e) => {
            let msg = e.to_string();
            assert!(
                matches!(
                    e,
                    uep_cuda::CudaError::NoDriver | uep_cuda::CudaError::NoDevice { .. }
                ),
                "{msg}"
            );
            assert!(msg.contains("no CUDA"), "{msg}");
        }
    }
}
