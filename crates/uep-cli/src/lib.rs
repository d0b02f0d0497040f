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
mod setup;
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

/// `uep store`: serve a job's store at `listen` until killed, after printing
/// `UEP_STORE=HOST:PORT` (the line a launcher script reads).
pub fn serve_store(listen: &str) -> anyhow::Result<bool> {
    use std::io::Write;
    let server = uep_bootstrap::StoreServer::bind(listen)?;
    println!("{}={}", uep_bootstrap::STORE_VAR, server.addr());
    std::io::stdout().flush()?;
    loop {
        std::thread::park();
    }
}
