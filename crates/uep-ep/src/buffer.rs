//! The `Buffer`: one per rank, owning the registered memory every EP call works in.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use half::bf16;
use uep_bootstrap::Group;
use uep_shm::Region;

use crate::device::{wait_at_least, HostDevice, Until};
use crate::error::{EpError, Result};
use crate::invalid;
use crate::net::{wait_packet, Net, NetConfig};
use crate::symm::{Channel, RegionMap, Symmetric, ABORT_MSG_BYTES};

/// How long a failing rank spends telling the other nodes (its own deadline if shorter).
const ABORT_SEND_TIMEOUT: Duration = Duration::from_secs(2);
/// How long a Buffer that told other nodes of a failure keeps its proxy when dropped.
const ABORT_LINGER: Duration = Duration::from_millis(300);

/// Default deadline of every wait, unless `UEP_TIMEOUT_S` or the config says otherwise.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(100);

/// What a Buffer is sized for. Every rank must pass the same values.
#[derive(Clone, Debug, PartialEq)]
pub struct BufferConfig {
    /// Experts across all ranks; a multiple of the number of ranks.
    pub num_experts: usize,
    /// Hidden size (channels a token); a multiple of 128 for FP8.
    pub hidden: usize,
    /// Top-k slots a token has.
    pub topk: usize,
    /// Normal mode: most tokens one rank dispatches in a call.
    pub num_max_dispatch_tokens_per_rank: usize,
    /// Low-latency mode: most tokens one rank dispatches in a call (0 disables LL).
    pub num_max_ll_tokens_per_rank: usize,
    /// Deadline of every wait.
    pub timeout: Duration,
    /// Kernel threads of the host device.
    pub device_threads: usize,
    /// The network path to ranks on other nodes (used only when there are several).
    pub net: NetConfig,
}

impl BufferConfig {
    /// A config with the default timeout (`UEP_TIMEOUT_S` if set) and one kernel thread.
    pub fn new(
        num_experts: usize,
        hidden: usize,
        topk: usize,
        max_tokens: usize,
        ll_max_tokens: usize,
    ) -> Self {
        BufferConfig {
            num_experts,
            hidden,
            topk,
            num_max_dispatch_tokens_per_rank: max_tokens,
            num_max_ll_tokens_per_rank: ll_max_tokens,
            timeout: timeout_from_env().unwrap_or(DEFAULT_TIMEOUT),
            device_threads: 1,
            net: NetConfig::default(),
        }
    }

    /// Bytes of registered memory each rank needs for this config on `num_ranks` ranks
    /// spread over `num_nodes` nodes (most of it is touched only when used).
    pub fn bytes_needed(&self, num_ranks: usize, num_nodes: usize) -> usize {
        RegionMap::new(self, num_ranks, num_nodes > 1).total
    }

    fn validate(&self, num_ranks: usize) -> Result<()> {
        if num_ranks == 0 || self.num_experts == 0 || self.num_experts % num_ranks != 0 {
            return Err(invalid!(
                "num_experts ({}) must be a positive multiple of the number of ranks ({num_ranks})",
                self.num_experts
            ));
        }
        if self.hidden == 0 || self.hidden % 8 != 0 {
            return Err(invalid!(
                "hidden ({}) must be a positive multiple of 8",
                self.hidden
            ));
        }
        if self.topk == 0 || self.topk > self.num_experts {
            return Err(invalid!(
                "topk ({}) must be in 1..={} (num_experts)",
                self.topk,
                self.num_experts
            ));
        }
        if self.num_max_dispatch_tokens_per_rank == 0 && self.num_max_ll_tokens_per_rank == 0 {
            return Err(invalid!(
                "a Buffer needs room for normal or low-latency tokens (both maxima are 0)"
            ));
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
        .filter(|v| *v > 0.0)
        .map(Duration::from_secs_f64)
}

/// Activations a rank sends: bf16, or FP8 e4m3 bytes with one f32 scale per 128 channels.
#[derive(Clone, Copy, Debug)]
pub enum Tokens<'a> {
    /// `[T, H]` bf16.
    Bf16(&'a [bf16]),
    /// `[T, H]` e4m3 bytes and `[T, H/128]` scales.
    Fp8 {
        /// The e4m3 values.
        data: &'a [u8],
        /// The per-128-channel scales.
        scales: &'a [f32],
    },
}

impl Tokens<'_> {
    /// Whether these are FP8.
    pub fn is_fp8(&self) -> bool {
        matches!(self, Tokens::Fp8 { .. })
    }

    /// Bytes of one token row (without scales).
    pub fn row_bytes(&self, hidden: usize) -> usize {
        if self.is_fp8() {
            hidden
        } else {
            hidden * 2
        }
    }

    /// Number of tokens, checking the shapes against `hidden`.
    pub fn num_tokens(&self, hidden: usize) -> Result<usize> {
        match self {
            Tokens::Bf16(x) => {
                if x.len() % hidden != 0 {
                    return Err(invalid!(
                        "x has {} bf16 values, not a multiple of hidden = {hidden}",
                        x.len()
                    ));
                }
                Ok(x.len() / hidden)
            }
            Tokens::Fp8 { data, scales } => {
                if hidden % 128 != 0 {
                    return Err(invalid!(
                        "FP8 needs hidden to be a multiple of 128, got {hidden}"
                    ));
                }
                if data.len() % hidden != 0 {
                    return Err(invalid!(
                        "x has {} FP8 values, not a multiple of hidden = {hidden}",
                        data.len()
                    ));
                }
                let t = data.len() / hidden;
                if scales.len() != t * (hidden / 128) {
                    return Err(invalid!(
                        "x scales have {} values, expected [tokens = {t}, hidden/128 = {}]",
                        scales.len(),
                        hidden / 128
                    ));
                }
                Ok(t)
            }
        }
    }

    /// The bytes of row `t`.
    pub(crate) fn row(&self, t: usize, hidden: usize) -> &[u8] {
        match self {
            Tokens::Bf16(x) => bytemuck::cast_slice(&x[t * hidden..(t + 1) * hidden]),
            Tokens::Fp8 { data, .. } => &data[t * hidden..(t + 1) * hidden],
        }
    }

    /// The scales of row `t` (empty for bf16).
    pub(crate) fn row_scales(&self, t: usize, hidden: usize) -> &[f32] {
        match self {
            Tokens::Bf16(_) => &[],
            Tokens::Fp8 { scales, .. } => {
                let g = hidden / 128;
                &scales[t * g..(t + 1) * g]
            }
        }
    }
}

/// Received activations, borrowed from the Buffer until its next call.
#[derive(Clone, Copy, Debug)]
pub enum RecvTokens<'a> {
    /// `[N, H]` bf16.
    Bf16(&'a [bf16]),
    /// `[N, H]` e4m3 bytes and `[N, H/128]` scales.
    Fp8 {
        /// The e4m3 values.
        data: &'a [u8],
        /// The per-128-channel scales.
        scales: &'a [f32],
    },
}

/// One rank's handle on expert-parallel communication: registered memory mapped by the
/// node's ranks, and the calls of the DeepEP programming model.
pub struct Buffer {
    pub(crate) group: Group,
    pub(crate) cfg: BufferConfig,
    pub(crate) map: RegionMap,
    pub(crate) symm: Symmetric,
    pub(crate) device: HostDevice,
    pub(crate) rank: usize,
    pub(crate) num_ranks: usize,
    /// Identifies this Buffer in the handles it returns.
    pub(crate) id: u64,
    pub(crate) dispatch_seq: u32,
    pub(crate) combine_seq: u32,
    pub(crate) ll_seq: u32,
    pub(crate) barrier_seq: u64,
    /// The proxy, when some ranks are on other nodes. Declared after `symm` is not
    /// enough: `Drop` stops it explicitly before the memory it writes goes away.
    pub(crate) net: Option<Net>,
}

impl Drop for Buffer {
    fn drop(&mut self) {
        // The proxy's threads and transports write into `symm`: stop them first. After
        // telling other nodes of a failure, keep them a moment longer: a send completion
        // only says the bytes left; closing the connections at once could lose them.
        if self.net.as_ref().is_some_and(Net::abort_sent) {
            std::thread::sleep(ABORT_LINGER);
        }
        self.net.take();
    }
}

impl std::fmt::Debug for Buffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Buffer")
            .field("rank", &self.rank)
            .field("num_ranks", &self.num_ranks)
            .field("cfg", &self.cfg)
            .field("bytes", &self.map.total)
            .finish()
    }
}

impl Buffer {
    /// Create this rank's registered memory, map the node's peers, and synchronise.
    /// Collective: every rank of `group` calls it with the same `cfg`.
    pub fn new(group: Group, cfg: BufferConfig) -> Result<Buffer> {
        let rank = group.rank();
        let num_ranks = group.world_size();
        if let Err(e) = cfg.validate(num_ranks) {
            group.abort(&e.to_string());
            return Err(e);
        }
        let map = RegionMap::new(&cfg, num_ranks, group.num_nodes() > 1);
        // Every rank must agree on the config: compare it through the bootstrap first,
        // so a mismatch is a clear error rather than a size mismatch of segments.
        // Local settings (deadline, threads, fault injection) may differ between ranks.
        let fingerprint = format!(
            "num_experts {}, hidden {}, topk {}, max tokens {}, LL max tokens {}, {} bytes",
            cfg.num_experts,
            cfg.hidden,
            cfg.topk,
            cfg.num_max_dispatch_tokens_per_rank,
            cfg.num_max_ll_tokens_per_rank,
            map.total
        );
        let all = group.all_gather(fingerprint.as_bytes())?;
        if let Some((peer, other)) = all
            .iter()
            .enumerate()
            .find(|(_, f)| f.as_slice() != fingerprint.as_bytes())
        {
            return Err(invalid!(
                "rank {rank} and rank {peer} were given different Buffer configs: {fingerprint} vs {}",
                String::from_utf8_lossy(other)
            ));
        }
        let name = uep_shm::segment_name(group.job_id(), rank, std::process::id());
        let own = uep_shm::Segment::create(&name, map.total);
        let names = group.all_gather(own.as_ref().map(|_| name.as_bytes()).unwrap_or(b""))?;
        let own = own?;
        own.region()
            .atomic_u64(map.pid)?
            .store(std::process::id() as u64, Ordering::Release);
        let names: Vec<String> = names
            .iter()
            .map(|n| String::from_utf8_lossy(n).into_owned())
            .collect();
        if let Some(peer) = names.iter().position(String::is_empty) {
            return Err(EpError::Peer(format!(
                "rank {peer} could not create its shared memory segment"
            )));
        }
        let node = group.node();
        let lws = group.local_world_size();
        let local: Vec<usize> = (node * lws..(node + 1) * lws).collect();
        let symm = Symmetric::map_peers(rank, own, &names, &local, map.total, cfg.timeout);
        let ok = symm.is_ok();
        // Everyone has mapped everything (or failed) past this barrier; then the names go.
        let verdicts = group.all_gather(&[ok as u8])?;
        let mut symm = symm?;
        if let Some(peer) = verdicts.iter().position(|v| v.first() != Some(&1)) {
            return Err(EpError::Peer(format!(
                "rank {peer} could not map the node's shared memory"
            )));
        }
        symm.unlink()?;
        let net = if group.num_nodes() > 1 {
            // The proxy's leader barrier needs to know who leads each node.
            let mut net = cfg.net.clone();
            net.proxy.ranks_per_node = Some(lws);
            Some(Net::start(&group, &map, symm.local(), &net)?)
        } else {
            None
        };
        let mut id = [0u8; 8];
        id[..4].copy_from_slice(&(rank as u32).to_le_bytes());
        id[4..].copy_from_slice(&std::process::id().to_le_bytes());
        Ok(Buffer {
            device: HostDevice::new(cfg.device_threads),
            group,
            map,
            symm,
            rank,
            num_ranks,
            id: u64::from_le_bytes(id) ^ rand::random::<u64>(),
            cfg,
            dispatch_seq: 0,
            combine_seq: 0,
            ll_seq: 0,
            barrier_seq: 0,
            net,
        })
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks.
    pub fn num_ranks(&self) -> usize {
        self.num_ranks
    }

    /// The config.
    pub fn config(&self) -> &BufferConfig {
        &self.cfg
    }

    /// Bytes of registered memory this rank owns.
    pub fn bytes(&self) -> usize {
        self.map.total
    }

    /// Experts hosted by each rank.
    pub fn experts_per_rank(&self) -> usize {
        self.cfg.num_experts / self.num_ranks
    }

    /// Set the deadline of every wait.
    pub fn set_timeout(&mut self, timeout: Duration) {
        self.cfg.timeout = timeout;
    }

    /// The bootstrap group (for out-of-band collectives such as result checks).
    pub fn group(&self) -> &Group {
        &self.group
    }

    /// Deadline and abort word for the waits of one call.
    pub(crate) fn until(&self) -> Result<Until<'_>> {
        let abort = self.symm.local().atomic_u64(self.map.abort)?;
        Ok(Until {
            deadline: Instant::now() + self.cfg.timeout,
            abort: Some(abort),
            peer: None,
        })
    }

    /// Wait until the counter at `offset` of this rank's region reaches `target`.
    pub(crate) fn wait_local(
        &self,
        offset: usize,
        target: u64,
        peer: usize,
        until: Until<'_>,
        what: impl Fn() -> String,
    ) -> Result<u64> {
        let counter = self.symm.local().atomic_u64(offset)?;
        wait_at_least(
            counter,
            target,
            until.watching(peer, self.peer_pid(peer)),
            what,
        )
        .map_err(|e| self.explain_abort(e))
        .or_else(|e| self.fail(e))
    }

    /// The process id of `peer`, when it shares this machine's memory.
    pub(crate) fn peer_pid(&self, peer: usize) -> Option<u32> {
        let region = self.symm.peer(peer)?;
        let pid = region
            .atomic_u64(self.map.pid)
            .ok()?
            .load(Ordering::Acquire);
        (pid != 0).then_some(pid as u32)
    }

    /// Add the aborting peer's reason to a peer-failure error (and the deadline to a timeout).
    pub(crate) fn explain_abort(&self, e: EpError) -> EpError {
        let EpError::Peer(msg) = e else {
            return self.explain_timeout(e);
        };
        match self.abort_reason() {
            Some((_, reason)) if !msg.contains(&reason) => {
                EpError::Peer(format!("{msg}: {reason}"))
            }
            _ => EpError::Peer(msg),
        }
    }

    /// Say how long was waited and how to wait longer.
    pub(crate) fn explain_timeout(&self, e: EpError) -> EpError {
        match e {
            EpError::Timeout(m) => EpError::Timeout(format!(
                "{m} after {:?} (raise it with UEP_TIMEOUT_S or Buffer::set_timeout)",
                self.cfg.timeout
            )),
            e => e,
        }
    }

    /// The first rank that failed and why, if any rank did.
    fn abort_reason(&self) -> Option<(usize, String)> {
        let local = self.symm.local();
        let who = local
            .atomic_u64(self.map.abort)
            .ok()?
            .load(Ordering::Acquire);
        let who = (who as usize).checked_sub(1)?;
        let mut reason = [0u8; ABORT_MSG_BYTES];
        let _ = local.read(self.map.abort_msg(who.min(self.num_ranks - 1)), &mut reason);
        let end = reason.iter().position(|&b| b == 0).unwrap_or(reason.len());
        Some((who, String::from_utf8_lossy(&reason[..end]).into_owned()))
    }

    /// Calls after a failure would pair with the wrong calls of other ranks: refuse them.
    pub(crate) fn ensure_usable(&self) -> Result<()> {
        match self.abort_reason() {
            None => Ok(()),
            Some((who, reason)) => Err(EpError::Peer(format!(
                "rank {}: this Buffer is unusable after rank {who} failed ({reason}); create a new Buffer",
                self.rank
            ))),
        }
    }

    /// Fail a call: tell every rank that shares memory with this one, this rank included
    /// (so none waits for it, and later calls refuse to run), and return `e`.
    pub(crate) fn fail<T>(&self, e: EpError) -> Result<T> {
        let msg = format!("rank {}: {e}", self.rank);
        let mut bytes = msg.into_bytes();
        bytes.truncate(ABORT_MSG_BYTES - 1);
        bytes.push(0);
        let slot = self.map.abort_msg(self.rank);
        for peer in 0..self.num_ranks {
            let Ok(region) = self.peer_region(peer) else {
                continue;
            };
            if region.write(slot, &bytes).is_ok() {
                if let Ok(word) = region.atomic_u64(self.map.abort) {
                    let _ = word.compare_exchange(
                        0,
                        self.rank as u64 + 1,
                        Ordering::AcqRel,
                        Ordering::Acquire,
                    );
                }
            }
        }
        // Ranks on other nodes share no memory: the proxy writes the same two things
        // into their regions, so they stop now rather than at their deadline.
        let origin = self
            .symm
            .local()
            .atomic_u64(self.map.abort)
            .is_ok_and(|w| w.load(Ordering::Acquire) == self.rank as u64 + 1);
        // Only the rank that failed first: the others of its node share its abort
        // word, and the ranks of other nodes hear it from it.
        if let (Some(net), true) = (&self.net, origin) {
            let remote: Vec<usize> = (0..self.num_ranks).filter(|&r| !self.is_local(r)).collect();
            let local = self.symm.local();
            let staged = local
                .atomic_u64(self.map.net.abort_src)
                .map(|w| w.store(self.rank as u64 + 1, Ordering::Release));
            let deadline = Instant::now() + self.cfg.timeout.min(ABORT_SEND_TIMEOUT);
            if let Err(why) = staged
                .map_err(EpError::from)
                .and_then(|()| net.send_abort(&self.map, self.rank, &remote, deadline))
            {
                tracing::warn!(rank = self.rank, "could not tell the other nodes: {why}");
            }
        }
        Err(e)
    }

    /// The region of `peer`: mapped memory for ranks of this node.
    pub(crate) fn peer_region(&self, peer: usize) -> Result<Region> {
        self.symm
            .peer(peer)
            .copied()
            .ok_or_else(|| invalid!("rank {peer} shares no memory with rank {}", self.rank))
    }

    /// A barrier over all ranks, hierarchical: release stores among the node's ranks;
    /// on several nodes the node leaders (local rank 0) then meet through the proxy's
    /// barrier (zero-length writes carrying a barrier immediate) and release their node.
    pub fn barrier(&mut self) -> Result<()> {
        self.ensure_usable()?;
        self.barrier_seq += 1;
        let (seq, me) = (self.barrier_seq, self.rank);
        let until = self.until()?;
        let topo = self.topology();
        for peer in topo.node_ranks(topo.node) {
            self.peer_region(peer)?
                .atomic_u64(self.map.barrier + 8 * me)?
                .store(seq, Ordering::Release);
        }
        for peer in topo.node_ranks(topo.node) {
            let what =
                || format!("rank {me}: barrier {seq}: waiting for rank {peer} (barrier[{peer}])");
            self.wait_local(self.map.barrier + 8 * peer, seq, peer, until, what)?;
        }
        if topo.num_nodes == 1 {
            return Ok(());
        }
        let leader = topo.node * topo.ranks_per_node;
        if me == leader {
            self.net()?
                .barrier(me, seq, until)
                .map_err(|e| self.explain_abort(e))
                .or_else(|e| self.fail(e))?;
            for peer in topo.node_ranks(topo.node).filter(|&p| p != me) {
                self.peer_region(peer)?
                    .atomic_u64(self.map.barrier_release)?
                    .store(seq, Ordering::Release);
            }
        } else {
            let what = || {
                format!("rank {me}: barrier {seq}: waiting for rank {leader} to meet the other nodes (barrier_release)")
            };
            self.wait_local(self.map.barrier_release, seq, leader, until, what)?;
        }
        Ok(())
    }

    /// Bytes this rank has handed to its proxy for ranks on other nodes so far: every
    /// packet (token rows, their metadata and headers), as sent, not as computed.
    pub fn net_bytes_sent(&self) -> u64 {
        self.net.as_ref().map_or(0, Net::sent_bytes)
    }

    /// Faults injected into this rank's network path so far (see `NetConfig::faults`).
    pub fn faults_injected(&self) -> u64 {
        self.net.as_ref().map_or(0, Net::faults_injected)
    }

    /// `rows` received token rows at `x` (with FP8 scales at `scales`) of this rank's
    /// region, as the view a dispatch returns.
    pub(crate) fn recv_tokens(
        &self,
        x: usize,
        scales: usize,
        rows: usize,
        fp8: bool,
    ) -> Result<RecvTokens<'_>> {
        let h = self.cfg.hidden;
        Ok(if fp8 {
            RecvTokens::Fp8 {
                data: self.symm.view(x, rows * h)?,
                scales: self.symm.view(scales, rows * (h / 128))?,
            }
        } else {
            RecvTokens::Bf16(bytemuck::cast_slice(self.symm.view::<u16>(x, rows * h)?))
        })
    }

    /// Where this rank sits among nodes.
    pub(crate) fn topology(&self) -> Topology {
        let l = self.group.local_world_size();
        Topology {
            ranks_per_node: l,
            node: self.rank / l,
            local: self.rank % l,
            num_nodes: self.num_ranks / l,
        }
    }

    /// Whether `peer` shares memory with this rank (same node).
    pub(crate) fn is_local(&self, peer: usize) -> bool {
        self.symm.peer(peer).is_some()
    }

    fn net(&self) -> Result<&Net> {
        self.net
            .as_ref()
            .ok_or_else(|| invalid!("rank {} has no network path (one node)", self.rank))
    }

    /// Wait until this rank's staging packet for (`ch`, `dst`) may be rewritten.
    pub(crate) fn reclaim(&self, ch: Channel, dst: usize, until: Until<'_>) -> Result<()> {
        let until = Until {
            abort: None,
            ..until
        };
        self.net()?.reclaim(ch, dst, until)
    }

    /// Send the `len`-byte packet staged for (`ch`, `dst`) and announce it.
    pub(crate) fn send_staged(&self, ch: Channel, dst: usize, len: usize) -> Result<()> {
        self.send_staged_with(ch, dst, len, &[])
    }

    /// [`Buffer::send_staged`], after writing each `(from, to, len)` of `direct` from
    /// this rank's region into `dst`'s.
    pub(crate) fn send_staged_with(
        &self,
        ch: Channel,
        dst: usize,
        len: usize,
        direct: &[(usize, usize, usize)],
    ) -> Result<()> {
        let deadline = Instant::now() + self.cfg.timeout;
        self.net()?
            .send(&self.map, self.rank, ch, dst, len, direct, deadline)
    }

    /// Stage `len` bytes for (`ch`, `dst`) with `fill(region, offset)` and send them.
    pub(crate) fn stage_and_send(
        &self,
        ch: Channel,
        dst: usize,
        len: usize,
        until: Until<'_>,
        fill: impl FnOnce(&Region, usize) -> uep_shm::Result<()>,
    ) -> Result<()> {
        self.reclaim(ch, dst, until)?;
        fill(self.symm.local(), self.map.net.staging(ch, dst))?;
        self.send_staged(ch, dst, len)
    }

    /// Wait for the next packet from `src` (on another node).
    pub(crate) fn wait_packet(
        &self,
        src: usize,
        until: Until<'_>,
        what: impl Fn() -> String,
    ) -> Result<()> {
        wait_packet(self.net()?, self.symm.local(), &self.map, src, until, what)
            .map_err(|e| self.explain_abort(e))
            .or_else(|e| self.fail(e))
    }

    /// Fail this rank's peers' pending bootstrap collectives with `reason` (used when a
    /// rank rejects its input, so that nobody waits for it).
    pub fn abort(&self, reason: &str) {
        self.group.abort(reason);
    }
}

/// Ranks are numbered node by node: rank `r` is local rank `r % L` of node `r / L`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Topology {
    /// `L`.
    pub ranks_per_node: usize,
    /// This rank's node.
    pub node: usize,
    /// This rank's index inside its node.
    pub local: usize,
    /// Number of nodes.
    pub num_nodes: usize,
}

impl Topology {
    /// The ranks of node `m`.
    pub fn node_ranks(self, m: usize) -> std::ops::Range<usize> {
        m * self.ranks_per_node..(m + 1) * self.ranks_per_node
    }

    /// The node of rank `r`.
    pub fn node_of(self, r: usize) -> usize {
        r / self.ranks_per_node
    }

    /// Every node but this rank's.
    pub fn remote_nodes(self) -> impl Iterator<Item = usize> {
        (0..self.num_nodes).filter(move |&m| m != self.node)
    }

    /// The rank of node `m` with `r`'s local index: it relays `r`'s tokens inside `m`
    /// (and returns `m`'s partial sums to `r`), as DeepEP pairs RDMA peers by local rank.
    pub fn relay(self, r: usize, m: usize) -> usize {
        m * self.ranks_per_node + r % self.ranks_per_node
    }
}
