//! Normal combine: send → publish → relay → gather → reduce.

use half::bf16;

use super::paths::CallMask;
use super::{CombineArgs, NormalHandle, NormalState};
use crate::area::{Area, SliceRows, STREAM_ABOVE};
use crate::ctx::Ctx;
use crate::device::normal::ReturnSink;
use crate::device::{NormalCombineSendPhase, Part, ReducePhase, Rows, Store, Symmetric};
use crate::error::Result;
use crate::invalid;
use crate::map::NormalAreas;
use crate::packet::{Channel, CombinePacket};
use crate::symm::Published;
use crate::topology::Topology;
use crate::wait::Wait;

/// Where the rows for each of this rank's tokens came back: per contributing rank, its
/// row (this rank's own in `x`, a same-node rank's in the combine rows, another node's
/// partial where its packet landed).
struct Gathered<'a> {
    /// This rank's memory, published for the call.
    published: Published<'a>,
    /// `[R, T, K]` weights beside the combine rows (`NormalAreas::combine_x`).
    wrows: &'a [f32],
    /// `[relay rank]`: each token's row in that relay's packet (empty: not a relay).
    packet_row: Vec<Vec<usize>>,
    /// `[relay rank]`: where the packet's rows landed, and its weights.
    partial_x: Vec<Area<u16>>,
    partial_w: Vec<&'a [f32]>,
}

impl Ctx {
    /// One normal combine (see [`crate::Buffer::combine_into`]), numbered in `st`.
    pub(crate) fn combine_call(
        &self,
        st: &mut NormalState,
        x: &[bf16],
        args: &CombineArgs<'_>,
        handle: &NormalHandle,
        combined_x: &mut [bf16],
        combined_w: Option<&mut [f32]>,
    ) -> Result<()> {
        let areas = self.normal_areas()?;
        self.check_combine(&areas, x, args, handle, combined_x, combined_w.as_deref())?;
        let mut mask = self.normal_mask()?;
        loop {
            st.combine = st.combine.wrapping_add(1);
            let seq = st.combine;
            let gathered = self.combine_attempt(seq, &areas, x, args, handle, &mask)?;
            if let Some(grown) = self.normal_agree(&format!("combine {seq}"), &mask, true)? {
                mask = grown;
                continue;
            }
            self.note_combine_mask(&mask.masked);
            let g = (&gathered, &mask);
            return self.reduce(&areas, handle, g, x, args, combined_x, combined_w);
        }
    }

    /// One attempt of combine `seq` under `mask`: everything up to the reduction.
    fn combine_attempt(
        &self,
        seq: u32,
        areas: &NormalAreas,
        x: &[bf16],
        args: &CombineArgs<'_>,
        handle: &NormalHandle,
        mask: &CallMask,
    ) -> Result<Gathered<'_>> {
        let wait = self.call_wait();
        self.send_rows(areas, x, args, handle, mask)?;
        self.publish_rows(seq)?;
        let relayed = self.relayed_now(handle, mask, &wait)?;
        self.relay_combine(seq, areas, (handle, &relayed), x, args, mask, &wait)?;
        self.gather(seq, areas, handle, mask, &wait)
    }

    fn check_combine(
        &self,
        areas: &NormalAreas,
        x: &[bf16],
        args: &CombineArgs<'_>,
        handle: &NormalHandle,
        combined_x: &[bf16],
        combined_w: Option<&[f32]>,
    ) -> Result<()> {
        let (h, k) = (areas.shape.hidden, areas.shape.topk);
        let (n, t_n) = (handle.num_recv_tokens, handle.num_tokens);
        if handle.buffer_id != self.id {
            return Err(invalid!(
                "the handle was made by another Buffer (or another rank)"
            ));
        }
        if x.len() != n * h && x.len() != handle.num_rows * h {
            return Err(invalid!(
                "combine x has {} values, expected [rows = {n}, hidden = {h}]",
                x.len()
            ));
        }
        if combined_x.len() != t_n * h || combined_w.is_some_and(|w| w.len() != t_n * k) {
            return Err(invalid!(
                "combine outputs have {} and {:?} values; expected [tokens = {t_n}, hidden = {h}] = {} and [tokens, topk = {k}] = {}",
                combined_x.len(),
                combined_w.map(<[f32]>::len),
                t_n * h,
                t_n * k
            ));
        }
        if let Some(w) = args.topk_weights {
            if w.len() != n * k && w.len() != handle.num_rows * k {
                return Err(invalid!(
                    "combine topk_weights has {} values, expected [rows = {n}, topk = {k}]",
                    w.len()
                ));
            }
        }
        for (i, b) in args.bias.iter().enumerate() {
            if let Some(b) = b {
                if b.len() != t_n * h {
                    return Err(invalid!(
                        "combine bias {i} has {} values, expected [tokens = {t_n}, hidden = {h}]",
                        b.len()
                    ));
                }
            }
        }
        Ok(())
    }

    /// Phase 1, send: each received row back towards its source: into the source's
    /// `[this rank][token]` slot on this node, or, for a source on another node, into
    /// the `[source node][this rank][token]` relay slot of the rank of this node that
    /// relays it. Rows this rank reduces itself (its own tokens, and the tokens it
    /// relays) stay in `x`.
    fn send_rows(
        &self,
        areas: &NormalAreas,
        x: &[bf16],
        args: &CombineArgs<'_>,
        handle: &NormalHandle,
        mask: &CallMask,
    ) -> Result<()> {
        let (topo, me, r_n) = (self.topo, self.topo.rank, self.topo.num_ranks);
        let h = areas.shape.hidden;
        let relay = |s: usize| mask.relays.of(s, topo.node);
        // Rows this rank reduces itself (its own, those it relays), and rows for masked
        // sources, go nowhere.
        let stays = |s: usize| {
            s == me || mask.is(s) || (!topo.is_local(s) && relay(s).is_some_and(|r| r.rank == me))
        };
        let mut sinks = Vec::with_capacity(r_n);
        for s in 0..r_n {
            let (rank, slot, relay_area) = match relay(s) {
                _ if topo.is_local(s) && !stays(s) => (s, me, false),
                Some(r) if !stays(s) => (r.rank, relay_slot(topo, s, topo.local), !r.substitute),
                // Masked (a node wholly masked has no relay): nothing goes back to it.
                _ => {
                    sinks.push(ReturnSink::Stays);
                    continue;
                }
            };
            let (x, weights) = slot_rows(areas, slot, relay_area)?;
            sinks.push(ReturnSink::Slot { rank, x, weights });
        }
        let out_rows: usize = (0..r_n)
            .filter(|&s| !stays(s))
            .map(|s| handle.rows_from(me, s).len())
            .sum();
        self.device.normal_combine_send(&NormalCombineSendPhase {
            x,
            topk_weights: args.topk_weights,
            src_rank: &handle.recv_src_rank(me),
            src_idx: &handle.recv_src_idx,
            sinks: &sinks,
            shape: areas.shape,
            streaming: out_rows * h * 2 > STREAM_ABOVE,
            memory: &self.symm,
        })
    }

    /// Phase 2, publish: the epoch into every rank of the node (`combine_done`, and
    /// `relay_done` on several nodes).
    fn publish_rows(&self, seq: u32) -> Result<()> {
        let (topo, c) = (self.topo, &self.map.control);
        let mut stores = Vec::new();
        for s in topo.node_ranks(topo.node) {
            stores.push(Store::at(s, c.combine_done, topo.rank, seq as u64)?);
            if topo.num_nodes > 1 {
                stores.push(Store::at(s, c.relay_done, topo.rank, seq as u64)?);
            }
        }
        self.signal(&stores)
    }

    /// Phase 4, gather: wait for the node's ranks, and for one packet of partial sums
    /// from each other node (partial row `j` of node `m` is this rank's `j`-th token that
    /// went to node `m`); the reduction reads each where it landed.
    fn gather(
        &self,
        seq: u32,
        areas: &NormalAreas,
        handle: &NormalHandle,
        mask: &CallMask,
        wait: &Wait<'_>,
    ) -> Result<Gathered<'_>> {
        let (topo, me, r_n) = (self.topo, self.topo.rank, self.topo.num_ranks);
        let (h, k) = (areas.shape.hidden, areas.shape.topk);
        let what = |src: usize| {
            format!("rank {me}: combine {seq}: waiting for rank {src}'s rows (combine_done[{src}])")
        };
        let words = self.map.control.combine_done;
        let seen = self.node_published(words, seq, &mask.masked, wait, &what)?;
        // The node's ranks (this one among them) published their rows (combine_done =
        // this call's epoch) and write them again only in their next combine, which
        // follows this rank's next dispatch; a relay's packet below is announced (the
        // tail reached it) and its landing area written again only with the relay's next
        // combine packet, after this rank's next combine.
        let published = self.symm.published(&seen);
        let in_rank = &handle.is_token_in_rank;
        let mut packet_row: Vec<Vec<usize>> = vec![Vec::new(); r_n];
        let mut partial_x: Vec<Area<u16>> = vec![Area::default(); r_n];
        let mut partial_w: Vec<&[f32]> = vec![&[]; r_n];
        for m in topo.remote_nodes() {
            let Some(relay) = mask.relays.of(me, m).map(|r| r.rank) else {
                continue;
            };
            let what = || {
                format!("rank {me}: combine {seq}: waiting for node {m}'s partial sums from rank {relay}")
            };
            let landing = self.net()?.recv(Channel::Combine, relay, wait, &what);
            let Some(landing) = self.unless_lost(relay, landing)? else {
                continue;
            };
            // (Meaningless for a token that did not go to node m: never read.)
            let mut j = 0;
            packet_row[relay] = (0..handle.num_tokens)
                .map(|t| {
                    j += in_rank.row(t, r_n)[topo.node_ranks(m)].contains(&true) as usize;
                    j.wrapping_sub(1)
                })
                .collect();
            let p = CombinePacket::layout(j, h, k).at_base(landing.offset());
            partial_x[relay] = p.x;
            partial_w[relay] = published.view(p.weights)?;
        }
        Ok(Gathered {
            published,
            wrows: published.view(areas.combine_weights)?,
            packet_row,
            partial_x,
            partial_w,
        })
    }

    /// Phase 5, reduce: per token, in f32 and rounded once, the rows of this node's
    /// ranks and the partial sum of each other node, in rank order (a node's partial in
    /// the place of the rank that relayed it), then the biases, as the reference does;
    /// the weights summed the same way.
    #[allow(clippy::too_many_arguments)]
    fn reduce(
        &self,
        areas: &NormalAreas,
        handle: &NormalHandle,
        (g, mask): (&Gathered<'_>, &CallMask),
        x: &[bf16],
        args: &CombineArgs<'_>,
        combined_x: &mut [bf16],
        combined_w: Option<&mut [f32]>,
    ) -> Result<()> {
        let me = self.topo.rank;
        let from = Contributions::new(self.topo, handle, g, mask, areas.shape.max_tokens);
        // The sources: `x`, the node's combine rows, each relay's packet, the biases.
        let mut sources = vec![
            Rows::Tensor(x),
            Rows::Symmetric {
                rank: me,
                area: areas.combine_x,
            },
        ];
        let mut packet_source = vec![u32::MAX; self.topo.num_ranks];
        for (r, rows) in g
            .packet_row
            .iter()
            .enumerate()
            .filter(|(_, p)| !p.is_empty())
        {
            debug_assert_eq!(rows.len(), handle.num_tokens);
            packet_source[r] = sources.len() as u32;
            let area = g.partial_x[r];
            sources.push(Rows::Symmetric { rank: me, area });
        }
        let biases = sources.len() as u32;
        sources.extend(args.bias.iter().flatten().map(|b| Rows::Tensor(b)));
        let sources_n = sources.len() as u32;
        let (starts, parts) = Part::csr(handle.num_tokens, |t| {
            let node = from.of(t).map(|place| match place {
                Place::Own(i) => (0, i),
                Place::Node(i) => (1, i),
                Place::Packet(r, j) => (packet_source[r], j),
            });
            node.chain((biases..sources_n).map(move |b| (b, t)))
        });
        let phase = ReducePhase {
            hidden: areas.shape.hidden,
            sources: &sources,
            starts: &starts,
            parts: &parts,
            weighted: false,
            memory: Symmetric::new(&self.symm, g.published),
        };
        self.device.reduce(&phase, combined_x)?;
        if let (Some(out), Some(own_w)) = (combined_w, args.topk_weights) {
            from.sum_weights(g, own_w, areas.shape.topk, out);
        }
        Ok(())
    }
}

/// The slot of the rows local rank `l` returns for source `src` on another node, at
/// the rank that relays them: `[source node][local rank]`.
pub(super) fn relay_slot(topo: Topology, src: usize, l: usize) -> usize {
    topo.node_of(src) * topo.ranks_per_node + l
}

/// Slot `slot`'s rows and weights (`[T, H]`, `[T, K]`): in the relay area, or in the
/// combine area (a same-node rank's slot, or a substitute relay's: `paths`).
pub(super) fn slot_rows(
    areas: &NormalAreas,
    slot: usize,
    relay_area: bool,
) -> Result<(Area<u16>, Area<f32>)> {
    let (h, k, t_max) = (areas.shape.hidden, areas.shape.topk, areas.shape.max_tokens);
    let rows = slot * t_max..(slot + 1) * t_max;
    Ok(match relay_area {
        true => (
            areas.relay_x.rows(rows.clone(), h)?,
            areas.relay_weights.rows(rows, k)?,
        ),
        false => (
            areas.combine_x.rows(rows.clone(), h)?,
            areas.combine_weights.rows(rows, k)?,
        ),
    })
}

/// Where a rank's row (or weights) for one of this rank's tokens came back.
#[derive(Clone, Copy, Debug)]
enum Place {
    /// This rank's own: row `i` of the combine's input.
    Own(usize),
    /// A same-node rank's: row `i` of the node's combine rows (`[R, T]`).
    Node(usize),
    /// Another node's partial sum: row `j` of the packet relayed by rank `r`.
    Packet(usize, usize),
}

/// Which ranks contribute to each of this rank's tokens, and where their rows are.
struct Contributions<'a> {
    topo: Topology,
    handle: &'a NormalHandle,
    mask: &'a CallMask,
    packet_row: &'a [Vec<usize>],
    /// Where this rank's own row for each token is in the combine's input.
    own_row: Vec<usize>,
    t_max: usize,
}

impl<'a> Contributions<'a> {
    fn new(
        topo: Topology,
        handle: &'a NormalHandle,
        g: &'a Gathered<'_>,
        mask: &'a CallMask,
        t_max: usize,
    ) -> Self {
        let mut own_row = vec![usize::MAX; handle.num_tokens];
        for i in handle.rows_from(topo.rank, topo.rank) {
            own_row[handle.recv_src_idx[i] as usize] = i;
        }
        Contributions {
            topo,
            handle,
            mask,
            packet_row: &g.packet_row,
            own_row,
            t_max,
        }
    }

    /// Token `t`'s contributions in rank order: a live same-node rank that got it, and
    /// for each other node where a live rank got it, the rank that relayed that node's
    /// partial sum.
    fn of(&self, t: usize) -> impl Iterator<Item = Place> + '_ {
        let (topo, r_n, mask) = (self.topo, self.topo.num_ranks, self.mask);
        let in_rank = self.handle.is_token_in_rank.row(t, r_n);
        let got = move |r: usize| in_rank[r] && !mask.is(r);
        let contributes = move |r: usize| {
            let m = topo.node_of(r);
            match topo.is_local(r) {
                true => got(r),
                false => {
                    mask.relays.of(topo.rank, m).is_some_and(|x| x.rank == r)
                        && topo.node_ranks(m).any(got)
                }
            }
        };
        (0..r_n).filter(move |&r| contributes(r)).map(move |r| {
            if r == topo.rank {
                Place::Own(self.own_row[t])
            } else if self.packet_row[r].is_empty() {
                Place::Node(r * self.t_max + t)
            } else {
                Place::Packet(r, self.packet_row[r][t])
            }
        })
    }

    /// `out` (`[tokens, k]`) gets each token's weights summed over its contributions.
    fn sum_weights(&self, g: &Gathered<'_>, own_w: &[f32], k: usize, out: &mut [f32]) {
        out.fill(0.0);
        for (t, out_row) in out.chunks_exact_mut(k).enumerate() {
            for place in self.of(t) {
                let w = match place {
                    Place::Own(i) => own_w.row(i, k),
                    Place::Node(i) => g.wrows.row(i, k),
                    Place::Packet(r, j) => g.partial_w[r].row(j, k),
                };
                for (a, &b) in out_row.iter_mut().zip(w) {
                    *a += b;
                }
            }
        }
    }
}
