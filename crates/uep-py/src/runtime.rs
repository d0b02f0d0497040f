//! `Runtime`: the Rust side of `uep.Buffer`.
//!
//! It owns one [`uep_ep::Buffer`] at a time, sized for the shapes the calls actually use
//! (never for the byte counts the caller passed, which are a capacity: DeepEP's tests
//! pass 2 GB). A Buffer is (re)built, collectively, when a call needs a shape it does
//! not have:
//!
//! * the first call of a mode, or one whose experts, hidden size or top-k (or, in
//!   low-latency mode, `num_max_dispatch_tokens_per_rank`) differ from the Buffer's:
//!   every rank sees the same arguments, so every rank decides the same; the ranks
//!   then exchange what each needs over the control plane (a rank whose input was bad
//!   says so there, and every rank raises);
//! * a normal dispatch with more tokens than the Buffer holds on some rank: every rank
//!   learns it in the dispatch's notify step and gets [`EpError::Capacity`] at the same
//!   point, before any row moved; all of them rebuild with room for the most tokens
//!   (rounded up to a power of two) and run the dispatch again.
//!
//! A rebuild that would exceed the capacity raises an error naming the bytes needed
//! and the argument to raise. Handles of an earlier Buffer are refused with a clear
//! message.

use std::sync::{Arc, Mutex, MutexGuard, TryLockError};
use std::time::Duration;

use half::bf16;
use pyo3::prelude::*;
use pyo3::types::{PyCapsule, PyTuple};
use uep_bootstrap::Group;
use uep_ep::quant::Nvfp4;
use uep_ep::{
    Buffer, BufferConfig, Cast, CombineArgs, DispatchArgs, DispatchLayout, EpError, ErrorKind,
    FirstCall, JobStore, Lease, LlCombineInput, LlCombinePending, LlDispatchArgs, LlHandle,
    LlPending, NormalHandle, Shape, TokenFormat, Tokens, Topology, WeightLanes,
};

use crate::control::{PyControlPlane, PyStore};
use crate::dlpack::{export_block, export_lease, export_vec, peek_shape, DType, In, Pool};
use crate::errors;
use uep_ep::exchange::{self, Record};

/// Fewest tokens a normal-mode Buffer is sized for (growth doubles from here).
const MIN_TOKENS: usize = 64;
/// What uep may use beyond the caller's capacity for its fixed areas (DeepEP, too,
/// allocates a fixed workspace beside the buffers it is given).
const SLACK_BYTES: usize = 32 << 20;

fn ep_err(e: EpError) -> PyErr {
    errors::ep_err(e)
}

/// What one call needs of the Buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Want {
    Normal(Shape),
    Ll(Shape),
}

/// What a rank brings to a rebuild: the call it wants served, or why it rejected its
/// input (so that every rank fails together, naming it).
#[derive(Clone, Debug)]
enum Rebuild {
    Want(Want),
    Rejected(String),
}

impl Record for Rebuild {
    fn put(&self, out: &mut Vec<u8>) {
        // 0: normal, 1: low-latency, 2: rejected.
        match self {
            Rebuild::Want(Want::Normal(s)) => (0u64, *s).put(out),
            Rebuild::Want(Want::Ll(s)) => (1u64, *s).put(out),
            Rebuild::Rejected(msg) => (2u64, msg.clone()).put(out),
        }
    }

    fn take(bytes: &mut &[u8]) -> Option<Rebuild> {
        match u64::take(bytes)? {
            0 => Some(Rebuild::Want(Want::Normal(Shape::take(bytes)?))),
            1 => Some(Rebuild::Want(Want::Ll(Shape::take(bytes)?))),
            2 => Some(Rebuild::Rejected(String::take(bytes)?)),
            _ => None,
        }
    }
}

impl Want {
    /// Whether the Buffer's config serves this call (normal-mode token counts are
    /// checked by the dispatch itself, on every rank at once).
    fn served_by(self, cfg: &BufferConfig) -> bool {
        let same = |have: Option<Shape>, s: Shape, tokens: bool| {
            have.is_some_and(|h| {
                h.num_experts == s.num_experts
                    && h.hidden == s.hidden
                    && h.topk == s.topk
                    && (!tokens || h.max_tokens == s.max_tokens)
            })
        };
        match self {
            Want::Normal(s) => same(cfg.normal, s, false),
            Want::Ll(s) => same(cfg.ll, s, true),
        }
    }
}

/// The call a rebuild serves, for messages.
fn describe(want: &Result<Want, String>) -> String {
    let shape = |s: &Shape| {
        format!(
            "{} experts, hidden {}, top-{}",
            s.num_experts, s.hidden, s.topk
        )
    };
    match want {
        Ok(Want::Normal(s)) => format!("a normal-mode call ({})", shape(s)),
        Ok(Want::Ll(s)) => format!("a low-latency call ({})", shape(s)),
        Err(_) => "a call this rank rejected".into(),
    }
}

struct State {
    buffer: Option<Buffer>,
    /// Memory of combine outputs, reused once Python lets go of them.
    outputs: Pool,
    /// Counts Buffers built; handles remember theirs.
    generation: u64,
    destroyed: bool,
}

/// The Rust side of one `uep.Buffer`.
#[pyclass(module = "uep._uep", frozen)]
pub struct Runtime {
    /// uep's own control plane, formed through the caller's group once (see `new`);
    /// none for a rank that rejoined a running job (`join`).
    cp: Option<Arc<Group>>,
    topo: Topology,
    /// Bytes the caller allows (`num_nvl_bytes + num_rdma_bytes`).
    capacity: usize,
    timeout: Mutex<Duration>,
    threads: usize,
    emulate: Option<usize>,
    /// Elastic low-latency mode (`enable_shrink`).
    elastic: bool,
    /// Elastic mode: the job's door, where replacements find it, and the store that
    /// keeps it (the launcher's; without one, shared memory on one host).
    door: Option<String>,
    door_store: Option<JobStore>,
    /// Room for this many ranks (`max_group_size`): the group's, and reserved ones.
    max_ranks: Option<usize>,
    state: Mutex<State>,
}

/// A normal dispatch's handle, as the Python layer keeps it.
#[pyclass(module = "uep._uep", frozen)]
pub struct NormalHandlePy {
    inner: NormalHandle,
    generation: u64,
    num_experts: usize,
}

/// A low-latency dispatch's handle.
#[pyclass(module = "uep._uep", frozen)]
pub struct LlHandlePy {
    inner: LlHandle,
    generation: u64,
}

/// A low-latency dispatch whose receive has not run (the hook's state).
#[pyclass(module = "uep._uep", frozen)]
pub struct LlPendingPy {
    inner: Mutex<Option<LlPending>>,
    buffer: usize,
    format: TokenFormat,
    generation: u64,
}

/// A low-latency combine whose receive has not run.
#[pyclass(module = "uep._uep", frozen)]
pub struct LlCombinePendingPy {
    inner: Mutex<Option<LlCombinePending>>,
    generation: u64,
}

impl Runtime {
    /// The state, locked without holding the GIL while waiting for another thread.
    fn lock(&self, py: Python<'_>) -> MutexGuard<'_, State> {
        loop {
            match self.state.try_lock() {
                Ok(g) => return g,
                Err(TryLockError::Poisoned(p)) => return p.into_inner(),
                Err(TryLockError::WouldBlock) => {
                    py.detach(|| std::thread::sleep(Duration::from_micros(20)))
                }
            }
        }
    }

    fn config_for(&self, base: Option<&BufferConfig>, want: Want) -> BufferConfig {
        let mut cfg = base.cloned().unwrap_or_else(|| {
            let mut c = BufferConfig::new(1, 8, 1, 0, 0);
            c.normal = None;
            c.ll = None;
            c
        });
        match want {
            Want::Normal(s) => cfg.normal = Some(s),
            Want::Ll(s) => cfg.ll = Some(s),
        }
        cfg.timeout = *self.timeout.lock().unwrap_or_else(|e| e.into_inner());
        cfg.device_threads = self.threads;
        cfg.ranks_per_node = self.emulate;
        cfg.elastic = self.elastic;
        cfg.door = self.door.clone();
        cfg.door_store = self.door_store.clone();
        cfg.max_ranks = self.max_ranks;
        cfg
    }

    /// The control plane; a rank that rejoined a running job has none.
    fn group(&self) -> PyResult<&Arc<Group>> {
        self.cp.as_ref().ok_or_else(|| {
            errors::invalid(
                "this rank rejoined a running job: its Buffer was sized by the job, and it \
                 has no control plane to build another (size the Buffer before serving: \
                 the first call of each mode)",
            )
        })
    }

    /// (Re)build the Buffer for `want` (or fail every rank with this rank's `bad`
    /// input). Collective: every rank calls it at the same point.
    fn rebuild(&self, _py: Python<'_>, st: &mut State, want: Result<Want, String>) -> PyResult<()> {
        let merged = self.agree_on_want(&want)?;
        let base = st.buffer.as_ref().map(|b| b.config().clone());
        let cfg = self.sized_config(base.as_ref(), merged)?;
        // The old Buffer goes first: outputs still held keep their own mappings.
        st.buffer = None;
        let buffer = Buffer::with_control_plane(self.group()?.clone(), cfg).map_err(ep_err)?;
        st.buffer = Some(buffer);
        st.generation += 1;
        Ok(())
    }

    /// Every rank's want (or rejection), exchanged: the one shape all of them need
    /// (normal calls agree up to their token counts, whose largest it takes); an error
    /// on every rank if one rejected its input or they make different calls.
    fn agree_on_want(&self, want: &Result<Want, String>) -> PyResult<Want> {
        let me = self.topo.rank;
        let record = match want {
            Ok(w) => Rebuild::Want(*w),
            Err(msg) => Rebuild::Rejected(msg.clone()),
        };
        let all =
            exchange::all_gather(self.group()?.as_ref(), "rebuild", &record).map_err(|e| {
                let why = format!(
                    "rank {me}: {}: not every rank came to build the Buffer for it: {e}",
                    describe(want)
                );
                errors::raise(e.kind(), why)
            })?;
        let mut wants = Vec::with_capacity(all.len());
        for (r, t) in all.into_iter().enumerate() {
            match t {
                Rebuild::Want(w) => wants.push(w),
                Rebuild::Rejected(msg) if r == me => return Err(errors::invalid(msg)),
                Rebuild::Rejected(msg) => {
                    return Err(errors::raise(
                        ErrorKind::PeerAborted,
                        format!("peer failure: rank {me}: rank {r} rejected its input: {msg}"),
                    ))
                }
            }
        }
        let mut merged = wants[0];
        for (r, w) in wants.iter().enumerate() {
            let agree = match (merged, *w) {
                (Want::Normal(a), Want::Normal(b)) => {
                    a.num_experts == b.num_experts && a.hidden == b.hidden && a.topk == b.topk
                }
                (Want::Ll(a), Want::Ll(b)) => a == b,
                _ => false,
            };
            if !agree {
                return Err(errors::invalid(format!(
                    "ranks make different calls: rank 0 asks for {:?}, rank {r} for {w:?}",
                    wants[0]
                )));
            }
            if let (Want::Normal(a), Want::Normal(b)) = (&mut merged, w) {
                a.max_tokens = a.max_tokens.max(b.max_tokens);
            }
        }
        Ok(merged)
    }

    /// The configuration for `want` on top of `base`, normal mode with room to grow
    /// where the capacity allows; a capacity error naming the argument to raise where
    /// even the exact shape does not fit.
    fn sized_config(&self, base: Option<&BufferConfig>, want: Want) -> PyResult<BufferConfig> {
        let (r_n, nodes) = (self.topo.num_ranks, self.topo.num_nodes);
        let mut cfg = self.config_for(base, want);
        if let Want::Normal(s) = want {
            // Room to grow into, unless only the exact count fits the capacity.
            let exact = s.max_tokens.max(1);
            let mut grown = cfg.clone();
            if let Some(n) = grown.normal.as_mut() {
                n.max_tokens = exact.max(MIN_TOKENS).next_power_of_two();
            }
            if let Some(n) = cfg.normal.as_mut() {
                n.max_tokens = exact;
            }
            if grown.bytes_needed(r_n, nodes) <= self.capacity + SLACK_BYTES {
                cfg = grown;
            }
        }
        let needed = cfg.bytes_needed(r_n, nodes);
        if needed <= self.capacity + SLACK_BYTES {
            return Ok(cfg);
        }
        let (what, knob) = match want {
            Want::Normal(s) => (
                format!(
                    "normal dispatch of up to {} tokens a rank (hidden {}, top-k {}, {} experts)",
                    s.max_tokens, s.hidden, s.topk, s.num_experts
                ),
                "num_nvl_bytes",
            ),
            Want::Ll(s) => (
                format!(
                    "low-latency dispatch (num_max_dispatch_tokens_per_rank {}, hidden {}, top-k {}, {} experts)",
                    s.max_tokens, s.hidden, s.topk, s.num_experts
                ),
                "num_rdma_bytes",
            ),
        };
        Err(errors::raise(
            ErrorKind::Capacity,
            format!(
                "capacity: a {what} needs {needed} bytes of registered memory per rank \
                 (both modes' buffers), more than num_nvl_bytes + num_rdma_bytes = {} allows \
                 ({} with uep's fixed areas); raise {knob} to at least {}",
                self.capacity,
                self.capacity + SLACK_BYTES,
                needed.saturating_sub(SLACK_BYTES)
            ),
        ))
    }

    /// Make sure the Buffer serves a call of `mode` with shape `want` (as far as known),
    /// or, when this rank's input is `bad`, fail the call on every rank the way it meets
    /// them: through the Buffer when it serves the call, else in the exchange that sets
    /// one up (the other ranks, with the same shape, make the same decision).
    fn ensure(
        &self,
        py: Python<'_>,
        st: &mut State,
        normal: bool,
        want: Option<Want>,
        bad: Option<String>,
    ) -> PyResult<()> {
        if st.destroyed {
            return Err(errors::invalid("this Buffer was destroyed"));
        }
        let served = match (&st.buffer, want) {
            (Some(b), Some(w)) => w.served_by(b.config()),
            (Some(b), None) => {
                (normal && b.config().normal.is_some()) || (!normal && b.config().ll.is_some())
            }
            (None, _) => false,
        };
        match (served, bad, want) {
            (true, None, _) => Ok(()),
            (true, Some(msg), _) => Err(self.reject(py, st, &msg)),
            (false, Some(msg), _) => self.rebuild(py, st, Err(msg)),
            (false, None, Some(w)) => self.rebuild(py, st, Ok(w)),
            (false, None, None) => Err(errors::internal("a call without a shape")),
        }
    }

    /// Fail this call: tell the other ranks (their waits end at once) and raise.
    fn reject(&self, _py: Python<'_>, st: &mut State, msg: &str) -> PyErr {
        match st.buffer.as_mut() {
            Some(b) => ep_err(b.abort(&format!("rank {}: {msg}", self.topo.rank))),
            None => errors::invalid(msg),
        }
    }

    fn buffer<'s>(st: &'s mut MutexGuard<'_, State>) -> PyResult<&'s mut Buffer> {
        st.buffer
            .as_mut()
            .ok_or_else(|| errors::invalid("this Buffer has not been set up"))
    }

    /// Runs a normal dispatch of `args`; a call past the Buffer's capacity grows the
    /// Buffer to the tokens it needs (collectively: every rank sees the same error)
    /// and runs once more. The handle and the tokens each local expert received.
    fn dispatch_growing(
        &self,
        py: Python<'_>,
        st: &mut MutexGuard<'_, State>,
        args: DispatchArgs<'_>,
    ) -> PyResult<(NormalHandle, Vec<usize>)> {
        let mut retried = false;
        loop {
            let buffer = Self::buffer(st)?;
            let r = py.detach(|| {
                buffer
                    .dispatch(args)
                    .map(|o| (o.handle, o.num_recv_tokens_per_expert))
            });
            match r {
                Ok(v) => return Ok(v),
                Err(EpError::Capacity { tokens, .. }) if !retried => {
                    retried = true;
                    let shape = buffer.config().normal.expect("a normal shape");
                    let want = Want::Normal(Shape {
                        max_tokens: tokens,
                        ..shape
                    });
                    self.rebuild(py, st, Ok(want))?;
                }
                Err(e) => return Err(ep_err(e)),
            }
        }
    }

    /// Refuses a handle made before the Buffer was rebuilt, telling the other ranks
    /// (as any rejected input: their waits end at once).
    fn check_generation(
        &self,
        py: Python<'_>,
        st: &mut State,
        generation: u64,
        what: &str,
    ) -> PyResult<()> {
        if generation != st.generation {
            let msg = format!("the {what} comes from before the Buffer was rebuilt for larger or other shapes; dispatch again");
            return Err(self.reject(py, st, &msg));
        }
        Ok(())
    }
}

/// An optional tensor argument.
type Arg<'a, 'py> = Option<&'a Bound<'py, PyAny>>;

/// `num_tokens_per_rank`, `num_tokens_per_expert`, `is_token_in_rank`.
type LayoutArgs<'a, 'py> = (Arg<'a, 'py>, Arg<'a, 'py>, Arg<'a, 'py>);

/// The parts of a normal dispatch the Python layer passed.
struct NormalIn<'py> {
    x: In<'py>,
    scales: Option<In<'py>>,
    topk_idx: Option<In<'py>>,
    topk_weights: Option<In<'py>>,
    layout: Option<DispatchLayout>,
    hidden: usize,
}

impl<'py> NormalIn<'py> {
    /// The tensors of a normal dispatch, checked: `x` (FP8 codes when there are
    /// scales) with its scales, ids and weights, and the layout triple (all or none).
    fn parse(
        t: Topology,
        (x, x_scales, topk_idx, topk_weights): (
            &Bound<'py, PyAny>,
            Arg<'_, 'py>,
            Arg<'_, 'py>,
            Arg<'_, 'py>,
        ),
        layout: LayoutArgs<'_, 'py>,
    ) -> PyResult<NormalIn<'py>> {
        let fp8 = x_scales.is_some();
        let x = In::new(x, "x", if fp8 { DType::U8 } else { DType::BF16 })?;
        x.expect_ndim(2)?;
        let (tokens, hidden) = (x.dim(0)?, x.dim(1)?);
        Ok(NormalIn {
            scales: In::opt(x_scales, "x scales", DType::F32)?,
            topk_idx: In::opt(topk_idx, "topk_idx", DType::I64)?,
            topk_weights: In::opt(topk_weights, "topk_weights", DType::F32)?,
            layout: parse_layout(t, tokens, layout)?,
            x,
            hidden,
        })
    }

    /// The rows to send.
    fn tokens(&self) -> Tokens<'_> {
        match &self.scales {
            Some(s) => Tokens::Fp8 {
                data: self.x.slice::<u8>(),
                scales: s.slice::<f32>(),
            },
            None => Tokens::Bf16(self.x.slice::<bf16>()),
        }
    }
}

/// The layout DeepEP's caller passes (`num_tokens_per_rank`, `num_tokens_per_expert`,
/// `is_token_in_rank`: all three or none), as uep's type.
fn parse_layout(
    t: Topology,
    tokens: usize,
    layout: LayoutArgs<'_, '_>,
) -> PyResult<Option<DispatchLayout>> {
    let (pr, pe, ir) = match layout {
        (Some(pr), Some(pe), Some(ir)) => (pr, pe, ir),
        (None, None, None) => return Ok(None),
        _ => {
            return Err(errors::raise(
                ErrorKind::InvalidArgument,
                "num_tokens_per_rank, num_tokens_per_expert and is_token_in_rank go together"
                    .into(),
            ))
        }
    };
    let pr = In::new(pr, "num_tokens_per_rank", DType::I32)?;
    let pe = In::new(pe, "num_tokens_per_expert", DType::I32)?;
    let ir = In::new(ir, "is_token_in_rank", DType::BOOL)?;
    ir.expect_ndim(2)?;
    if ir.shape() != [tokens, t.num_ranks] || pr.shape() != [t.num_ranks] {
        return Err(errors::raise(
            ErrorKind::InvalidArgument,
            format!(
                "is_token_in_rank has shape {:?} and num_tokens_per_rank {:?}; expected [{tokens}, {r}] and [{r}]",
                ir.shape(),
                pr.shape(),
                r = t.num_ranks
            ),
        ));
    }
    let in_rank: Vec<bool> = ir.slice::<u8>().iter().map(|&b| b != 0).collect();
    let per_node = (0..t.num_nodes)
        .map(|m| {
            (in_rank.chunks(t.num_ranks))
                .filter(|row| row[t.node_ranks(m)].contains(&true))
                .count() as i32
        })
        .collect();
    Ok(Some(DispatchLayout {
        num_tokens: tokens,
        num_ranks: t.num_ranks,
        num_experts: pe.shape().first().copied().unwrap_or(0),
        num_tokens_per_rank: pr.slice::<i32>().to_vec(),
        num_tokens_per_rdma_rank: per_node,
        num_tokens_per_expert: pe.slice::<i32>().to_vec(),
        is_token_in_rank: in_rank,
    }))
}

/// The normal shape a dispatch needs, from its arguments' shapes (usable or not), and
/// its expert count: experts from the layout, the handle or the Buffer's; top-k from
/// the ids, the handle, the Buffer's, or 1.
fn normal_want(
    x: &Bound<'_, PyAny>,
    topk_idx: Option<&Bound<'_, PyAny>>,
    num_tokens_per_expert: Option<&Bound<'_, PyAny>>,
    handle: Option<&NormalHandlePy>,
    have: Option<Shape>,
) -> (Option<Want>, Option<usize>) {
    let dim = |o: Option<&Bound<'_, PyAny>>, i: usize| {
        o.and_then(peek_shape).and_then(|s| s.get(i).copied())
    };
    let topk = dim(topk_idx, 1)
        .or(handle.map(|h| h.inner.topk))
        .or(have.map(|s| s.topk))
        .unwrap_or(1);
    let experts = dim(num_tokens_per_expert, 0)
        .or(handle.map(|h| h.num_experts))
        .or(have.map(|s| s.num_experts));
    let want = match (experts, dim(Some(x), 0), dim(Some(x), 1)) {
        (Some(num_experts), Some(tokens), Some(hidden)) => Some(Want::Normal(Shape {
            num_experts,
            hidden,
            topk,
            max_tokens: tokens,
        })),
        _ => None,
    };
    (want, experts)
}

/// `recv_x`, its scales, the received ids and weights, as capsules.
type DispatchCapsules<'py> = (
    Bound<'py, PyCapsule>,
    Option<Bound<'py, PyCapsule>>,
    Option<Bound<'py, PyCapsule>>,
    Option<Bound<'py, PyCapsule>>,
);

/// A dispatch's outputs as DLPack capsules over its lease: `recv_x`, its scales
/// (FP8), the received ids and weights (where the call carried them).
fn export_dispatch<'py>(
    py: Python<'py>,
    lease: &Lease,
    out: &NormalHandle,
    h: usize,
) -> PyResult<DispatchCapsules<'py>> {
    let (rows, k) = (out.num_rows, out.topk);
    let part =
        |i: usize, shape: &[usize], dtype: DType| export_lease(py, lease, i, shape, None, dtype);
    let recv_x = part(0, &[rows, h], if out.fp8 { DType::U8 } else { DType::BF16 })?;
    let scales = (out.fp8)
        .then(|| part(1, &[rows, h / 128], DType::F32))
        .transpose()?;
    let idx = (!lease.parts[2].is_empty() || (out.carries_topk() && rows == 0))
        .then(|| part(2, &[rows, k], DType::I64))
        .transpose()?;
    let w = (!lease.parts[3].is_empty() || (out.carries_weights() && rows == 0))
        .then(|| part(3, &[rows, k], DType::F32))
        .transpose()?;
    Ok((recv_x, scales, idx, w))
}

/// Kernel threads a rank: `requested`, or by default (0) its share of the host's cores
/// among the `per_node` ranks of its node; at least one.
fn kernel_threads(requested: usize, per_node: usize) -> usize {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    match requested {
        0 => cores / per_node.max(1),
        n => n,
    }
    .max(1)
}

/// The name of the door of the job whose rendezvous is `rendezvous` (`uep_ep::door_name`).
#[pyfunction]
pub fn door_name(rendezvous: &str) -> String {
    uep_ep::door_name(rendezvous)
}

/// The libfabric settings uep prefers (`uep_transport::ENV_DEFAULTS`), as (name, value)
/// pairs: the package sets those the environment leaves unset, at import.
#[pyfunction]
pub fn fabric_env_defaults() -> Vec<(&'static str, &'static str)> {
    uep_transport::ENV_DEFAULTS.to_vec()
}

#[pymethods]
impl Runtime {
    /// A runtime for rank `rank` of `world_size`, exchanging through `all_gather`
    /// (collective: it finds which ranks share a host).
    #[new]
    #[pyo3(signature = (rank, world_size, all_gather, capacity, timeout_s, device_threads, ranks_per_node=None, elastic=false, door=None, store=None, max_ranks=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        rank: usize,
        world_size: usize,
        all_gather: Py<PyAny>,
        capacity: usize,
        timeout_s: f64,
        device_threads: usize,
        ranks_per_node: Option<usize>,
        elastic: bool,
        door: Option<String>,
        store: Option<Py<PyAny>>,
        max_ranks: Option<usize>,
    ) -> PyResult<Runtime> {
        if rank >= world_size {
            return Err(errors::invalid(format!(
                "rank {rank} of a group of {world_size}"
            )));
        }
        if max_ranks.is_some_and(|m| m < world_size || door.is_none() || !elastic) {
            return Err(errors::invalid(format!(
                "max_group_size = {max_ranks:?} needs enable_shrink, the launcher's rendezvous \
                 (MASTER_ADDR, MASTER_PORT) and at least the group's {world_size} ranks"
            )));
        }
        if !(timeout_s > 0.0 && timeout_s.is_finite()) {
            return Err(errors::invalid(format!(
                "timeout {timeout_s} s must be positive"
            )));
        }
        // The caller's group carries one exchange, here: the invitation to a group of
        // uep's own, through which every later exchange goes under uep's deadline, so no
        // collective of uep's can pair with one of the caller's whatever a rank does.
        let caller = PyControlPlane::new(rank, world_size, all_gather);
        let timeout = Duration::from_secs_f64(timeout_s);
        let cp = py
            .detach(|| Group::form_over(&caller, timeout))
            .map_err(|e| ep_err(e.into()))?;
        let cp = Arc::new(cp);
        let topo = Topology::discover(cp.as_ref(), ranks_per_node).map_err(ep_err)?;
        let device_threads = kernel_threads(device_threads, topo.ranks_per_node);
        let door_store = store.map(|s| JobStore(Arc::new(PyStore::new(s))));
        // Without the launcher's store a door is shared memory: replacements find the
        // job through it only when every rank is on one host.
        let one_host = topo.num_nodes == 1 || ranks_per_node.is_some();
        let door = door.filter(|_| elastic && (door_store.is_some() || one_host));
        // Reserved ranks form nodes of the group's size.
        let topo = match max_ranks {
            Some(m) => Topology::new(rank, m, topo.ranks_per_node).map_err(ep_err)?,
            None => topo,
        };
        Ok(Runtime {
            cp: Some(cp),
            topo,
            capacity,
            timeout: Mutex::new(Duration::from_secs_f64(timeout_s)),
            threads: device_threads,
            emulate: ranks_per_node,
            elastic,
            door,
            door_store,
            max_ranks,
            state: Mutex::new(State {
                buffer: None,
                outputs: Pool::default(),
                generation: 0,
                destroyed: false,
            }),
        })
    }

    /// Take the place of masked rank `rank` of the running elastic job of
    /// `world_size` ranks at door `door` (in `store`, the launcher's; else on this
    /// host), as a process started to replace it: its Buffer as the job sized it. Returns the runtime, the survivors' step
    /// (`set_step`) and the call it makes first (`"barrier"`, `"dispatch"` or
    /// `"low_latency_dispatch"`).
    #[staticmethod]
    fn join(
        py: Python<'_>,
        rank: usize,
        world_size: usize,
        door: String,
        store: Option<Py<PyAny>>,
        timeout_s: f64,
        device_threads: usize,
    ) -> PyResult<(Runtime, u64, &'static str)> {
        let timeout = Duration::from_secs_f64(timeout_s);
        let store = store.map(|s| JobStore(Arc::new(PyStore::new(s))));
        let (buffer, at) = py
            .detach(|| {
                let mut cfg = BufferConfig::from_door(&door, store, world_size, timeout)?;
                let per_node = cfg.ranks_per_node.unwrap_or(world_size);
                cfg.device_threads = kernel_threads(device_threads, per_node);
                // A joiner lets in whoever the others let in (recover_ranks is the
                // founding ranks' call): a rank comes in only once every live rank
                // proposes it, so this never admits one they did not, and the next
                // joiner of its node is not held out by it.
                cfg.auto_admit = true;
                Buffer::join(cfg, rank, world_size)
            })
            .map_err(ep_err)?;
        let first = match at.first {
            FirstCall::Barrier => "barrier",
            FirstCall::Dispatch => "dispatch",
            FirstCall::LowLatencyDispatch => "low_latency_dispatch",
        };
        let cfg = buffer.config().clone();
        let runtime = Runtime {
            cp: None,
            topo: buffer.topology(),
            capacity: usize::MAX,
            timeout: Mutex::new(timeout),
            threads: cfg.device_threads,
            emulate: cfg.ranks_per_node,
            elastic: true,
            door: cfg.door.clone(),
            door_store: cfg.door_store.clone(),
            max_ranks: cfg.max_ranks,
            state: Mutex::new(State {
                buffer: Some(buffer),
                outputs: Pool::default(),
                generation: 1,
                destroyed: false,
            }),
        };
        Ok((runtime, at.step, first))
    }

    /// Let a replacement of masked rank `rank` in once it asks (elastic mode with a
    /// door; Mooncake's `recover_ranks`).
    fn admit(&self, py: Python<'_>, rank: usize) -> PyResult<()> {
        let mut st = self.lock(py);
        Self::buffer(&mut st)?.admit(rank).map_err(ep_err)
    }

    /// The caller's step, told to a replacement let in at the next dispatch.
    fn set_step(&self, py: Python<'_>, step: u64) {
        if let Some(b) = self.lock(py).buffer.as_mut() {
            b.set_step(step);
        }
    }

    /// `(rank, num_ranks, ranks_per_node, num_nodes)`.
    fn topology(&self) -> (usize, usize, usize, usize) {
        let t = self.topo;
        (t.rank, t.num_ranks, t.ranks_per_node, t.num_nodes)
    }

    /// Bytes of registered memory the current Buffer holds (0 before the first call).
    fn bytes(&self, py: Python<'_>) -> usize {
        self.lock(py).buffer.as_ref().map_or(0, Buffer::bytes)
    }

    /// Set the deadline of every wait, in seconds.
    fn set_timeout(&self, py: Python<'_>, seconds: f64) -> PyResult<()> {
        if !(seconds > 0.0 && seconds.is_finite()) {
            return Err(errors::invalid(format!(
                "timeout {seconds} s must be positive"
            )));
        }
        let d = Duration::from_secs_f64(seconds);
        *self.timeout.lock().unwrap_or_else(|e| e.into_inner()) = d;
        if let Some(cp) = &self.cp {
            cp.set_timeout(d);
        }
        if let Some(b) = self.lock(py).buffer.as_mut() {
            b.set_timeout(d);
        }
        Ok(())
    }

    /// `get_dispatch_layout`: `(per_rank [R] i32, per_node [nodes] i32 or None on one
    /// node, per_expert [E] i32, is_token_in_rank [N, R] bool)`.
    fn layout<'py>(
        &self,
        py: Python<'py>,
        topk_idx: &Bound<'py, PyAny>,
        num_experts: usize,
    ) -> PyResult<Bound<'py, PyTuple>> {
        let idx = In::new(topk_idx, "topk_idx", DType::I64)?;
        idx.expect_ndim(2)?;
        let (n, k) = (idx.dim(0)?, idx.dim(1)?);
        let t = self.topo;
        let values = idx.slice::<i64>();
        let l = py
            .detach(|| {
                uep_ep::get_dispatch_layout(values, k, num_experts, t.num_ranks, t.ranks_per_node)
            })
            .map_err(ep_err)?;
        let per_node = (t.num_nodes > 1)
            .then(|| export_vec(py, l.num_tokens_per_rdma_rank, &[t.num_nodes], DType::I32))
            .transpose()?;
        let in_rank: Vec<u8> = l.is_token_in_rank.iter().map(|&b| b as u8).collect();
        (
            export_vec(py, l.num_tokens_per_rank, &[t.num_ranks], DType::I32)?,
            per_node,
            export_vec(py, l.num_tokens_per_expert, &[num_experts], DType::I32)?,
            export_vec(py, in_rank, &[n, t.num_ranks], DType::BOOL)?,
        )
            .into_pyobject(py)
    }

    /// Normal dispatch; see `uep.Buffer.dispatch`. Returns `(recv_x, recv_x_scales,
    /// recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert, handle)`, the
    /// tensors as DLPack capsules (absent ones `None`).
    /// `all_weight_lanes` hands every rank each token's whole weight row (DeepEP v2's).
    #[pyo3(signature = (x, x_scales, topk_idx, topk_weights, num_tokens_per_rank, num_tokens_per_expert, is_token_in_rank, handle, expert_alignment, num_worst_tokens, all_weight_lanes=false))]
    #[allow(clippy::too_many_arguments)]
    fn dispatch<'py>(
        &self,
        py: Python<'py>,
        x: &Bound<'py, PyAny>,
        x_scales: Option<&Bound<'py, PyAny>>,
        topk_idx: Option<&Bound<'py, PyAny>>,
        topk_weights: Option<&Bound<'py, PyAny>>,
        num_tokens_per_rank: Option<&Bound<'py, PyAny>>,
        num_tokens_per_expert: Option<&Bound<'py, PyAny>>,
        is_token_in_rank: Option<&Bound<'py, PyAny>>,
        handle: Option<PyRef<'py, NormalHandlePy>>,
        expert_alignment: usize,
        num_worst_tokens: usize,
        all_weight_lanes: bool,
    ) -> PyResult<Bound<'py, PyTuple>> {
        let parsed = NormalIn::parse(
            self.topo,
            (x, x_scales, topk_idx, topk_weights),
            (num_tokens_per_rank, num_tokens_per_expert, is_token_in_rank),
        );
        let mut st = self.lock(py);
        // The shape this call needs, read from the arguments' shapes even when they are
        // unusable (so that this rank decides as its peers do).
        let have = st.buffer.as_ref().and_then(|b| b.config().normal);
        let (mut want, experts) =
            normal_want(x, topk_idx, num_tokens_per_expert, handle.as_deref(), have);
        // Outputs padded to `num_worst_tokens` rows need room for as many.
        if let Some(Want::Normal(shape)) = &mut want {
            let worst = num_worst_tokens.div_ceil(self.topo.num_ranks);
            shape.max_tokens = shape.max_tokens.max(worst);
        }
        let bad = match &parsed {
            Err(e) => Some(e.to_string()),
            Ok(_) if experts.is_none() => Some(
                "dispatch needs num_tokens_per_expert (from get_dispatch_layout) or a handle"
                    .into(),
            ),
            Ok(_) => None,
        };
        self.ensure(py, &mut st, true, want, bad)?;
        let p = parsed?;
        if let Some(h) = &handle {
            self.check_generation(py, &mut st, h.generation, "handle")?;
        }
        let num_experts = st
            .buffer
            .as_ref()
            .and_then(|b| b.config().normal)
            .map_or(0, |s| s.num_experts);
        let lanes = match all_weight_lanes {
            true => WeightLanes::All,
            false => WeightLanes::Local,
        };
        let args = dispatch_args(&p, handle.as_deref(), lanes)
            .expert_alignment(expert_alignment)
            .num_worst_tokens(num_worst_tokens);
        let (out, counts) = self.dispatch_growing(py, &mut st, args)?;
        let generation = st.generation;
        let buffer = Self::buffer(&mut st)?;
        let lease = buffer.lease_dispatch(&out).map_err(ep_err)?;
        let (recv_x, scales, idx, w) = export_dispatch(py, &lease, &out, p.hidden)?;
        let handle = Py::new(
            py,
            NormalHandlePy {
                inner: out,
                generation,
                num_experts,
            },
        )?;
        (recv_x, scales, idx, w, counts, handle).into_pyobject(py)
    }

    /// Normal combine: `(combined_x [T, H] bf16, combined_topk_weights [T, K] f32 or
    /// None)`, as DLPack capsules.
    #[pyo3(signature = (x, handle, topk_weights, bias0, bias1))]
    fn combine<'py>(
        &self,
        py: Python<'py>,
        x: &Bound<'py, PyAny>,
        handle: PyRef<'py, NormalHandlePy>,
        topk_weights: Option<&Bound<'py, PyAny>>,
        bias0: Option<&Bound<'py, PyAny>>,
        bias1: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyTuple>> {
        let mut st = self.lock(py);
        let parsed = (|| -> PyResult<_> {
            Ok((
                In::new(x, "x", DType::BF16)?,
                In::opt(topk_weights, "topk_weights", DType::F32)?,
                In::opt(bias0, "bias[0]", DType::BF16)?,
                In::opt(bias1, "bias[1]", DType::BF16)?,
            ))
        })();
        if st.destroyed {
            return Err(errors::invalid("this Buffer was destroyed"));
        }
        self.check_generation(py, &mut st, handle.generation, "handle")?;
        let (x, w, b0, b1) = parsed.map_err(|e| self.reject(py, &mut st, &e.to_string()))?;
        let hidden = x.shape().get(1).copied().unwrap_or(0);
        let (t, k) = (handle.inner.num_tokens, handle.inner.topk);
        let args = CombineArgs {
            topk_weights: w.as_ref().map(|w| w.slice::<f32>()),
            bias: [
                b0.as_ref().map(|b| b.slice::<bf16>()),
                b1.as_ref().map(|b| b.slice::<bf16>()),
            ],
        };
        let (x, handle) = (x.slice::<bf16>(), &handle.inner);
        let state = &mut *st;
        let buffer = state
            .buffer
            .as_mut()
            .ok_or_else(|| errors::invalid("this Buffer has not been set up"))?;
        let mut out_w = w.as_ref().map(|_| vec![0f32; t * k]);
        let (block, done) = state.outputs.fill(t * hidden * 2, |block| {
            let out_x = block.as_mut_slice::<bf16>(t * hidden);
            py.detach(|| buffer.combine_into(x, args, handle, out_x, out_w.as_deref_mut()))
        });
        done.map_err(ep_err)?;
        let combined = export_block(py, block, &[t, hidden], DType::BF16)?;
        let weights = out_w
            .map(|v| export_vec(py, v, &[t, k], DType::F32))
            .transpose()?;
        (combined, weights).into_pyobject(py)
    }

    /// Rows gathered into memory that is reused once Python lets go of it (so a large
    /// output costs no page faults): `out[rows[j]] = x[tokens[j]]` for every `j`, `x`
    /// `[M, W]` bytes, `out` `[num_rows, W]`; rows no `j` names are zero with `zero`,
    /// else stale. DeepEP v2's expanded layout.
    #[pyo3(signature = (x, tokens, rows, num_rows, zero))]
    fn gather_rows<'py>(
        &self,
        py: Python<'py>,
        x: &Bound<'py, PyAny>,
        tokens: &Bound<'py, PyAny>,
        rows: &Bound<'py, PyAny>,
        num_rows: usize,
        zero: bool,
    ) -> PyResult<Bound<'py, PyCapsule>> {
        let x = In::new(x, "x", DType::U8)?;
        let (m, w) = (x.expect_ndim(2)?.dim(0)?, x.dim(1)?);
        let (tokens, rows) = (
            In::new(tokens, "tokens", DType::I64)?,
            In::new(rows, "rows", DType::I64)?,
        );
        let (ts, rs) = (tokens.slice::<i64>(), rows.slice::<i64>());
        let inside = |v: &[i64], n: usize| v.iter().all(|&i| (0..n as i64).contains(&i));
        if ts.len() != rs.len() || !inside(ts, m) || !inside(rs, num_rows) {
            return Err(errors::invalid(format!(
                "gather_rows: {} tokens of {m} rows into {} rows of {num_rows}: an index is out of range",
                ts.len(),
                rs.len()
            )));
        }
        let xs = x.slice::<u8>();
        let mut st = self.lock(py);
        let (block, ()) = st.outputs.fill(num_rows * w, |block| {
            let out = block.as_mut_slice::<u8>(num_rows * w);
            py.detach(|| {
                if zero {
                    out.fill(0);
                }
                for (&t, &r) in ts.iter().zip(rs) {
                    let (t, r) = (t as usize, r as usize);
                    out[r * w..(r + 1) * w].copy_from_slice(&xs[t * w..(t + 1) * w]);
                }
            })
        });
        export_block(py, block, &[num_rows, w], DType::U8)
    }

    /// The send half of a low-latency dispatch; returns its pending receive. `nvfp4`
    /// (global scale, UE8M0 block scales) casts to NVFP4 instead of FP8.
    #[pyo3(signature = (x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, use_fp8, round_scale, nvfp4=None, topk_weights=None))]
    #[allow(clippy::too_many_arguments)]
    fn ll_dispatch_send<'py>(
        &self,
        py: Python<'py>,
        x: &Bound<'py, PyAny>,
        topk_idx: &Bound<'py, PyAny>,
        num_max_dispatch_tokens_per_rank: usize,
        num_experts: usize,
        use_fp8: bool,
        round_scale: bool,
        nvfp4: Option<(f32, bool)>,
        topk_weights: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<LlPendingPy> {
        let cast = match nvfp4 {
            Some((global_scale, ue8m0)) => Some(Cast::Nvfp4(Nvfp4 {
                global_scale,
                ue8m0,
            })),
            None => Cast::fp8_if(use_fp8, round_scale),
        };
        let parsed = (|| -> PyResult<_> {
            let x = In::new(x, "x", DType::BF16)?;
            x.expect_ndim(2)?;
            let idx = In::new(topk_idx, "topk_idx", DType::I64)?;
            idx.expect_ndim(2)?;
            let w = topk_weights
                .map(|w| In::new(w, "topk_weights", DType::F32))
                .transpose()?;
            if let Some(w) = &w {
                w.expect_ndim(2)?;
            }
            let shape = Shape {
                num_experts,
                hidden: x.dim(1)?,
                topk: idx.dim(1)?,
                max_tokens: num_max_dispatch_tokens_per_rank,
            };
            Ok((x, idx, w, shape))
        })();
        let mut st = self.lock(py);
        let dim = |o: &Bound<'py, PyAny>, i: usize| peek_shape(o).and_then(|s| s.get(i).copied());
        let want = match (dim(x, 1), dim(topk_idx, 1)) {
            (Some(hidden), Some(topk)) => Some(Want::Ll(Shape {
                num_experts,
                hidden,
                topk,
                max_tokens: num_max_dispatch_tokens_per_rank,
            })),
            _ => None,
        };
        let bad = parsed.as_ref().err().map(|e| e.to_string());
        self.ensure(py, &mut st, false, want, bad)?;
        let (x, idx, w, _) = parsed?;
        let generation = st.generation;
        let buffer = Self::buffer(&mut st)?;
        let mut args = LlDispatchArgs::new(x.slice::<bf16>(), idx.slice::<i64>()).cast(cast);
        if let Some(w) = &w {
            args = args.weights(w.slice::<f32>());
        }
        let pending = py
            .detach(|| buffer.low_latency_dispatch_send(args))
            .map_err(ep_err)?;
        Ok(LlPendingPy {
            buffer: pending.buffer_index(),
            format: cast.map_or(TokenFormat::Bf16, |c| c.format()),
            inner: Mutex::new(Some(pending)),
            generation,
        })
    }

    /// The rows and scales of a low-latency dispatch as tensors `[E/R, R*M, H]` (bf16 or
    /// e4m3 bytes; `H/2` bytes for NVFP4) and `[E/R, R*M, words]` (column-major in the
    /// last two dimensions; f32 FP8 scales, or int32 words of four NVFP4 block scale
    /// bytes), valid once its
    /// receive ran: before the receive for a hook, after it otherwise (`handle` then
    /// narrows what a later reuse of the buffer keeps).
    #[pyo3(signature = (pending, handle=None))]
    fn ll_outputs<'py>(
        &self,
        py: Python<'py>,
        pending: PyRef<'py, LlPendingPy>,
        handle: Option<PyRef<'py, LlHandlePy>>,
    ) -> PyResult<Bound<'py, PyTuple>> {
        let mut st = self.lock(py);
        self.check_generation(py, &mut st, pending.generation, "low-latency dispatch")?;
        let buffer = Self::buffer(&mut st)?;
        let s = buffer
            .config()
            .ll
            .ok_or_else(|| errors::internal("no low-latency shape"))?;
        let (r_n, format) = (self.topo.num_ranks, pending.format);
        let (epr, rows, h) = (s.experts_per_rank(r_n), r_n * s.max_tokens, s.hidden);
        let lease = buffer
            .lease_ll(pending.buffer, format, handle.as_ref().map(|h| &h.inner))
            .map_err(ep_err)?;
        let part = |i: usize, shape: &[usize], strides: Option<&[usize]>, dtype: DType| {
            export_lease(py, &lease, i, shape, strides, dtype)
        };
        let (x_cols, x_dtype, s_dtype) = match format {
            TokenFormat::Bf16 => (h, DType::BF16, DType::F32),
            TokenFormat::Fp8 => (h, DType::U8, DType::F32),
            TokenFormat::Nvfp4 => (h / 2, DType::U8, DType::I32),
        };
        let x = part(0, &[epr, rows, x_cols], None, x_dtype)?;
        let g = format.scale_words(h);
        let scales = (g > 0)
            .then(|| part(1, &[epr, rows, g], Some(&[g * rows, 1, rows]), s_dtype))
            .transpose()?;
        (x, scales).into_pyobject(py)
    }

    /// The receive half of a low-latency dispatch: `(recv_count [E/R] list, handle,
    /// src_info [E/R, R*M] i32, layout_range [E/R, R] i64, wait_ns [R] list)`.
    fn ll_dispatch_recv<'py>(
        &self,
        py: Python<'py>,
        pending: PyRef<'py, LlPendingPy>,
    ) -> PyResult<Bound<'py, PyTuple>> {
        let mut st = self.lock(py);
        self.check_generation(py, &mut st, pending.generation, "low-latency dispatch")?;
        let p = pending
            .inner
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
            .ok_or_else(|| {
                errors::invalid("this low-latency dispatch was received already (its hook ran)")
            })?;
        let generation = st.generation;
        let buffer = Self::buffer(&mut st)?;
        let (handle, wait_ns) = py
            .detach(|| {
                buffer
                    .low_latency_dispatch_recv(p)
                    .map(|o| (o.handle, o.wait_ns))
            })
            .map_err(ep_err)?;
        let r_n = self.topo.num_ranks;
        let epr = handle.recv_count.len();
        let rows = handle.src_info.len() / epr.max(1);
        let src_info = export_vec(py, handle.src_info.clone(), &[epr, rows], DType::I32)?;
        let ranges: Vec<i64> = handle
            .layout_range
            .iter()
            .map(|&(b, c)| ((b as i64) << 32) | c as i64)
            .collect();
        let layout_range = export_vec(py, ranges, &[epr, r_n], DType::I64)?;
        let counts = handle.recv_count.clone();
        let handle = Py::new(
            py,
            LlHandlePy {
                inner: handle,
                generation,
            },
        )?;
        (counts, handle, src_info, layout_range, wait_ns).into_pyobject(py)
    }

    /// `[E/R, R*M]` f32: the gate weight each received row's (token, slot) had at its
    /// source (0 past the counts).
    fn ll_src_weights<'py>(
        &self,
        py: Python<'py>,
        handle: PyRef<'py, LlHandlePy>,
    ) -> PyResult<Bound<'py, PyCapsule>> {
        let h = &handle.inner;
        let epr = h.recv_count.len();
        let rows = h.src_weight.len() / epr.max(1);
        export_vec(py, h.src_weight.clone(), &[epr, rows], DType::F32)
    }

    /// `(start, end)`: the addresses of the Buffer's registered memory (an output there
    /// would overlap what a call reads).
    fn memory_span(&self, py: Python<'_>) -> PyResult<(usize, usize)> {
        let mut st = self.lock(py);
        let span = Self::buffer(&mut st)?.memory_span();
        Ok((span.start, span.end))
    }

    /// The next low-latency combine buffer, `[E/R, R*M, H]` bf16, as a DLPack capsule:
    /// expert outputs written there go with `ll_combine_send(None, ...)`.
    fn ll_combine_buffer<'py>(
        &self,
        py: Python<'py>,
        handle: PyRef<'py, LlHandlePy>,
    ) -> PyResult<Bound<'py, PyCapsule>> {
        let mut st = self.lock(py);
        self.check_generation(py, &mut st, handle.generation, "handle")?;
        let buffer = Self::buffer(&mut st)?;
        crate::dlpack::export_combine_buffer(py, buffer)
    }

    /// The send half of a low-latency combine of `x` (`[E/R, R*M, H]` bf16), or, when
    /// `x` is `None`, of the combine buffer (zero copy).
    #[pyo3(signature = (x, topk_idx, topk_weights, handle))]
    fn ll_combine_send<'py>(
        &self,
        py: Python<'py>,
        x: Option<&Bound<'py, PyAny>>,
        topk_idx: &Bound<'py, PyAny>,
        topk_weights: &Bound<'py, PyAny>,
        handle: PyRef<'py, LlHandlePy>,
    ) -> PyResult<LlCombinePendingPy> {
        let mut st = self.lock(py);
        let parsed = (|| -> PyResult<_> {
            Ok((
                x.map(|x| In::new(x, "x", DType::BF16)).transpose()?,
                In::new(topk_idx, "topk_idx", DType::I64)?,
                In::new(topk_weights, "topk_weights", DType::F32)?,
            ))
        })();
        self.check_generation(py, &mut st, handle.generation, "handle")?;
        let (x, idx, w) = parsed.map_err(|e| self.reject(py, &mut st, &e.to_string()))?;
        let generation = st.generation;
        let buffer = Self::buffer(&mut st)?;
        let input = match &x {
            Some(x) => LlCombineInput::Rows(x.slice::<bf16>()),
            None => LlCombineInput::ZeroCopy,
        };
        let (idx, w) = (idx.slice::<i64>(), w.slice::<f32>());
        let handle = &handle.inner;
        let pending = py
            .detach(|| buffer.low_latency_combine_send(input, idx, w, handle))
            .map_err(ep_err)?;
        Ok(LlCombinePendingPy {
            inner: Mutex::new(Some(pending)),
            generation,
        })
    }

    /// The receive half of a low-latency combine, into `out` (`[T, H]` bf16); `x` is
    /// the send half's (`None` for the combine buffer).
    #[pyo3(signature = (pending, x, out))]
    fn ll_combine_recv<'py>(
        &self,
        py: Python<'py>,
        pending: PyRef<'py, LlCombinePendingPy>,
        x: Option<&Bound<'py, PyAny>>,
        out: &Bound<'py, PyAny>,
    ) -> PyResult<()> {
        let mut st = self.lock(py);
        self.check_generation(py, &mut st, pending.generation, "low-latency combine")?;
        let p = pending
            .inner
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
            .ok_or_else(|| {
                errors::invalid("this low-latency combine was received already (its hook ran)")
            })?;
        let x = x.map(|x| In::new(x, "x", DType::BF16)).transpose()?;
        let out = In::new(out, "out", DType::BF16)?;
        let buffer = Self::buffer(&mut st)?;
        let (span, memory) = (out.span(), buffer.memory_span());
        if span.start < memory.end && memory.start < span.end {
            return Err(errors::invalid("out lies in the Buffer's own memory (the combine buffer?): pass a tensor of its own",
            ));
        }
        let dst = out.slice_mut::<bf16>(&x.iter().collect::<Vec<_>>())?;
        let input = match &x {
            Some(x) => LlCombineInput::Rows(x.slice::<bf16>()),
            None => LlCombineInput::ZeroCopy,
        };
        py.detach(|| buffer.low_latency_combine_recv(p, input, dst))
            .map_err(ep_err)
    }

    /// A barrier over every rank (through the Buffer's memory, or the control plane
    /// before the first call).
    fn barrier(&self, py: Python<'_>) -> PyResult<()> {
        let mut st = self.lock(py);
        match st.buffer.as_mut() {
            Some(b) => py.detach(|| b.barrier()).map_err(ep_err),
            None => self.group()?.barrier().map_err(|e| ep_err(e.into())),
        }
    }

    /// Low-latency mode for `num_max_dispatch_tokens_per_rank` tokens of `hidden`
    /// channels to `num_experts` experts, top-k `topk`, ready on every rank (collective:
    /// DeepEP's `clean_low_latency_buffer`).
    fn prepare_ll(
        &self,
        py: Python<'_>,
        num_max_dispatch_tokens_per_rank: usize,
        hidden: usize,
        num_experts: usize,
        topk: usize,
    ) -> PyResult<()> {
        let mut st = self.lock(py);
        let want = Want::Ll(Shape {
            num_experts,
            hidden,
            topk,
            max_tokens: num_max_dispatch_tokens_per_rank,
        });
        self.ensure(py, &mut st, false, Some(want), None)?;
        let b = Self::buffer(&mut st)?;
        py.detach(|| b.barrier()).map_err(ep_err)
    }

    /// The current low-latency top-k, if any (for `clean_low_latency_buffer`).
    fn ll_topk(&self, py: Python<'_>) -> Option<usize> {
        self.lock(py)
            .buffer
            .as_ref()
            .and_then(|b| b.config().ll.or(b.config().normal))
            .map(|s| s.topk)
    }

    /// Reject this rank's input for a call of `mode` ("normal" or "ll", with the shape
    /// as far as known: `num_experts`, `hidden`, `topk`, `max_tokens`; 0 where
    /// unknown): tell every rank, the way that call would have met them (through the
    /// Buffer, or in the exchange that sets one up), and raise `reason`.
    #[pyo3(signature = (reason, mode=None, num_experts=0, hidden=0, topk=0, max_tokens=0))]
    #[allow(clippy::too_many_arguments)]
    fn reject_call(
        &self,
        py: Python<'_>,
        reason: &str,
        mode: Option<&str>,
        num_experts: usize,
        hidden: usize,
        topk: usize,
        max_tokens: usize,
    ) -> PyResult<()> {
        let mut st = self.lock(py);
        let shape = Shape {
            num_experts,
            hidden,
            topk,
            max_tokens,
        };
        let known = num_experts > 0 && hidden > 0 && topk > 0;
        let want = match mode {
            Some("normal") if known => Some(Want::Normal(shape)),
            Some("ll") if known && max_tokens > 0 => Some(Want::Ll(shape)),
            _ => None,
        };
        self.ensure(
            py,
            &mut st,
            mode != Some("ll"),
            want,
            Some(reason.to_string()),
        )
    }

    /// `[R]`: the masked ranks (elastic mode; all `false` before the first call).
    fn mask_query(&self, py: Python<'_>) -> Vec<bool> {
        match self.lock(py).buffer.as_ref() {
            Some(b) => b.low_latency_mask(),
            None => vec![false; self.topo.num_ranks],
        }
    }

    /// Why each rank is masked (`None` where it is not).
    fn mask_reasons(&self, py: Python<'_>) -> Vec<Option<String>> {
        match self.lock(py).buffer.as_ref() {
            Some(b) => b.low_latency_mask_reasons(),
            None => vec![None; self.topo.num_ranks],
        }
    }

    /// Mask (`mask`) or unmask `rank` (elastic mode).
    fn mask_update(&self, py: Python<'_>, rank: usize, mask: bool) -> PyResult<()> {
        let mut st = self.lock(py);
        Self::buffer(&mut st)?
            .low_latency_update_mask(rank, mask)
            .map_err(ep_err)
    }

    /// Unmask every rank not found gone (elastic mode).
    fn mask_clean(&self, py: Python<'_>) -> PyResult<()> {
        let mut st = self.lock(py);
        match st.buffer.as_mut() {
            Some(b) => b.low_latency_clean_mask().map_err(ep_err),
            None => Ok(()),
        }
    }

    /// Free everything (collective: a barrier first, as DeepEP's `destroy`).
    fn destroy(&self, py: Python<'_>) -> PyResult<()> {
        let mut st = self.lock(py);
        if st.destroyed {
            return Err(errors::invalid("destroy() was called already"));
        }
        let r = match st.buffer.as_mut() {
            Some(b) => py.detach(|| b.barrier()).map_err(ep_err),
            None => self.group()?.barrier().map_err(|e| ep_err(e.into())),
        };
        st.buffer = None;
        st.destroyed = true;
        r
    }
}

#[pymethods]
impl NormalHandlePy {
    /// `[R, R]` i32: entry `[s][r]` = tokens ranks `0..=s` send to rank `r`.
    fn rank_prefix_matrix<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyCapsule>> {
        let r = self.inner.num_tokens_per_rank.len();
        export_vec(
            py,
            self.inner.rank_prefix_matrix.clone(),
            &[r, r],
            DType::I32,
        )
    }

    /// `[N]` i32: source token of every received row.
    fn recv_src_idx<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyCapsule>> {
        let n = self.inner.recv_src_idx.len();
        export_vec(py, self.inner.recv_src_idx.clone(), &[n], DType::I32)
    }

    /// `[T, R]` bool: which ranks each token went to.
    fn is_token_in_rank<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyCapsule>> {
        let r = self.inner.num_tokens_per_rank.len();
        let v: Vec<u8> = self
            .inner
            .is_token_in_rank
            .iter()
            .map(|&b| b as u8)
            .collect();
        export_vec(py, v, &[self.inner.num_tokens, r], DType::BOOL)
    }

    /// `[R]` i32: tokens this rank sent to each rank.
    fn num_tokens_per_rank<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyCapsule>> {
        let r = self.inner.num_tokens_per_rank.len();
        export_vec(py, self.inner.num_tokens_per_rank.clone(), &[r], DType::I32)
    }

    /// Rows received.
    #[getter]
    fn num_recv_tokens(&self) -> usize {
        self.inner.num_recv_tokens
    }

    /// Rows of the outputs (with `num_worst_tokens` padding).
    #[getter]
    fn num_rows(&self) -> usize {
        self.inner.num_rows
    }

    /// Tokens dispatched.
    #[getter]
    fn num_tokens(&self) -> usize {
        self.inner.num_tokens
    }

    /// Top-k slots.
    #[getter]
    fn topk(&self) -> usize {
        self.inner.topk
    }
}

#[pymethods]
impl LlHandlePy {
    /// Tokens dispatched.
    #[getter]
    fn num_tokens(&self) -> usize {
        self.inner.num_tokens
    }
}

/// The normal dispatch's arguments from parsed input: the tokens, their top-k (and
/// weights), the layout, and the handle of a cached dispatch.
fn dispatch_args<'a>(
    p: &'a NormalIn,
    handle: Option<&'a NormalHandlePy>,
    lanes: WeightLanes,
) -> DispatchArgs<'a> {
    let mut args = DispatchArgs::new(p.tokens()).weight_lanes(lanes);
    if let Some(h) = handle {
        args = args.cached(&h.inner);
    }
    if let Some(i) = &p.topk_idx {
        let weights = p.topk_weights.as_ref().map(|w| w.slice::<f32>());
        args = args.topk(i.slice::<i64>(), weights);
    }
    if let Some(l) = &p.layout {
        args = args.layout(l);
    }
    args
}
