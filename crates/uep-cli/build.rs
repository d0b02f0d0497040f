//! Builds the MPI peer baseline of `uep bench --peers` (`peers/mpi_alltoallv.c`) with
//! Open MPI's `mpicc`, when there is one; its path reaches the CLI as `UEP_MPI_PEER`
//! (empty without MPI, and `--peers` then says what to install).

use std::path::PathBuf;
use std::process::Command;

fn main() {
    let src = "peers/mpi_alltoallv.c";
    println!("cargo:rerun-if-changed={src}");
    println!("cargo:rerun-if-env-changed=MPICC");
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("OUT_DIR")).join("uep-mpi-peer");
    let mpicc = std::env::var("MPICC").unwrap_or_else(|_| "mpicc".into());
    let built = Command::new(&mpicc)
        .args(["-O2", "-std=c11", "-Wall", "-Wextra", "-o"])
        .arg(&out)
        .arg(src)
        .status();
    match built {
        Ok(s) if s.success() => {
            println!("cargo:rustc-env=UEP_MPI_PEER={}", out.display());
        }
        Ok(s) => panic!("{mpicc} {src} failed ({s})"),
        Err(_) => {
            println!(
                "cargo:warning=no {mpicc}: `uep bench --peers` will need Open MPI (apt install openmpi-bin libopenmpi-dev)"
            );
            println!("cargo:rustc-env=UEP_MPI_PEER=");
        }
    }
}
