//! The `Buffer`: one per rank, owning the registered memory every EP call works in.
//!
//! It holds what every call works with ([`Ctx`]: topology, symmetric memory, the
//! device, the network path, the elastic mask) and, beside it, the state each mode
//! keeps between calls ([`NormalState`], [`LlState`]); each public call lends the
//! context and its mode's state to the operation (`normal/`, `ll/`, `elastic`). Every
//! call that communicates is *collective* and runs through [`Ctx::collective`], the one
//! place where an error becomes the abort broadcast: the failing rank writes why into
//! every rank of its node (and, through the proxy, of the other nodes), so that nobody
//! waits for it, and every later call on any rank's Buffer fails at once instead of
//! pairing with the wrong call of another rank.

use std::cell::RefCell;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use half::bf16;
use uep_bootstrap::ControlPlane;

use crate::area::Mem;
use crate::config::BufferConfig;
use crate::ctx::{Ctx, ABORT_LINGER};
use crate::device::{Device, HostDevice, MemHandle, SymmetricAlloc};
use crate::door::{Calls, Door, FirstCall, JoinPoint, Process};
use crate::elastic::join;
use crate::error::{EpError, Result};
use crate::exchange;
use crate::invalid;
use crate::layout::DispatchLayout;
use crate::ll::{
    LlCombineInput, LlCombinePending, LlDispatchArgs, LlDispatchOutput, LlHandle, LlPending,
    LlState,
};
use crate::map::RegionMap;
use crate::mask::Elastic;
use crate::net::{NetPath, LL_BUFFERS};
use crate::normal::{
    CombineArgs, CombineOutput, DispatchArgs, DispatchOutput, NormalHandle, NormalState,
};
use crate::symm::{Bank, Lease, Symmetric};
use crate::topology::Topology;
use crate::wait::abort_reason;

/// One rank's handle on expert-parallel communication: registered memory mapped by the
/// node's ranks, and the calls of the DeepEP programming model.
///
/// ```no_run
/// # fn main() -> uep_ep::Result<()> {
/// use half::bf16;
/// use uep_ep::{Buffer, BufferConfig, DispatchArgs, Tokens};
/// // Every rank of the job, started by torchrun, mpirun, srun or `uep`:
/// let world = uep_bootstrap::WorldInfo::from_env().expect("a launcher's environment");
/// let group = uep_bootstrap::Group::connect(&world, std::time::Duration::from_secs(60))
///     .expect("the rendezvous");
/// // 16 experts, hidden 256, top-2, up to 64 tokens a call in normal mode.
/// let mut buffer = Buffer::new(group, BufferConfig::new(16, 256, 2, 64, 0))?;
/// let x = vec![bf16::ONE; 8 * 256];
/// let topk_idx: Vec<i64> = (0..8 * 2).map(|i| (i % 16) as i64).collect();
/// let out = buffer.dispatch(DispatchArgs::new(Tokens::Bf16(&x)).topk(&topk_idx, None))?;
/// let rows = out.handle.num_recv_tokens;
/// let handle = out.handle;
/// let combined = buffer.combine(&vec![bf16::ONE; rows * 256], None, &handle)?;
/// assert_eq!(combined.combined_x.len(), 8 * 256);
/// # Ok(())
/// # }
/// ```
pub struct Buffer {
    cx: Ctx,
    normal: NormalState,
    ll: LlState,
    /// Barriers so far (equal on every rank between calls).
    barriers: u64,
}

impl Drop for Buffer {
    fn drop(&mut self) {
        self.cx.close_door();
        let Some(net) = &self.cx.net else {
            return;
        };
        let failed =
            net.abort_sent() || abort_reason(self.cx.symm.local(), &self.cx.map.control).is_some();
        if !failed && self.cx.elastic.is_some() {
            if let Err(e) = self.cx.settle_last() {
                tracing::warn!(rank = self.cx.topo.rank, "closing an elastic Buffer: {e}");
            }
        }
        let Some(net) = self.cx.net.take() else {
            return;
        };
        if failed {
            // After telling other nodes of a failure, keep the proxy a moment: a send
            // completion only says the bytes left; closing the connections at once could
            // lose them. No drain: a failed job's peers may never complete anything.
            if net.abort_in_flight() {
                std::thread::sleep(ABORT_LINGER);
            }
            drop(net);
        } else {
            net.shutdown();
        }
    }
}

impl std::fmt::Debug for Buffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Buffer")
            .field("topology", &self.cx.topo)
            .field("cfg", &self.cx.cfg)
            .field("bytes", &self.cx.map.total)
            .finish_non_exhaustive()
    }
}

impl Buffer {
    /// Create this rank's registered memory, map the node's peers, connect the other
    /// nodes, and synchronise. Collective: every rank of the control plane calls it with
    /// the same shapes.
    pub fn new<C: ControlPlane + 'static>(cp: C, cfg: BufferConfig) -> Result<Buffer> {
        Buffer::with_control_plane(Arc::new(cp), cfg)
    }

    /// [`Buffer::new`] on a shared control plane.
    pub fn with_control_plane(cp: Arc<dyn ControlPlane>, cfg: BufferConfig) -> Result<Buffer> {
        let device = Arc::new(HostDevice::new(cfg.device_threads));
        Buffer::with_device(cp, cfg, device)
    }

    /// [`Buffer::with_control_plane`] whose kernels run on `device` instead of the host
    /// device of `cfg.device_threads` threads. The results are the same bit for bit on
    /// every device; the ranks of a job may use different ones.
    pub fn with_device(
        cp: Arc<dyn ControlPlane>,
        cfg: BufferConfig,
        device: Arc<dyn Device>,
    ) -> Result<Buffer> {
        let cx = open(cp, cfg, device)?;
        Ok(Buffer::from_ctx(cx, Calls::default()))
    }

    /// Take the place of masked rank `rank` of a running elastic job of `world` ranks,
    /// as a process started to replace it: find the job at the door of `cfg` (the
    /// founding ranks' config, [`BufferConfig::door`], in the job's store
    /// [`BufferConfig::door_store`] or on this host), ask to be let in, and return
    /// once the survivors have agreed to (at most `cfg.timeout`), with where the job
    /// is: the caller's next step, and the call it makes first with them.
    ///
    /// ```no_run
    /// # fn main() -> uep_ep::Result<()> {
    /// use std::sync::Arc;
    /// use std::time::Duration;
    /// use uep_bootstrap::TcpStore;
    /// use uep_ep::{Buffer, BufferConfig, JobStore};
    /// let mut cfg = BufferConfig::new(16, 256, 2, 64, 16);
    /// cfg.elastic = true;
    /// cfg.door = Some("uep-door-myjob".into());
    /// // The store the launcher keeps (`uep store`), which the founding ranks used too.
    /// let store = TcpStore::connect("10.0.0.1:29600", Duration::from_secs(10))?;
    /// cfg.door_store = Some(JobStore(Arc::new(store)));
    /// // Rank 3 of 4 died and was masked; this process replaces it.
    /// let (mut buffer, at) = Buffer::join(cfg, 3, 4)?;
    /// println!("serving again from step {} ({:?} first)", at.step, at.first);
    /// # Ok(())
    /// # }
    /// ```
    pub fn join(cfg: BufferConfig, rank: usize, world: usize) -> Result<(Buffer, JoinPoint)> {
        let device = Arc::new(HostDevice::new(cfg.device_threads));
        let (cx, welcome, waited) = join::join(cfg, rank, world, device)?;
        let at = JoinPoint {
            step: welcome.step,
            first: welcome.first,
            waited,
        };
        Ok((Buffer::from_ctx(cx, welcome.calls), at))
    }

    /// A Buffer over `cx` whose calls so far are `calls`.
    fn from_ctx(cx: Ctx, calls: Calls) -> Buffer {
        let map = &cx.map;
        let normal = NormalState {
            dispatch: calls.normal_dispatch,
            combine: calls.normal_combine,
            banks: map
                .normal
                .map(|n| [Bank::new(n.banks[0].area), Bank::new(n.banks[1].area)]),
        };
        let mut ll = LlState::new(map.ll.map(|ll| ll.map(|a| Bank::new(a.bank))));
        (ll.dispatch, ll.combine) = (calls.ll_dispatch, calls.ll_combine);
        Buffer {
            cx,
            normal,
            ll,
            barriers: calls.barriers,
        }
    }

    /// Elastic mode with a door: let a replacement of masked rank `rank` in once it
    /// asks (Mooncake's `recover_ranks`). Every survivor must admit it (or let
    /// everyone in, [`BufferConfig::auto_admit`]); it takes part from the first
    /// dispatch or barrier after the agreement that follows.
    pub fn admit(&mut self, rank: usize) -> Result<()> {
        self.cx.admit(rank)
    }

    /// The caller's step, told to a replacement let in at the next dispatch or
    /// barrier ([`JoinPoint::step`]). Survivors set it before each step's calls.
    pub fn set_step(&mut self, step: u64) {
        self.cx.set_step(step);
    }

    /// Replacements let in by the last agreements take part from this call, unless a
    /// low-latency call still waits for its receive (then from a later one).
    fn let_in(&mut self, first: FirstCall) -> Result<()> {
        let ll = &self.ll;
        if ll
            .unreceived
            .iter()
            .chain(&ll.combine_unreceived)
            .any(Option::is_some)
        {
            return Ok(());
        }
        let calls = Calls {
            ll_dispatch: ll.dispatch,
            ll_combine: ll.combine,
            normal_dispatch: self.normal.dispatch,
            normal_combine: self.normal.combine,
            barriers: self.barriers,
        };
        self.cx.let_in(first, calls)
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.cx.topo.rank
    }

    /// Number of ranks.
    pub fn num_ranks(&self) -> usize {
        self.cx.topo.num_ranks
    }

    /// Where the ranks sit (nodes, this rank's node and index).
    pub fn topology(&self) -> Topology {
        self.cx.topo
    }

    /// The config.
    pub fn config(&self) -> &BufferConfig {
        &self.cx.cfg
    }

    /// Bytes of registered memory this rank owns.
    pub fn bytes(&self) -> usize {
        self.cx.map.total
    }

    /// Set the deadline of every wait.
    pub fn set_timeout(&mut self, timeout: Duration) {
        self.cx.cfg.timeout = timeout;
    }

    /// The control plane (for out-of-band collectives such as result checks).
    pub fn control_plane(&self) -> &dyn ControlPlane {
        self.cx.cp.as_ref()
    }

    /// Bytes this rank has handed to its proxy for ranks on other nodes so far: every
    /// packet (token rows, their metadata and headers), as sent, not as computed.
    pub fn net_bytes_sent(&self) -> u64 {
        self.cx.net.as_ref().map_or(0, NetPath::sent_bytes)
    }

    /// Keeps this rank's registered memory mapped while held, even past the Buffer:
    /// for a binding that hands a view of it (the combine buffer) to code that keeps it.
    pub fn memory_keepalive(&self) -> std::sync::Arc<dyn std::any::Any + Send + Sync> {
        self.cx.symm.local().keepalive()
    }

    /// The addresses of this rank's registered memory, for a binding to check that a
    /// caller's output does not overlap what the Buffer reads (the combine buffer).
    pub fn memory_span(&self) -> std::ops::Range<usize> {
        let local = self.cx.symm.local();
        local.as_ptr() as usize..local.as_ptr() as usize + local.len()
    }

    /// Commands this rank's kernels pushed into the proxy's FIFOs so far, and how long
    /// the kernel launches that push them ran: the kernels' command rate while packing.
    /// Zero on one node.
    pub fn kernel_pushes(&self) -> (u64, Duration) {
        self.cx
            .net
            .as_ref()
            .map_or((0, Duration::ZERO), NetPath::kernel_pushes)
    }

    /// Faults injected into this rank's network path so far (see `NetConfig::faults`).
    pub fn faults_injected(&self) -> u64 {
        self.cx.net.as_ref().map_or(0, NetPath::faults_injected)
    }

    /// The outputs of the normal dispatch `handle` describes (x, scales, top-k ids,
    /// weights; empty ranges where it carried none), mapped to outlive the Buffer's
    /// next calls: for callers that hand outputs to code that keeps them (the Python
    /// package's tensors). Without a copy; an output still held when its bank of
    /// output areas is written again is copied then.
    pub fn lease_dispatch(&mut self, handle: &crate::NormalHandle) -> Result<Lease> {
        if handle.buffer_id != self.cx.id {
            return Err(invalid!(
                "the handle was made by another Buffer (or another rank)"
            ));
        }
        let parts = self.cx.dispatch_areas(handle)?;
        let banks = (self.normal.banks.as_mut())
            .ok_or_else(|| invalid!("this Buffer has no normal-mode buffers"))?;
        Lease::of(&mut banks[handle.bank], &self.cx.symm, &parts, &parts)
    }

    /// The rows and column-major scales (empty for bf16) of low-latency buffer `buffer`
    /// with rows of `format`, mapped to outlive the Buffer's next calls (see
    /// [`Buffer::lease_dispatch`]). With `handle`, only its valid rows are kept when the
    /// bank is reused while held; without (leased before the receive), all of them.
    pub fn lease_ll(
        &mut self,
        buffer: usize,
        format: crate::TokenFormat,
        handle: Option<&crate::LlHandle>,
    ) -> Result<Lease> {
        let areas = self.cx.ll_areas(buffer)?;
        let s = areas.shape;
        let (r_n, m) = (self.cx.topo.num_ranks, s.max_tokens);
        let rows_per_expert = r_n * m;
        let epr = s.experts_per_rank(r_n);
        let (rb, groups) = (format.row_bytes(s.hidden), format.scale_words(s.hidden));
        let x = areas.recv_x.prefix(epr * rows_per_expert * rb)?;
        let scales = areas
            .out_scales
            .prefix(epr * rows_per_expert * groups)?
            .cast::<u8>();
        let mut keep = Vec::new();
        match handle {
            Some(h) => {
                for (le, &n) in h.recv_count.iter().enumerate() {
                    let first = le * rows_per_expert;
                    keep.push(x.slice(first * rb..(first + n as usize) * rb)?);
                    for g in 0..groups {
                        let at = (le * groups + g) * rows_per_expert;
                        keep.push(areas.out_scales.slice(at..at + n as usize)?.cast());
                    }
                }
            }
            None => keep.extend([x, scales]),
        }
        let banks = (self.ll.banks.as_mut())
            .ok_or_else(|| invalid!("this Buffer has no low-latency buffers"))?;
        Lease::of(
            &mut banks[buffer % LL_BUFFERS],
            &self.cx.symm,
            &[x, scales],
            &keep,
        )
    }

    /// Give up on this job: tell every rank that this one failed because of `reason`
    /// (their waits end with it, and their later calls fail), as a call that rejects
    /// its input does. For callers that check input before entering a collective call
    /// (the Python package). Returns the error that was broadcast.
    pub fn abort(&mut self, reason: &str) -> EpError {
        let e = invalid!("{reason}");
        if self.cx.ensure_usable().is_ok() {
            self.cx.broadcast_failure(&e);
        }
        self.cx.cp.abort(reason);
        e
    }

    /// A barrier over all ranks, hierarchical: release stores among the node's ranks;
    /// on several nodes the node leaders (local rank 0) then meet through the proxy's
    /// barrier (zero-length writes carrying a barrier immediate) and release their node.
    ///
    /// On an elastic Buffer it is an agreement round instead (every rank not masked
    /// meets every other), which also spreads the mask.
    pub fn barrier(&mut self) -> Result<()> {
        self.let_in(FirstCall::Barrier)?;
        let seq = &mut self.barriers;
        self.cx.collective(|cx| {
            if cx.elastic.is_some() {
                return cx.agree("barrier", true).map(drop);
            }
            *seq += 1;
            cx.barrier_phases(*seq)
        })
    }

    /// Compute the dispatch layout of `topk_idx` (`[T, K]`) for this Buffer's ranks and
    /// normal-mode experts.
    pub fn get_dispatch_layout(&self, topk_idx: &[i64]) -> Result<DispatchLayout> {
        self.cx.get_dispatch_layout(topk_idx)
    }

    /// Normal dispatch: every token once to every rank hosting one of its experts.
    /// Collective. Bad input is rejected before anything is sent, and peers are told.
    /// If any rank dispatches more tokens than the Buffer's `max_tokens`, every rank
    /// returns [`EpError::Capacity`] and the Buffer stays usable.
    pub fn dispatch(&mut self, args: DispatchArgs<'_>) -> Result<DispatchOutput<'_>> {
        self.let_in(FirstCall::Dispatch)?;
        self.cx.normal_call_begins()?;
        let st = &mut self.normal;
        let dispatched = self.cx.collective(|cx| cx.dispatch_call(st, &args))?;
        self.cx.dispatch_output(dispatched)
    }

    /// Normal combine: every received row back to its source, summed there per token.
    /// `x` is `[rows, H]` bf16 (rows past the received count are ignored), `topk_weights`
    /// `[rows, K]`. Collective.
    pub fn combine(
        &mut self,
        x: &[bf16],
        topk_weights: Option<&[f32]>,
        handle: &NormalHandle,
    ) -> Result<CombineOutput> {
        let (h, k) = match self.cx.map.normal {
            Some(a) => (a.shape.hidden, a.shape.topk),
            None => (0, 0),
        };
        let t_n = handle.num_tokens;
        let mut combined_x = vec![bf16::ZERO; t_n * h];
        let mut combined_w = topk_weights.map(|_| vec![0f32; t_n * k]);
        let args = CombineArgs {
            topk_weights,
            ..Default::default()
        };
        self.combine_into(x, args, handle, &mut combined_x, combined_w.as_deref_mut())?;
        Ok(CombineOutput {
            combined_x,
            combined_topk_weights: combined_w,
        })
    }

    /// [`Buffer::combine`] into caller-owned outputs (`[T, H]` and `[T, K]`), so a loop
    /// of steps allocates nothing, with DeepEP's biases (`args.bias`).
    pub fn combine_into(
        &mut self,
        x: &[bf16],
        args: CombineArgs<'_>,
        handle: &NormalHandle,
        combined_x: &mut [bf16],
        combined_topk_weights: Option<&mut [f32]>,
    ) -> Result<()> {
        self.cx.normal_call_begins()?;
        let st = &mut self.normal;
        self.cx.collective(|cx| {
            cx.combine_call(st, x, &args, handle, combined_x, combined_topk_weights)
        })
    }

    /// Low-latency dispatch of `args.x` (`[T, H]` bf16) by `args.topk_idx` (`[T, K]`),
    /// cast on the way as `args.cast` says, with the gate weights if given. Collective:
    /// the send half and the receive half together.
    pub fn low_latency_dispatch(
        &mut self,
        args: LlDispatchArgs<'_>,
    ) -> Result<LlDispatchOutput<'_>> {
        let pending = self.low_latency_dispatch_send(args)?;
        self.low_latency_dispatch_recv(pending)
    }

    /// The send half of [`Buffer::low_latency_dispatch`]: returns once this rank's
    /// copies are on their way. Receive them with
    /// [`Buffer::low_latency_dispatch_recv`]; at most two dispatches may wait for it.
    pub fn low_latency_dispatch_send(&mut self, args: LlDispatchArgs<'_>) -> Result<LlPending> {
        self.let_in(FirstCall::LowLatencyDispatch)?;
        let st = &mut self.ll;
        self.cx.collective(|cx| cx.ll_send(st, args))
    }

    /// The receive half of a low-latency dispatch: waits for every source's copies and
    /// packs them. Collective (every rank receives the same step).
    pub fn low_latency_dispatch_recv(
        &mut self,
        pending: LlPending,
    ) -> Result<LlDispatchOutput<'_>> {
        let st = &mut self.ll;
        let received = self.cx.collective(|cx| cx.ll_recv(st, &pending))?;
        self.cx.ll_output(&mut self.ll, received)
    }

    /// Low-latency combine: expert outputs `y` (`[E/R, R*M, H]` bf16, laid out like the
    /// dispatch's `recv_x`) back to their tokens, weighted by `topk_weights` (`[T, K]`),
    /// with the same `topk_idx` as the dispatch of `handle`. Returns `[T, H]`. Collective.
    /// `y` may also be [`LlCombineInput::ZeroCopy`]: the rows were written into the
    /// combine buffer and go from there.
    pub fn low_latency_combine<'y>(
        &mut self,
        y: impl Into<LlCombineInput<'y>>,
        topk_idx: &[i64],
        topk_weights: &[f32],
        handle: &LlHandle,
    ) -> Result<Vec<bf16>> {
        let y = y.into();
        let h = self.cx.ll_areas(0).map_or(0, |a| a.shape.hidden);
        let mut out = vec![bf16::ZERO; handle.num_tokens * h];
        let pending = self.low_latency_combine_send(y, topk_idx, topk_weights, handle)?;
        self.low_latency_combine_recv(pending, y, &mut out)?;
        Ok(out)
    }

    /// The send half of [`Buffer::low_latency_combine`]: every expert output row on its
    /// way to its source. Finish with [`Buffer::low_latency_combine_recv`] and the same `y`.
    pub fn low_latency_combine_send<'y>(
        &mut self,
        y: impl Into<LlCombineInput<'y>>,
        topk_idx: &[i64],
        topk_weights: &[f32],
        handle: &LlHandle,
    ) -> Result<LlCombinePending> {
        let (y, st) = (y.into(), &mut self.ll);
        self.cx
            .collective(|cx| cx.ll_combine_send_call(st, y, topk_idx, topk_weights, handle))
    }

    /// The receive half of a low-latency combine: waits for every expert output of this
    /// rank's tokens and writes `sum_k w_k * y_k` into `out` (`[T, H]`). `y` must be the
    /// one passed to the send half (this rank's own expert outputs are read from it).
    pub fn low_latency_combine_recv<'y>(
        &mut self,
        pending: LlCombinePending,
        y: impl Into<LlCombineInput<'y>>,
        out: &mut [bf16],
    ) -> Result<()> {
        let (y, st) = (y.into(), &mut self.ll);
        self.cx
            .collective(|cx| cx.ll_combine_recv_call(st, &pending, y, out))
    }

    /// The next combine's buffer (`[E/R, R*M, H]` bf16), for the caller to write expert
    /// outputs into before a [`LlCombineInput::ZeroCopy`] combine (DeepEP's
    /// `get_next_low_latency_combine_buffer`). Waits until the combine that last used
    /// it is done with it: what it sent from there has left, and the node's ranks that
    /// read their rows there received it. Only this rank writes the buffer, and only
    /// through this slice.
    pub fn low_latency_combine_buffer(&mut self) -> Result<&mut [bf16]> {
        self.cx.next_combine_buffer(&mut self.ll)
    }

    /// Whether this Buffer is elastic (`BufferConfig::elastic`).
    pub fn is_elastic(&self) -> bool {
        self.cx.elastic.is_some()
    }

    /// `[rank]`: whether the rank is masked (DeepEP's
    /// `low_latency_query_mask_buffer`): the mask the last low-latency call used, and
    /// the caller's own changes since; all `false` on a Buffer that is not elastic.
    /// A rank found gone during a call's agreement round counted in that call, so it
    /// appears here once the next call begins.
    pub fn low_latency_mask(&self) -> Vec<bool> {
        self.cx.low_latency_mask()
    }

    /// Why each masked rank was masked (`None` for the others).
    pub fn low_latency_mask_reasons(&self) -> Vec<Option<String>> {
        self.cx.low_latency_mask_reasons()
    }

    /// `[rank]`: when this rank masked it (`None`: not masked); with the time a rank
    /// died, how long the survivors took to notice.
    pub fn low_latency_masked_at(&self) -> Vec<Option<std::time::SystemTime>> {
        self.cx.low_latency_masked_at()
    }

    /// The mask the last combine (low-latency or normal) used: its agreed mask, which
    /// may have grown since its dispatch (that dispatch's mask is in its handle).
    pub fn last_combine_mask(&self) -> Vec<bool> {
        self.cx.last_combine_mask()
    }

    /// Mask (`mask = true`) or unmask `rank` (DeepEP's
    /// `low_latency_update_mask_buffer`). A rank found gone cannot be unmasked.
    pub fn low_latency_update_mask(&mut self, rank: usize, mask: bool) -> Result<()> {
        self.cx.low_latency_update_mask(rank, mask)
    }

    /// Unmask every rank that was not found gone (DeepEP's
    /// `low_latency_clean_mask_buffer`).
    pub fn low_latency_clean_mask(&mut self) -> Result<()> {
        self.cx.low_latency_clean_mask()
    }

    /// The agreements this elastic Buffer took part in, and a digest of every mask
    /// they decided, in order: the same on every survivor (what `uep bench --chaos`
    /// compares). `(0, 0)` on a Buffer that is not elastic.
    pub fn low_latency_agreements(&self) -> (u64, u64) {
        self.cx.agreements()
    }

    /// Fault injection for tests: run `fault` (`uep bench --chaos`: SIGKILL this
    /// process) in the agreement `after` agreements from now (0: the next), once this
    /// rank has sent `sends` of its messages.
    #[doc(hidden)]
    pub fn fault_in_agreement(
        &mut self,
        after: u64,
        sends: usize,
        fault: Box<dyn FnOnce() + Send>,
    ) -> Result<()> {
        self.cx.fault_in_agreement(after, sends, fault)
    }
}

/// Meet the other ranks, make and map the registered memory, connect the other nodes:
/// the context of a new Buffer. Collective.
fn open(cp: Arc<dyn ControlPlane>, cfg: BufferConfig, device: Arc<dyn Device>) -> Result<Ctx> {
    let (rank, founding) = (cp.rank(), cp.world_size());
    let num_ranks = cfg.max_ranks.unwrap_or(founding);
    if let Err(e) = room(founding, num_ranks).and_then(|()| cfg.validate(num_ranks)) {
        cp.abort(&e.to_string());
        return Err(e);
    }
    let met = meet(cp.as_ref(), &cfg)?;
    let (symm, door) = share_memory(cp.as_ref(), (&cfg, device.symmetric_alloc()), &met)?;
    let (topo, map) = (met.topo, met.map);
    // An elastic job's proxies outlive a peer's failure.
    let mut net_cfg = cfg.net.clone();
    net_cfg.proxy.elastic |= cfg.elastic;
    let net = match map.net {
        Some(areas) if topo.num_nodes > 1 => Some(NetPath::start(
            cp.as_ref(),
            topo,
            symm.local(),
            areas,
            &net_cfg,
            device.fifo_alloc(),
        )?),
        _ => None,
    };
    // A joiner on another node reaches this rank at the endpoints the door names.
    if let (Some(door), Some(net)) = (&door, &net) {
        door.set_reach(rank, &net.reach())?;
    }
    let elastic = cfg.elastic.then(|| {
        let mut e = Elastic::new(num_ranks, cfg.auto_admit);
        for r in founding..num_ranks {
            e.mask_absent(r, "reserved: no process has joined as it yet".into());
        }
        RefCell::new(e)
    });
    let cx = Ctx {
        device,
        cp,
        topo,
        map,
        symm,
        id: rand::random::<u64>() ^ ((rank as u64) << 48) ^ std::process::id() as u64,
        cfg,
        net,
        elastic,
        door,
        said_lost: Default::default(),
    };
    Ok(cx)
}

/// Room for `num_ranks` ranks (`BufferConfig::max_ranks`), of which the control plane
/// has `founding`.
fn room(founding: usize, num_ranks: usize) -> Result<()> {
    match num_ranks >= founding {
        true => Ok(()),
        false => Err(invalid!(
            "room for {num_ranks} ranks (max_ranks) is less than the job's {founding}"
        )),
    }
}

/// What the ranks learn of each other first.
struct Met {
    topo: Topology,
    map: RegionMap,
    /// The config every rank was given, as text.
    fingerprint: String,
    /// Rank 0's token: names the job's segments.
    job: u64,
    /// Every rank is on one host (its nodes, if several, are emulated).
    one_host: bool,
}

/// Hosts (which ranks share memory) and a job id for the segment names (rank 0's
/// token) in one exchange, then the configs compared. Collective.
fn meet(cp: &dyn ControlPlane, cfg: &BufferConfig) -> Result<Met> {
    let rank = cp.rank();
    let num_ranks = cfg.max_ranks.unwrap_or(cp.world_size());
    let hello = (rand::random::<u64>(), uep_bootstrap::host_id());
    let hellos = exchange::all_gather(cp, "hello", &hello)?;
    let job = hellos[0].0;
    let hosts: Vec<String> = hellos.into_iter().map(|(_, host)| host).collect();
    let one_host = hosts.iter().all(|h| *h == hosts[0]);
    let topo = Topology::from_hosts(rank, &hosts, cfg.ranks_per_node)?;
    // Reserved ranks (past the founding ones) form nodes of the same size.
    let topo = Topology::new(rank, num_ranks, topo.ranks_per_node)?;
    let map = RegionMap::new(cfg, num_ranks, topo.num_nodes > 1);
    // Every rank must agree on the shapes: compare them first, so a mismatch is a
    // clear error rather than a size mismatch of segments.
    let fingerprint = cfg.fingerprint(map.total);
    let all = exchange::all_gather(cp, "config", &fingerprint)?;
    if let Some((peer, other)) = all.iter().enumerate().find(|(_, f)| **f != fingerprint) {
        return Err(invalid!(
            "rank {rank} and rank {peer} were given different Buffer configs: {fingerprint} vs {other}"
        ));
    }
    Ok(Met {
        topo,
        map,
        fingerprint,
        job,
        one_host,
    })
}

/// Make this rank's symmetric memory through `alloc`, map the node's by their handles,
/// and open the door (if any). Collective.
fn share_memory(
    cp: &dyn ControlPlane,
    (cfg, alloc): (&BufferConfig, &dyn SymmetricAlloc),
    met: &Met,
) -> Result<(Symmetric, Option<Door>)> {
    let (rank, num_ranks, map, topo) = (cp.rank(), met.topo.num_ranks, &met.map, &met.topo);
    let own = alloc.create(met.job, rank, map.total);
    // Everyone takes part in every exchange, failed or not, so nobody waits.
    let mine = own.as_ref().ok().map(|(_, handle)| handle.clone());
    let handles = exchange::all_gather(cp, "memory handle", &mine)?;
    let (own, handle) = own?;
    own.region()
        .word(map.control.pid, 0)?
        .store(std::process::id() as u64, Ordering::Release);
    if let Some(peer) = handles.iter().position(Option::is_none) {
        return Err(EpError::Resource(format!(
            "rank {peer} could not make its symmetric memory of {} bytes",
            map.total
        )));
    }
    let handles: Vec<MemHandle> = handles.into_iter().flatten().collect();
    let local: Vec<usize> = topo.node_ranks(topo.node).collect();
    let symm = Symmetric::map_peers(
        (rank, own),
        &handles,
        &local,
        map.total,
        (alloc, cfg.timeout),
    );
    let door = make_door(cfg, met);
    // Everyone has mapped everything (or failed) past this exchange; then the handles go.
    let ok = symm.is_ok() && door.as_ref().is_none_or(Result::is_ok);
    let verdicts = exchange::all_gather(cp, "mapped", &ok)?;
    let mut symm = symm?;
    let door = door.transpose()?;
    if let Some(peer) = verdicts.iter().position(|&mapped| !mapped) {
        return Err(EpError::Resource(format!(
            "rank {peer} could not map the symmetric memory of its node (or make its door)"
        )));
    }
    // With a door the handles stay open, for replacements to map (each goes with its
    // Buffer).
    let door = match (door, &cfg.door) {
        (Some(d), _) => Some(d),
        (None, Some(name)) => {
            let at = (name.as_str(), cfg.door_store.as_ref());
            Some(Door::open(at, num_ranks, cfg.timeout)?)
        }
        (None, None) => None,
    };
    match &door {
        Some(d) => d.set_member(rank, Process::me(), &handle)?,
        None => symm.unlink()?,
    }
    Ok((symm, door))
}

/// Rank 0 of an elastic job with a door makes it (`door`). A door in shared memory
/// needs every rank on one host (nodes, if several, emulated by ranks per node); one in
/// the job's store does not.
fn make_door(cfg: &BufferConfig, met: &Met) -> Option<Result<Door>> {
    let (name, topo) = (cfg.door.as_ref()?, met.topo);
    if !met.one_host && cfg.door_store.is_none() {
        return Some(Err(invalid!(
            "a door (for ranks that rejoin) without the job's store (BufferConfig::door_store) \
             is shared memory on one host, and this job's {} nodes are on several hosts",
            topo.num_nodes
        )));
    }
    let digest = join::config_digest(&met.fingerprint);
    let header = (digest, met.map.total, met.job, topo.ranks_per_node);
    let at = (name.as_str(), cfg.door_store.as_ref());
    (topo.rank == 0).then(|| Door::create(at, topo.num_ranks, cfg, header))
}
