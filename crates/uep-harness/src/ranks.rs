//! Several ranks in one process: a thread each, joined through uep's real TCP
//! rendezvous on loopback, for tests of the EP layer that need no separate processes.

use std::net::TcpListener;
use std::time::Duration;

use uep_bootstrap::{BootstrapError, EnvSource, Group, WorldInfo};

/// Run `f(group)` as every rank of a job of `ranks` ranks, one thread each, and return
/// each rank's result in rank order. Ranks share this process, so they share a host:
/// pass the Buffer a `ranks_per_node` to emulate several nodes.
pub fn run_ranks<T: Send>(
    ranks: usize,
    f: impl Fn(Group) -> T + Sync,
) -> Result<Vec<T>, BootstrapError> {
    let io = |context: &str| {
        let context = context.to_string();
        move |source| BootstrapError::Io { context, source }
    };
    let listener = TcpListener::bind("127.0.0.1:0")
        .map_err(io("binding a loopback port for the rendezvous"))?;
    let port = listener
        .local_addr()
        .map_err(io("reading the rendezvous port"))?
        .port();
    let secret = format!("{:032x}", rand::random::<u128>());
    let info = |rank| WorldInfo {
        rank,
        world_size: ranks,
        local_rank: rank,
        local_world_size: ranks,
        master_addr: "127.0.0.1".into(),
        rendezvous_port: port,
        secret: Some(secret.clone()),
        source: EnvSource::Uep,
    };
    let timeout = Duration::from_secs(60);
    let mut listener = Some(listener);
    std::thread::scope(|s| {
        let f = &f;
        let handles: Vec<_> = (0..ranks)
            .map(|r| {
                let info = info(r);
                let listener = if r == 0 { listener.take() } else { None };
                s.spawn(move || -> Result<T, BootstrapError> {
                    let group = match listener {
                        Some(l) => Group::connect_with_listener(&info, l, timeout)?,
                        None => Group::connect(&info, timeout)?,
                    };
                    Ok(f(group))
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("a rank thread panicked"))
            .collect()
    })
}
