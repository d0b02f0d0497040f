//! The Buffer a `uep bench` rank opens: its config from the flags and the launcher, and
//! the device `--device` names.

use std::sync::Arc;
use std::time::Duration;

use uep_bootstrap::{EnvSource, Group, WorldInfo};
use uep_ep::device::{Device, HostDevice};
use uep_ep::{Buffer, BufferConfig, JoinPoint};
use uep_transport::{FabricOptions, FaultConfig};

use crate::args::{BenchArgs, DeviceKind};

/// What `open_buffer` chose, for the report.
pub(crate) struct Setup {
    /// Kernel threads per rank.
    pub(crate) threads: usize,
    /// The libfabric provider.
    pub(crate) provider: String,
    /// The device's name.
    pub(crate) device: String,
    /// The device, asked after each op which phases ran as kernels.
    pub(crate) kernels: Arc<dyn Device>,
}

/// The Buffer of this rank, configured from the flags and the launcher; without a
/// group, a replacement's, and where it joined.
pub(crate) fn open_buffer(
    args: &BenchArgs,
    info: &WorldInfo,
    group: Option<Group>,
    emulated: Option<usize>,
    timeout: Option<Duration>,
    max_normal: usize,
    max_ll: usize,
) -> anyhow::Result<(Buffer, Setup, Option<JoinPoint>)> {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let threads = if args.threads > 0 {
        args.threads
    } else {
        (cores / info.local_world_size).max(1)
    };
    let mut cfg = BufferConfig::new(args.experts, args.hidden, args.topk, max_normal, max_ll);
    cfg.device_threads = threads;
    if emulated.is_some() {
        cfg.ranks_per_node = emulated;
    }
    if let Some(p) = &args.provider {
        cfg.net.fabric = FabricOptions::for_provider(p);
    }
    // Local ranks play the nodes of a cluster: keep socket providers' traffic on
    // loopback (`shm` has no addresses to choose, and refuses the hint).
    if info.source == EnvSource::Uep
        && cfg.net.fabric.node.is_none()
        && !cfg.net.fabric.provider.starts_with("shm")
    {
        cfg.net.fabric = FabricOptions::loopback(&cfg.net.fabric.provider);
    }
    cfg.net.proxy.threads = if args.proxy_threads > 0 {
        args.proxy_threads
    } else {
        (cores / info.local_world_size).clamp(1, 4)
    };
    if args.writes_in_flight > 0 {
        cfg.net.proxy.max_writes_in_flight_per_fifo = args.writes_in_flight;
    }
    cfg.net.proxy.emulate_ordering = !args.no_ordering_emulation;
    cfg.net.faults = args.faults.map(FaultConfig::with_seed);
    if let Some(b) = args.net_write_bytes {
        cfg.net.write_bytes = b;
    }
    if let Some(t) = timeout {
        cfg.timeout = t;
    }
    cfg.elastic = args.elastic;
    // A door for the processes that join: replacements, and reserved ranks'.
    if !crate::rejoin::planned(args).is_empty() || args.max_ranks.is_some() {
        cfg.door = Some(crate::rejoin::door_name(info));
        cfg.max_ranks = args.max_ranks;
        if !args.door_in_shm {
            cfg.door_store = crate::rejoin::job_store(cfg.timeout)?;
        }
        cfg.auto_admit = true;
    }
    let provider = cfg.net.fabric.provider.clone();
    uep_ep::set_spin_only(args.spin_waits);
    let device = open_device(args.device, threads)?;
    let device_name = device.name().to_string();
    let (buffer, joined, device) = buffer_on(group, cfg, device, info, threads)?;
    let setup = Setup {
        threads,
        provider,
        device: device_name,
        kernels: device,
    };
    Ok((buffer, setup, joined))
}

/// The Buffer of `group` on `device`; without a group, a replacement's (on the host
/// device) and where it joined.
fn buffer_on(
    group: Option<Group>,
    cfg: BufferConfig,
    device: Arc<dyn Device>,
    info: &WorldInfo,
    threads: usize,
) -> anyhow::Result<(Buffer, Option<JoinPoint>, Arc<dyn Device>)> {
    Ok(match group {
        Some(group) => {
            let buffer = Buffer::with_device(Arc::new(group), cfg, device.clone())?;
            (buffer, None, device)
        }
        None => {
            let (buffer, at) = Buffer::join(cfg, info.rank, info.world_size)?;
            (buffer, Some(at), Arc::new(HostDevice::new(threads)))
        }
    })
}

/// The device `--device` names, with `threads` kernel threads for what runs on the host.
fn open_device(kind: DeviceKind, threads: usize) -> anyhow::Result<Arc<dyn Device>> {
    Ok(match kind {
        DeviceKind::Host => Arc::new(HostDevice::new(threads)),
        DeviceKind::Emu => Arc::new(uep_cuda::EmuDevice::new(threads)),
        #[cfg(feature = "cuda")]
        DeviceKind::Cuda => Arc::new(uep_cuda::CudaDevice::open(0, threads)?),
        #[cfg(not(feature = "cuda"))]
        DeviceKind::Cuda => return Err(uep_cuda::CudaError::NotBuilt.into()),
    })
}
