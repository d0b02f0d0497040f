//! Compiles the libfabric C shim (`csrc/shim.c`) and links libfabric.
//!
//! Include paths and link flags come from `pkg-config libfabric`; most fi_*
//! entry points are `static inline` in the headers, hence the shim.

fn main() {
    println!("cargo:rerun-if-changed=csrc/shim.c");
    println!("cargo:rerun-if-changed=build.rs");
    let lib = match pkg_config::Config::new()
        .atleast_version("1.10")
        .probe("libfabric")
    {
        Ok(lib) => lib,
        Err(e) => {
            // Fail the build with an actionable message rather than a linker error.
            panic!(
                "uep-transport needs libfabric >= 1.10 development files (pkg-config name \
                 `libfabric`; on Debian/Ubuntu: apt-get install libfabric-dev): {e}"
            );
        }
    };
    let mut build = cc::Build::new();
    build
        .file("csrc/shim.c")
        .warnings(true)
        .extra_warnings(true);
    for p in &lib.include_paths {
        build.include(p);
    }
    build.compile("uep_fabric_shim");
}
