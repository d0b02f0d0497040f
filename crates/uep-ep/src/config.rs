//! What a [`Buffer`](crate::Buffer) is sized for: one shape per mode, and the settings
//! that are local to a rank (deadline, kernel threads, the network path).

use std::time::Duration;

use crate::error::Result;
use crate::exchange::Record;
use crate::invalid;
use std::sync::Arc;
use uep_proxy::ProxyConfig;

use uep_transport::{Connector, FabricOptions, FaultConfig, LibfabricConnector};

use crate::liveness::LivenessConfig;

/// Default deadline of every wait, unless `UEP_TIMEOUT_S` or the config says otherwise
/// (DeepEP's CPU timeout).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(100);

/// The shape one mode's calls may use: they may dispatch up to `max_tokens` tokens of
/// `hidden` channels with `topk` slots to `num_experts` experts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shape {
    /// Experts across all ranks; a multiple of the number of ranks.
    pub num_experts: usize,
    /// Channels a token has; a multiple of 8 (of 128 for FP8).
    pub hidden: usize,
    /// Top-k slots a token has.
    pub topk: usize,
    /// Most tokens one rank dispatches in a call.
    pub max_tokens: usize,
}

// A Shape travels over the control plane (the Python package's rebuild requests).
impl Record for Shape {
    fn put(&self, out: &mut Vec<u8>) {
        for v in [self.num_experts, self.hidden, self.topk, self.max_tokens] {
            (v as u64).put(out);
        }
    }
    fn take(bytes: &mut &[u8]) -> Option<Self> {
        let mut next = || usize::try_from(u64::take(bytes)?).ok();
        Some(Shape {
            num_experts: next()?,
            hidden: next()?,
            topk: next()?,
            max_tokens: next()?,
        })
    }
}

impl Shape {
    /// Experts each of `num_ranks` ranks hosts.
    pub fn experts_per_rank(&self, num_ranks: usize) -> usize {
        self.num_experts / num_ranks
    }

    /// Scale groups (128 channels each) of a token.
    pub fn groups(&self) -> usize {
        self.hidden.div_ceil(128)
    }

    fn validate(&self, mode: &str, num_ranks: usize) -> Result<()> {
        if self.num_experts == 0 || self.num_experts % num_ranks != 0 {
            return Err(invalid!(
                "{mode}: num_experts ({}) must be a positive multiple of the number of ranks ({num_ranks})",
                self.num_experts
            ));
        }
        if self.hidden == 0 || self.hidden % 8 != 0 {
            return Err(invalid!(
                "{mode}: hidden ({}) must be a positive multiple of 8",
                self.hidden
            ));
        }
        if self.topk == 0 || self.topk > self.num_experts {
            return Err(invalid!(
                "{mode}: topk ({}) must be in 1..={} (num_experts)",
                self.topk,
                self.num_experts
            ));
        }
        if self.max_tokens == 0 {
            return Err(invalid!("{mode}: max_tokens must be at least 1"));
        }
        Ok(())
    }
}

/// What a Buffer is sized for. The shapes must be the same on every rank (the Buffer
/// checks); the other settings are the rank's own.
#[derive(Clone, Debug, PartialEq)]
pub struct BufferConfig {
    /// Normal (high-throughput) mode, if used.
    pub normal: Option<Shape>,
    /// Low-latency mode, if used. Its `max_tokens` is DeepEP's
    /// `num_max_dispatch_tokens_per_rank`.
    pub ll: Option<Shape>,
    /// Deadline of every wait.
    pub timeout: Duration,
    /// Kernel threads of the host device.
    pub device_threads: usize,
    /// Ranks per node. `None`: the ranks that share a host form a node (found at
    /// start-up). `Some(l)`: every `l` consecutive ranks form a node, to emulate several
    /// nodes on one host (they must share a host).
    pub ranks_per_node: Option<usize>,
    /// The network path to ranks on other nodes (used only when there are several).
    pub net: NetConfig,
    /// Elastic mode (DeepEP's `enable_shrink`): a rank found dead or unreachable is
    /// masked on every survivor and the calls of both modes go on without it (see the
    /// `elastic` module). Off: any dead rank fails every call.
    pub elastic: bool,
    /// Elastic mode: the name of the job's *door*, where a process started to replace a
    /// masked rank finds the job ([`Buffer::join`](crate::Buffer::join)). The same on
    /// every rank, and unique to the job (the CLI derives it from the launcher's
    /// rendezvous address). `None`: a masked rank never comes back.
    pub door: Option<String>,
    /// Where the door is kept: in this store, which every host of the job reaches
    /// (the launcher's), or, `None`, in shared memory on this host (then every rank
    /// must be on one host).
    pub door_store: Option<JobStore>,
    /// Elastic mode with a door: room for this many ranks (Mooncake's
    /// `max_group_size`), more than the control plane's. The ranks past it are
    /// *reserved*: whole nodes of the founding ranks' size, masked from the start, each
    /// taken by a process that joins as that rank ([`Buffer::join`](crate::Buffer::join))
    /// once it asks. Experts are placed over all of them (`num_experts` a multiple of
    /// this). `None`: the control plane's ranks.
    pub max_ranks: Option<usize>,
    /// With a door: let in every replacement that asks, at the first agreement after a
    /// combine (or barrier) once every survivor has mapped its memory. Off: only
    /// replacements of ranks the caller admits ([`Buffer::admit`](crate::Buffer::admit)).
    pub auto_admit: bool,
}

/// The job's key-value store, as a config holds it ([`BufferConfig::door_store`]):
/// equal to another only if it is the same store.
#[derive(Clone, Debug)]
pub struct JobStore(pub std::sync::Arc<dyn uep_bootstrap::Store>);

impl PartialEq for JobStore {
    fn eq(&self, other: &Self) -> bool {
        std::sync::Arc::ptr_eq(&self.0, &other.0)
    }
}

impl BufferConfig {
    /// Both modes with the same experts, hidden size and top-k: normal mode for up to
    /// `max_tokens` tokens a rank (0: no normal mode), low-latency mode for up to
    /// `ll_max_tokens` (0: none). The deadline is `UEP_TIMEOUT_S` if set, one kernel
    /// thread, nodes from the hosts.
    pub fn new(
        num_experts: usize,
        hidden: usize,
        topk: usize,
        max_tokens: usize,
        ll_max_tokens: usize,
    ) -> Self {
        let shape = |max_tokens| Shape {
            num_experts,
            hidden,
            topk,
            max_tokens,
        };
        BufferConfig {
            normal: (max_tokens > 0).then(|| shape(max_tokens)),
            ll: (ll_max_tokens > 0).then(|| shape(ll_max_tokens)),
            timeout: timeout_from_env().unwrap_or(DEFAULT_TIMEOUT),
            device_threads: 1,
            ranks_per_node: ranks_per_node_from_env(),
            net: NetConfig::default(),
            elastic: false,
            door: None,
            door_store: None,
            max_ranks: None,
            auto_admit: false,
        }
    }

    /// What every rank must agree on, as text (shown when ranks disagree).
    pub(crate) fn fingerprint(&self, bytes: usize) -> String {
        let mode = |s: &Option<Shape>| match s {
            Some(s) => format!(
                "num_experts {}, hidden {}, topk {}, max tokens {}",
                s.num_experts, s.hidden, s.topk, s.max_tokens
            ),
            None => "off".into(),
        };
        format!(
            "normal: {}; low-latency: {}; ranks per node {:?}; elastic {}; door {:?}; at most \
             {:?} ranks; liveness watch {}; {bytes} bytes",
            mode(&self.normal),
            mode(&self.ll),
            self.ranks_per_node,
            self.elastic,
            self.door,
            self.max_ranks,
            self.net.liveness.watch
        )
    }

    pub(crate) fn validate(&self, num_ranks: usize) -> Result<()> {
        if num_ranks == 0 {
            return Err(invalid!("a job needs at least one rank"));
        }
        if self.normal.is_none() && self.ll.is_none() {
            return Err(invalid!(
                "a Buffer needs room for normal or low-latency tokens (both maxima are 0)"
            ));
        }
        if let Some(s) = &self.normal {
            s.validate("normal mode", num_ranks)?;
        }
        if let Some(s) = &self.ll {
            s.validate("low-latency mode", num_ranks)?;
        }
        if self.elastic && !self.net.liveness.watch {
            return Err(invalid!(
                "elastic mode needs the liveness watch (net.liveness.watch is off): without it \
                 a rank on another node that dies is known only at the deadline"
            ));
        }
        if self.door.is_some() && !self.elastic {
            return Err(invalid!(
                "a door (for ranks that rejoin) needs elastic mode: without it no rank is masked"
            ));
        }
        if self.max_ranks.is_some() && self.door.is_none() {
            return Err(invalid!(
                "room for more ranks (max_ranks) needs a door, where they join (and elastic mode)"
            ));
        }
        if let Some(l) = self.ranks_per_node {
            if l == 0 || num_ranks % l != 0 {
                return Err(invalid!(
                    "ranks per node ({l}) must divide the number of ranks ({num_ranks})"
                ));
            }
        }
        Ok(())
    }
}

/// `UEP_TIMEOUT_S` as a Duration, if set and valid.
pub fn timeout_from_env() -> Option<Duration> {
    let s = std::env::var("UEP_TIMEOUT_S").ok()?;
    s.trim()
        .parse::<f64>()
        .ok()
        .filter(|v| *v > 0.0 && v.is_finite())
        .map(Duration::from_secs_f64)
}

/// `UEP_RANKS_PER_NODE` (nodes of that many consecutive ranks), if set and positive.
pub fn ranks_per_node_from_env() -> Option<usize> {
    std::env::var("UEP_RANKS_PER_NODE")
        .ok()?
        .trim()
        .parse::<usize>()
        .ok()
        .filter(|&n| n > 0)
}

/// Default largest single write of a packet: big enough to stream, small enough that
/// the proxy interleaves peers and the first bytes move while the last are staged.
pub const DEFAULT_WRITE_BYTES: usize = 1 << 20;

/// How the network path is set up.
#[derive(Clone, Debug, PartialEq)]
pub struct NetConfig {
    /// libfabric options (provider, interface).
    pub fabric: FabricOptions,
    /// Who opens the transports, when not libfabric with [`NetConfig::fabric`] (an
    /// in-memory network in tests, another wire).
    pub connector: Option<Connect>,
    /// Proxy threads, FIFOs, flow control.
    pub proxy: ProxyConfig,
    /// Wrap every transport in a fault injector (tests and soak runs).
    pub faults: Option<FaultConfig>,
    /// How quickly a peer on another node is judged gone.
    pub liveness: LivenessConfig,
    /// Largest write a packet is cut into (a multiple of 16). Packets batch every token
    /// bound for a peer; a token row's size here sends one write per row instead, as an
    /// unbatched design would (`uep bench --net-write-bytes` compares them).
    pub write_bytes: usize,
}

/// A [`Connector`] in a [`NetConfig`]: configs compare equal when they share it.
#[derive(Clone, Debug)]
pub struct Connect(pub Arc<dyn Connector>);

impl PartialEq for Connect {
    fn eq(&self, other: &Connect) -> bool {
        std::ptr::addr_eq(Arc::as_ptr(&self.0), Arc::as_ptr(&other.0))
    }
}

impl NetConfig {
    /// The transports' connector: the configured one, else libfabric.
    pub fn connector(&self) -> Arc<dyn Connector> {
        match &self.connector {
            Some(c) => c.0.clone(),
            None => Arc::new(LibfabricConnector(self.fabric.clone())),
        }
    }
}

impl Default for NetConfig {
    fn default() -> Self {
        NetConfig {
            fabric: FabricOptions::from_env(),
            connector: None,
            proxy: ProxyConfig::default(),
            faults: None,
            liveness: LivenessConfig::default(),
            write_bytes: DEFAULT_WRITE_BYTES,
        }
    }
}
