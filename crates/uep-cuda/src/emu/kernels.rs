//! The kernels the emulated device runs, as safe functions over slices: each checks
//! what its kernel relies on (lengths, alignment, indices in range) before the launch,
//! so every address it hands over is valid for the whole launch.

use uep_ep::device::Part;
use uep_ep::quant::Nvfp4;
use uep_ep::DispatchLayout;

use super::ffi::{self, Grid};
#[cfg(test)]
use crate::api::SelftestArgs;
use crate::api::{addr, addr_mut, Fp8CastArgs, LayoutArgs, Nvfp4CastArgs, ReduceArgs};
use crate::layout::{fits, RouteShape};
use crate::quant::Loads;
#[cfg(test)]
use crate::selftest::WORDS as SELFTEST_WORDS;

/// Channels of a cast group.
const GROUP: usize = uep_ep::quant::FP8_GROUP;

/// Whether `s` starts on a multiple of `align` bytes.
fn aligned<T>(s: &[T], align: usize) -> bool {
    s.as_ptr() as usize % align == 0
}

/// Runs `run` over `s` where it is `align`-aligned, or over an aligned copy: the wide
/// loads of the cast kernels need it (a caller's tensor may start anywhere).
fn with_aligned_in<R>(s: &[u16], align: usize, run: impl FnOnce(&[u16]) -> R) -> R {
    if aligned(s, align) {
        return run(s);
    }
    let mut words = vec![0u128; (s.len() * 2).div_ceil(16)];
    let staged = &mut bytemuck::cast_slice_mut::<u128, u16>(&mut words)[..s.len()];
    staged.copy_from_slice(s);
    run(staged)
}

/// Runs `run` over `out` where it is `align`-aligned, or over an aligned copy whose
/// contents then go back into `out`.
fn with_aligned_out(
    out: &mut [u8],
    align: usize,
    run: impl FnOnce(&mut [u8]) -> Result<(), String>,
) -> Result<(), String> {
    if aligned(out, align) {
        return run(out);
    }
    let mut words = vec![0u128; out.len().div_ceil(16)];
    let staged = &mut bytemuck::cast_slice_mut::<u128, u8>(&mut words)[..out.len()];
    run(staged)?;
    out.copy_from_slice(staged);
    Ok(())
}

/// The layout of `topk_idx` (shape `s`, which [`fits`]): `Ok(Err(i))` where the kernel
/// found entry `i` out of range.
pub(crate) fn layout(
    grid: Grid,
    topk_idx: &[i64],
    s: RouteShape,
) -> Result<Result<DispatchLayout, u64>, String> {
    if !fits(s) || topk_idx.len() != s.tokens * s.topk {
        return Err(format!(
            "{} ids do not make the layout shape {s:?}",
            topk_idx.len()
        ));
    }
    let mut per_rank = vec![0i32; s.ranks];
    let mut per_node = vec![0i32; s.ranks / s.ranks_per_node];
    let mut per_expert = vec![0i32; s.experts];
    let mut in_rank = vec![0u8; s.tokens * s.ranks];
    let mut bad = [u64::MAX];
    let args = LayoutArgs {
        topk_idx: addr(topk_idx),
        per_rank: addr_mut(&mut per_rank),
        per_node: addr_mut(&mut per_node),
        per_expert: addr_mut(&mut per_expert),
        in_rank: addr_mut(&mut in_rank),
        first_bad: addr_mut(&mut bad),
        ..s.args()
    };
    // SAFETY: ids [T, K] (checked above), counts [R], [N], [E], the [T, R] map and the
    // error word, allocated here at those sizes and alive until the launch returns;
    // `fits` bounds every size to 32 bits and makes R a multiple of N.
    #[allow(unsafe_code)]
    unsafe {
        ffi::launch(&ffi::LAYOUT, grid, &args)?;
    }
    if bad[0] != u64::MAX {
        return Ok(Err(bad[0]));
    }
    Ok(Ok(DispatchLayout {
        num_tokens: s.tokens,
        num_ranks: s.ranks,
        num_experts: s.experts,
        num_tokens_per_rank: per_rank,
        num_tokens_per_rdma_rank: per_node,
        num_tokens_per_expert: per_expert,
        is_token_in_rank: in_rank.into_iter().map(|b| b != 0).collect(),
    }))
}

/// Checks that `x` is whole groups of 128 channels and that `q` and `scales` hold
/// `q_per` code bytes and `s_per` scale bytes a group.
fn check_cast(
    x: &[u16],
    q: usize,
    scales: usize,
    q_per: usize,
    s_per: usize,
) -> Result<(), String> {
    let groups = x.len() / GROUP;
    if x.len() % GROUP != 0 || q != groups * q_per || scales != groups * s_per {
        return Err(format!(
            "a cast of {} channels into {q} code and {scales} scale bytes",
            x.len()
        ));
    }
    Ok(())
}

/// The FP8 cast of `x` (bf16 bits, whole groups of 128) into `q` and `scales`, by the
/// kernel with `loads`.
pub(crate) fn fp8_cast(
    grid: Grid,
    loads: Loads,
    x: &[u16],
    round_scale: bool,
    q: &mut [u8],
    scales: &mut [f32],
) -> Result<(), String> {
    check_cast(x, q.len(), scales.len() * 4, GROUP, 4)?;
    with_aligned_in(x, 16, |x| {
        with_aligned_out(q, 8, |q| {
            let args = Fp8CastArgs {
                x: addr(x),
                q: addr_mut(q),
                scales: addr_mut(scales),
                groups: (x.len() / GROUP) as u64,
                round_scale: u32::from(round_scale),
                pad: 0,
            };
            // SAFETY: `groups` groups of 128 channels in `x` (16-byte aligned), of codes in
            // `q` (8-byte aligned) and of scales, checked above; all live until the launch
            // returns.
            #[allow(unsafe_code)]
            unsafe {
                match loads {
                    Loads::X8 => ffi::launch(&ffi::FP8_CAST, grid, &args),
                    Loads::X16 => ffi::launch(&ffi::FP8_CAST_X16, grid, &args),
                }
            }
        })
    })
}

/// The NVFP4 cast of `x` (bf16 bits, whole groups of 128) into `q` (two codes a byte)
/// and `sf` (a scale byte a block of 16).
pub(crate) fn nvfp4_cast(
    grid: Grid,
    x: &[u16],
    cast: Nvfp4,
    q: &mut [u8],
    sf: &mut [u8],
) -> Result<(), String> {
    check_cast(x, q.len(), sf.len(), GROUP / 2, GROUP / 16)?;
    with_aligned_in(x, 8, |x| {
        with_aligned_out(q, 2, |q| {
            let args = Nvfp4CastArgs {
                x: addr(x),
                q: addr_mut(q),
                sf: addr_mut(sf),
                groups: (x.len() / GROUP) as u64,
                global_scale: cast.global_scale,
                ue8m0: u32::from(cast.ue8m0),
            };
            // SAFETY: `groups` groups of 128 channels in `x` (8-byte aligned), 64 code bytes
            // a group in `q` (2-byte aligned) and 8 scale bytes a group in `sf`, checked
            // above; all live until the launch returns.
            #[allow(unsafe_code)]
            unsafe {
                ffi::launch(&ffi::NVFP4_CAST, grid, &args)
            }
        })
    })
}

/// Token `t`'s output `out[t]` as the sum of its parts `parts[starts[t]..starts[t + 1]]`,
/// each a row of `sources` (`hidden` channels a row), read in place.
pub(crate) fn reduce(
    grid: Grid,
    sources: &[&[u16]],
    starts: &[u32],
    parts: &[Part],
    hidden: usize,
    weighted: bool,
    out: &mut [u16],
) -> Result<(), String> {
    let tokens = starts.len().saturating_sub(1);
    let well_formed = hidden > 0
        && starts.first() == Some(&0)
        && starts.windows(2).all(|w| w[0] <= w[1])
        && starts.last().map(|&e| e as usize) == Some(parts.len())
        && out.len() == tokens * hidden
        && u32::try_from(tokens.max(hidden)).is_ok();
    let in_range = |p: &Part| {
        (sources.get(p.source as usize)).is_some_and(|s| (p.row as usize) < s.len() / hidden.max(1))
    };
    if !well_formed || !parts.iter().all(in_range) {
        return Err(format!(
            "a reduction of {} parts over {} sources into {} values is malformed",
            parts.len(),
            sources.len(),
            out.len()
        ));
    }
    if tokens == 0 {
        return Ok(());
    }
    let table: Vec<u64> = sources.iter().map(|s| addr(s)).collect();
    let args = ReduceArgs {
        sources: addr(&table),
        starts: addr(starts),
        parts: addr(parts),
        out: addr_mut(out),
        tokens: tokens as u32,
        hidden: hidden as u32,
        weighted: u32::from(weighted),
        pad: 0,
    };
    // SAFETY: the table names each source's first row; every part names a row its
    // source has and `starts` indexes `parts` (both checked above); `out` holds the
    // tokens' rows; `Part` is `uep::ReducePart`'s layout (`ffi`'s size test). All live
    // until the launch returns, and nothing else writes them meanwhile.
    #[allow(unsafe_code)]
    unsafe {
        ffi::launch(&ffi::REDUCE, grid, &args)
    }
}

#[cfg(test)]
/// The self-test kernel's case `which` over `grid`: each thread's words in `out`,
/// `flags` the words its spin cases store and wait on (which other threads may store).
pub(crate) fn selftest(
    grid: Grid,
    which: u32,
    out: &mut [u64],
    flags: &[std::sync::atomic::AtomicU64],
) -> Result<(), String> {
    let threads = grid.blocks as usize * grid.threads as usize;
    if out.len() < threads * SELFTEST_WORDS || flags.len() < threads.max(grid.blocks as usize) {
        return Err(format!(
            "the self-test of {threads} threads needs {} words and {threads} flags",
            threads * SELFTEST_WORDS
        ));
    }
    let args = SelftestArgs {
        out: addr_mut(out),
        flags: addr(flags),
        which,
        pad: 0,
    };
    // SAFETY: every thread writes its own words of `out` and its own word of `flags`
    // (atomics, whose memory may be written through a shared reference), sized above;
    // the spin cases load flags atomically.
    #[allow(unsafe_code)]
    unsafe {
        ffi::launch(&ffi::SELFTEST, grid, &args)
    }
}

/// FIFOs leased to a host-build kernel (block `b`'s warp produces into ring `b`), with
/// the `uep::Ring` table it reads: the host side of what a GPU kernel gets.
#[cfg(test)]
pub(crate) struct HostRings {
    fifos: Vec<std::sync::Arc<uep_fifo::Fifo>>,
    _leases: Vec<uep_fifo::DeviceLease<std::sync::Arc<uep_fifo::Fifo>>>,
    table: Vec<u64>,
}

#[cfg(test)]
impl HostRings {
    /// `n` empty FIFOs of `capacity` slots in the host device's FIFO memory.
    pub(crate) fn new(n: usize, capacity: usize) -> HostRings {
        use uep_fifo::FifoAlloc;
        let fifos: Vec<_> = (0..n)
            .map(|_| std::sync::Arc::new(uep_ep::device::HostFifos.alloc_fifo(capacity).unwrap()))
            .collect();
        let leases: Vec<_> = (fifos.iter())
            .map(|f| uep_fifo::DeviceLease::claim(f.clone()).unwrap())
            .collect();
        let table = (leases.iter())
            .flat_map(|l| [l.region_addr() as u64, capacity as u64])
            .collect();
        HostRings {
            fifos,
            _leases: leases,
            table,
        }
    }

    /// Every ring with its index, for a consumer.
    pub(crate) fn all(&self) -> Vec<(usize, &uep_fifo::Fifo)> {
        self.fifos.iter().map(|f| &**f).enumerate().collect()
    }
}

/// The FIFO bench's producer kernel: block `b`'s first warp pushes `count` commands
/// into ring `b`, `batch` at a time; `ns[b]` gets its time. A consumer must drain the
/// rings meanwhile.
#[cfg(test)]
pub(crate) fn fifo_push(
    grid: Grid,
    rings: &HostRings,
    count: u64,
    batch: u32,
    ns: &mut [u64],
) -> Result<(), String> {
    use crate::api::FifoPushArgs;
    let n = rings.fifos.len();
    if grid.blocks as usize != n || ns.len() != n || !(1..=32).contains(&batch) {
        return Err(format!(
            "{} blocks, {n} rings, {} timers, batch {batch}",
            grid.blocks,
            ns.len()
        ));
    }
    let args = FifoPushArgs {
        rings: addr(&rings.table),
        ns: addr_mut(ns),
        count,
        batch,
        pad: 0,
    };
    // SAFETY: a ring table of one leased FIFO a block (its regions live while `rings`
    // does) and a timer a block; the kernel is each ring's only producer.
    #[allow(unsafe_code)]
    unsafe {
        ffi::launch(&ffi::FIFO_PUSH, grid, &args)
    }
}

/// The LL send's kernel over `rings` (one a block): casts each token of `x` into its
/// row of `staged` and pushes a `Write` per destination rank of `topk_idx`.
#[cfg(test)]
pub(crate) fn ll_send(
    grid: Grid,
    rings: &HostRings,
    x: &[u16],
    topk_idx: &[i64],
    staged: &mut [u8],
    args: crate::api::LlSendArgs,
) -> Result<(), String> {
    let (t, h) = (args.tokens as usize, args.hidden as usize);
    let row_bytes = h + h / 32;
    let fits = grid.blocks as usize == rings.fifos.len()
        && h % GROUP == 0
        && x.len() == t * h
        && topk_idx.len() == t * args.topk as usize
        && (1..=32).contains(&args.topk)
        && staged.len() == t * row_bytes
        && args.ranks > 0
        && args.experts % args.ranks == 0
        && aligned(x, 8);
    if !fits {
        return Err(format!(
            "an LL send of {args:?} over {} rings",
            rings.fifos.len()
        ));
    }
    let mut ns = vec![0u64; rings.fifos.len()];
    let args = crate::api::LlSendArgs {
        x: addr(x),
        topk_idx: addr(topk_idx),
        rings: addr(&rings.table),
        ns: addr_mut(&mut ns),
        staged: addr_mut(staged),
        ..args
    };
    // SAFETY: tokens and ids of the sizes checked above (x 8-byte aligned), a staged
    // row a token, a leased ring and a timer a block; all live until the launch returns.
    #[allow(unsafe_code)]
    unsafe {
        ffi::launch(&ffi::LL_SEND, grid, &args)
    }
}

/// The FIFO bench's round trip: one thread pushes a command and waits until a consumer
/// popped it, `ns.len()` times, each round trip's nanoseconds into `ns`.
#[cfg(test)]
pub(crate) fn fifo_ping(grid: Grid, rings: &HostRings, ns: &mut [u64]) -> Result<(), String> {
    use crate::api::FifoPingArgs;
    if grid.blocks != 1 || rings.fifos.is_empty() {
        return Err("a ping is one block over one ring".into());
    }
    let args = FifoPingArgs {
        rings: addr(&rings.table),
        ns: addr_mut(ns),
        rounds: ns.len() as u32,
        pad: 0,
    };
    // SAFETY: the first ring of the table is leased (alive while `rings` is) and `ns`
    // holds a timer a round.
    #[allow(unsafe_code)]
    unsafe {
        ffi::launch(&ffi::FIFO_PING, grid, &args)
    }
}
