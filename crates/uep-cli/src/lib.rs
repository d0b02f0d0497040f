//! uep command-line library
pub mod args;
pub mod bench;
pub mod chaos;
pub mod dump;
pub mod gpu;
pub mod info;
pub mod peers;
pub mod rejoin;
pub mod report;
pub mod soak;
pub mod sweep;

/// `uep clean`: remove shared-memory segments whose creating process is gone, and
/// elastic jobs' doors none of whose ranks lives.
pub fn clean() -> anyhow::Result<bool> {
    let mut removed = uep_shm::clean_stale()?;
    removed.extend(uep_ep::remove_stale_doors()?);
    for p in &removed {
        println!("removed {}", p.display());
    }
    println!("uep clean: {} stale segment(s) removed", removed.len());
    Ok(true)
}
