//! The relay: how normal mode crosses nodes, as DeepEP's internode kernels do.
//!
//! A token crosses the network once per destination node, to the rank there with its
//! source's local index (the *relay*). Dispatch: the relay stores the packet's tokens
//! into the output rows of its node's ranks named in each token's mask, in the order the
//! one-node path gives them, and publishes the source to them. Combine: the node's ranks
//! write their rows for the source's tokens into the relay's slots; the relay reduces
//! them and sends one partial row per token back.

use std::sync::atomic::Ordering;

use half::bf16;
use uep_shm::Region;

use super::combine::relay_slot;
use super::paths::CallMask;
use super::{column_sum, CombineArgs, NormalHandle, Relayed, WeightLanes};
use crate::area::{Area, Mem, SliceRows};
use crate::ctx::Ctx;
use crate::error::Result;
use crate::layout::localize;
use crate::map::{NormalAreas, NormalBank};
use crate::packet::{Channel, CombinePacket, DispatchHeader, DispatchPacket, RowFormat};
use crate::protocol;
use crate::quant::reduce_rows;
use crate::symm::Published;
use crate::wait::Wait;

/// A dispatch packet to relay, read and checked.
struct RelayPacket {
    src: usize,
    head: DispatchHeader,
    fmt: RowFormat,
    p: DispatchPacket,
    /// `[n, K]` global expert ids.
    idx: Vec<i64>,
    /// `[n, K]` weights.
    weights: Vec<f32>,
    /// `[n]` source token index.
    tokens: Vec<i32>,
    /// `[n]` local ranks that need each token.
    masks: Vec<u64>,
}

impl RelayPacket {
    /// Token `j`'s ids (made local to rank `r`, of `epr` experts a rank), weights and
    /// source index into row `at` of `r`'s outputs in `region`; `scratch` holds a row of ids and weights.
    fn put_meta(
        &self,
        region: &Region,
        areas: &NormalAreas,
        bank: &NormalBank,
        (j, at, r, epr): (usize, usize, usize, usize),
        scratch: &mut (Vec<i64>, Vec<f32>),
    ) -> Result<()> {
        let k = areas.shape.topk;
        if self.fmt.topk > 0 {
            let w = (self.fmt.weights > 0).then(|| self.weights.row(j, k));
            let lanes = match self.head.has(DispatchHeader::ALL_LANES) {
                true => WeightLanes::All,
                false => WeightLanes::Local,
            };
            localize(
                self.idx.row(j, k),
                (w, lanes),
                r,
                epr,
                &mut scratch.0,
                &mut scratch.1,
            );
            region.put(bank.recv_topk_idx.row(at, k)?, &scratch.0)?;
            if self.fmt.weights > 0 {
                region.put(bank.recv_topk_weights.row(at, k)?, &scratch.1)?;
            }
        }
        region.put(areas.recv_src_idx.row(at, 1)?, &self.tokens[j..j + 1])
    }
}

impl Ctx {
    /// Dispatch phase 5: take the packet of each rank on another node that has this
    /// rank's local index, and store each token into the output rows of the ranks of this
    /// node its mask names (source rank ascending, token order kept); then publish the
    /// source to them. Everything in a packet is checked before it is used.
    pub(super) fn relay_dispatch(
        &self,
        seq: u32,
        areas: &NormalAreas,
        matrix: &[u32],
        mask: &CallMask,
        wait: &Wait<'_>,
    ) -> Result<Vec<Relayed>> {
        let me = self.topo.rank;
        let mut relayed = Vec::new();
        for src in mask.relays.sources(me) {
            let landing = self.net()?.recv(Channel::Dispatch, src, wait, &|| {
                format!("rank {me}: dispatch {seq}: waiting for rank {src}'s tokens to relay")
            });
            let Some(landing) = self.unless_lost(src, landing)? else {
                // Lost: the call runs again; publish, so that nobody waits for it.
                self.publish_relayed(seq, src, None)?;
                continue;
            };
            let packet = self.open_relay_packet(src, landing, areas, matrix)?;
            self.store_relayed(seq, &packet, areas, matrix)?;
            relayed.push(Relayed {
                src,
                tokens: packet.tokens,
                masks: packet.masks,
            });
        }
        Ok(relayed)
    }

    /// Reads and checks the header of `src`'s dispatch packet in `landing`, and its
    /// per-token sections.
    fn open_relay_packet(
        &self,
        src: usize,
        landing: Area<u8>,
        areas: &NormalAreas,
        matrix: &[u32],
    ) -> Result<RelayPacket> {
        let (r_n, me) = (self.topo.num_ranks, self.topo.rank);
        let (h, k, t_max) = (areas.shape.hidden, areas.shape.topk, areas.shape.max_tokens);
        let local = self.symm.local();
        let mut head = [DispatchHeader::default()];
        local.get(landing.prefix(16)?.cast(), &mut head)?;
        let head = head[0];
        let n = head.tokens as usize;
        if n > t_max {
            return Err(protocol!(
                "rank {me}: rank {src}'s dispatch packet announces {n} tokens, more than num_max_dispatch_tokens_per_rank = {t_max}"
            ));
        }
        let n_direct = head.direct_tokens();
        let mine = matrix[src * r_n + me] as usize;
        if head.has(DispatchHeader::DIRECT) && n_direct != mine || n_direct > n {
            return Err(protocol!(
                "rank {me}: rank {src}'s dispatch packet says {n_direct} of its {n} tokens came straight here; its counts announced {mine}"
            ));
        }
        let fp8 = head.has(DispatchHeader::FP8);
        let (topk, weights) = (
            head.has(DispatchHeader::TOPK),
            head.has(DispatchHeader::WEIGHTS),
        );
        let fmt = RowFormat {
            row_bytes: if fp8 { h } else { 2 * h },
            groups: if fp8 { h / 128 } else { 0 },
            topk: if topk { k } else { 0 },
            weights: if weights { k } else { 0 },
        };
        let p = DispatchPacket::layout(n, n_direct, fmt).at_base(landing.offset());
        if p.len > landing.len() {
            return Err(protocol!(
                "rank {me}: rank {src}'s dispatch packet of {} bytes overflows its {}-byte landing area",
                p.len,
                landing.len()
            ));
        }
        Ok(RelayPacket {
            src,
            head,
            fmt,
            p,
            idx: local.get_vec(p.topk_idx)?,
            weights: local.get_vec(p.weights)?,
            tokens: local.get_vec(p.src)?,
            masks: local.get_vec(p.mask)?,
        })
    }

    /// Stores every token of `packet` into the output rows of the ranks of this node
    /// its mask names, checking it against the counts the source announced, then
    /// publishes the source to them.
    fn store_relayed(
        &self,
        seq: u32,
        packet: &RelayPacket,
        areas: &NormalAreas,
        matrix: &[u32],
    ) -> Result<()> {
        let topo = self.topo;
        let (r_n, me) = (topo.num_ranks, topo.rank);
        let k = areas.shape.topk;
        let epr = areas.shape.experts_per_rank(r_n);
        let local = self.symm.local();
        let bank = areas.bank(seq);
        let RelayPacket {
            src, head, fmt, p, ..
        } = *packet;
        let (tokens, masks) = (&packet.tokens, &packet.masks);
        let (n, n_direct) = (head.tokens as usize, head.direct_tokens());
        let row_bytes = fmt.row_bytes;
        let fp8 = fmt.groups > 0;
        // Rows from `src` start, on each rank of this node, after those of ranks 0..src.
        let start = |r: usize| column_sum(matrix, r_n, src, r);
        let mut pos: Vec<usize> = topo.node_ranks(topo.node).map(start).collect();
        let mut scratch = (vec![0i64; k], vec![0f32; k]);
        // Rows of the packet that went to none but this rank are not in it.
        let mut rest = 0;
        for j in 0..n {
            check_mask(masks[j], tokens[j], topo, src)?;
            let direct_here = head.has(DispatchHeader::DIRECT) && masks[j] >> topo.local & 1 != 0;
            // Where the token's x row (and scales) is: in this rank's own output rows
            // when it went straight there, else the next row of the packet.
            let (x_at, scales_at) = if direct_here {
                let at = pos[topo.local];
                (
                    bank.recv_x.row(at, row_bytes)?,
                    bank.recv_scales.row(at, fmt.groups)?,
                )
            } else {
                rest += 1;
                (
                    p.x.row(rest - 1, row_bytes)?,
                    p.scales.row(rest - 1, fmt.groups)?,
                )
            };
            for (l, r) in topo.node_ranks(topo.node).enumerate() {
                if masks[j] >> l & 1 == 0 {
                    continue;
                }
                let region = self.peer_region(r)?;
                let at = pos[l];
                pos[l] += 1;
                if at >= start(r) + matrix[src * r_n + r] as usize {
                    return Err(protocol!(
                        "rank {me}: rank {src}'s dispatch packet sends rank {r} more tokens than its counts announced ({})",
                        matrix[src * r_n + r]
                    ));
                }
                // (This rank's own rows went straight into place, unless unaligned.)
                if !(l == topo.local && direct_here) {
                    region.copy(bank.recv_x.row(at, row_bytes)?, local, x_at)?;
                    if fp8 {
                        region.copy(bank.recv_scales.row(at, fmt.groups)?, local, scales_at)?;
                    }
                }
                packet.put_meta(region, areas, bank, (j, at, r, epr), &mut scratch)?;
            }
        }
        if rest != n - n_direct {
            return Err(protocol!(
                "rank {me}: rank {src}'s dispatch packet carries {} rows for other ranks, but its masks name {rest}",
                n - n_direct
            ));
        }
        self.publish_relayed(seq, src, Some((matrix, &pos)))
    }

    /// After storing `src`'s packet: check that each rank of this node got as many
    /// tokens as `src`'s counts announced (`pos[l]`: one past its last row), and publish
    /// `src` to each of them.
    /// (`None`: `src` was lost, and its rows are not checked.)
    fn publish_relayed(
        &self,
        seq: u32,
        src: usize,
        stored: Option<(&[u32], &[usize])>,
    ) -> Result<()> {
        let (topo, me, r_n) = (self.topo, self.topo.rank, self.topo.num_ranks);
        for (l, r) in topo.node_ranks(topo.node).enumerate() {
            if let Some((matrix, pos)) = stored {
                let (start, announced) = (
                    column_sum(matrix, r_n, src, r),
                    matrix[src * r_n + r] as usize,
                );
                if pos[l] != start + announced {
                    return Err(protocol!(
                        "rank {me}: rank {src}'s dispatch packet sends rank {r} {} tokens, but its counts announced {announced}",
                        pos[l] - start
                    ));
                }
            }
            self.peer_region(r)?
                .word(self.map.control.dispatch_done, src)?
                .store(seq as u64, Ordering::Release);
        }
        Ok(())
    }

    /// This rank's memory once every live rank of the node published the rows it left
    /// here to relay in combine `seq`.
    fn relay_rows(&self, seq: u32, mask: &CallMask, wait: &Wait<'_>) -> Result<Published<'_>> {
        let me = self.topo.rank;
        let what = |r: usize| {
            format!(
                "rank {me}: combine {seq}: waiting for rank {r}'s rows to relay (relay_done[{r}])"
            )
        };
        let words = self.map.control.relay_done;
        let seen = self.node_published(words, seq, &mask.masked, wait, &what)?;
        // Every live rank of the node (this one among them) published (relay_done = this
        // call's epoch) that its relay rows are written; they write them again only in
        // their next combine, which needs this rank's next combine packet, sent only
        // after this call.
        Ok(self.symm.published(&seen))
    }

    /// Combine phase 3, on the relaying rank: for each source it relays (`relayed`),
    /// once every live rank of this node has written its rows for it, reduce each
    /// token's rows of the live ranks (in f32, rank order, rounded once to bf16, as
    /// [`reduce_rows`]) and send the node's partial sums to the source in one packet.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn relay_combine(
        &self,
        seq: u32,
        areas: &NormalAreas,
        (handle, relayed): (&NormalHandle, &[Relayed]),
        x: &[bf16],
        args: &CombineArgs<'_>,
        mask: &CallMask,
        wait: &Wait<'_>,
    ) -> Result<()> {
        let topo = self.topo;
        if topo.num_nodes == 1 {
            return Ok(());
        }
        let (me, rpn) = (topo.rank, topo.ranks_per_node);
        let (h, k, t_max) = (areas.shape.hidden, areas.shape.topk, areas.shape.max_tokens);
        let published = self.relay_rows(seq, mask, wait)?;
        let live = topo.local_bits(topo.node, |r| !mask.is(r));
        let x_bits: &[u16] = bytemuck::cast_slice(x);
        let mut w_out = vec![0f32; k];
        let mut parts = Vec::with_capacity(rpn);
        let mut mine = vec![usize::MAX; t_max];
        for relayed in relayed {
            let src = relayed.src;
            // This rank's own row for each of `src`'s tokens, in `x`.
            for i in handle.rows_from(me, src) {
                mine[handle.recv_src_idx[i] as usize] = i;
            }
            // A substitute relay's slots are in the combine area (`paths`).
            let substitute = mask.relays.of(src, topo.node).is_some_and(|r| r.substitute);
            let (rows, wrows) = match substitute {
                false => (areas.relay_x, areas.relay_weights),
                true => (areas.combine_x, areas.combine_weights),
            };
            let (rows, wrows) = (published.view(rows)?, published.view(wrows)?);
            let Some(mut staged) = self.stage_unless_lost(Channel::Combine, src, wait)? else {
                continue;
            };
            let n = relayed.tokens.len();
            let p = CombinePacket::layout(n, h, k).at_base(staged.area.offset());
            let packet_x: &mut [u16] = staged.view_mut(p.x)?;
            // Slot of (source node, local rank l) for token t.
            let slot = |l: usize, t: usize| relay_slot(topo, src, l) * t_max + t;
            for (j, (&t, &m)) in relayed.tokens.iter().zip(&relayed.masks).enumerate() {
                let t = t as usize;
                let ls = (0..rpn).filter(|&l| (m & live) >> l & 1 != 0);
                parts.clear();
                parts.extend(ls.clone().map(|l| {
                    let row = match l == topo.local {
                        true => x_bits.row(mine[t], h),
                        false => rows.row(slot(l, t), h),
                    };
                    (row, 1.0)
                }));
                let out = packet_x.row_mut(j, h);
                reduce_rows(&parts, false, bytemuck::cast_slice_mut(out));
                if let Some(own_w) = args.topk_weights {
                    w_out.fill(0.0);
                    for l in ls {
                        let w = match l == topo.local {
                            true => own_w.row(mine[t], k),
                            false => wrows.row(slot(l, t), k),
                        };
                        for (a, &b) in w_out.iter_mut().zip(w) {
                            *a += b;
                        }
                    }
                    self.symm.local().put(p.weights.row(j, k)?, &w_out)?;
                }
            }
            let sent = self.net()?.send(staged, p.len, &[]);
            self.unless_lost(src, sent)?;
        }
        Ok(())
    }
}

/// A relayed token's mask of this node's ranks: not empty, and naming no rank past the
/// node's.
fn check_mask(mask: u64, token: i32, topo: crate::topology::Topology, src: usize) -> Result<()> {
    let me = topo.rank;
    if mask.checked_shr(topo.ranks_per_node as u32).unwrap_or(0) != 0 {
        return Err(protocol!(
            "rank {me}: rank {src}'s dispatch packet names local ranks {mask:#x} of a node of {}",
            topo.ranks_per_node
        ));
    }
    if mask == 0 {
        return Err(protocol!(
            "rank {me}: rank {src}'s dispatch packet carries token {token} for no rank"
        ));
    }
    Ok(())
}
