//! The relay: how normal mode crosses nodes, as DeepEP's internode kernels do.
//!
//! A token crosses the network once per destination node, to the rank there with its
//! source's local index (the *relay*). Dispatch: the relay stores the packet's tokens
//! into the output rows of its node's ranks named in each token's mask, in the order the
//! one-node path gives them, and publishes the source to them. Combine: the node's ranks
//! write their rows for the source's tokens into the relay's slots; the relay reduces
//! them and sends one partial row per token back.

use half::bf16;

use super::combine::relay_slot;
use super::paths::CallMask;
use super::{column_sum, CombineArgs, NormalHandle, Relayed, WeightLanes};
use crate::area::{Area, Mem, SliceRows};
use crate::ctx::Ctx;
use crate::device::normal::{RelayedRow, NOT_SENT};
use crate::device::{Part, ReducePhase, RelayPhase, Rows, Store, Symmetric};
use crate::error::Result;
use crate::map::NormalAreas;
use crate::packet::{Channel, CombinePacket, DispatchHeader, DispatchPacket, RowFormat};
use crate::protocol;
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
                self.publish_relayed(seq, src)?;
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
    /// its mask names (the device's relay phase, over rows the host placed and checked
    /// against the counts the source announced), then publishes the source to them.
    fn store_relayed(
        &self,
        seq: u32,
        packet: &RelayPacket,
        areas: &NormalAreas,
        matrix: &[u32],
    ) -> Result<()> {
        let (from, rows) = self.place_relayed(packet, matrix)?;
        let lanes = match packet.head.has(DispatchHeader::ALL_LANES) {
            true => WeightLanes::All,
            false => WeightLanes::Local,
        };
        let phase = RelayPhase {
            packet: packet.p,
            fmt: packet.fmt,
            lanes,
            idx: &packet.idx,
            weights: &packet.weights,
            tokens: &packet.tokens,
            from: &from,
            rows: &rows,
            bank: *areas.bank(seq),
            recv_src_idx: areas.recv_src_idx,
            topo: self.topo,
            shape: areas.shape,
            memory: &self.symm,
        };
        self.device.relay(&phase)?;
        self.publish_relayed(seq, packet.src)
    }

    /// Where each token of `packet` is read from and, `[n, ranks per node]`, its row at
    /// each rank of this node (rows from a source start, on each rank, after those of
    /// the ranks before it; token order kept), every mask and count checked against
    /// what the source announced.
    fn place_relayed(
        &self,
        packet: &RelayPacket,
        matrix: &[u32],
    ) -> Result<(Vec<RelayedRow>, Vec<u32>)> {
        let topo = self.topo;
        let (r_n, me, rpn) = (topo.num_ranks, topo.rank, topo.ranks_per_node);
        let RelayPacket { src, head, .. } = *packet;
        let (n, n_direct) = (head.tokens as usize, head.direct_tokens());
        let direct = head.has(DispatchHeader::DIRECT);
        let start = |r: usize| column_sum(matrix, r_n, src, r);
        let end = |r: usize| start(r) + matrix[src * r_n + r] as usize;
        let mut pos: Vec<usize> = topo.node_ranks(topo.node).map(start).collect();
        let (mut from, mut rows) = (Vec::with_capacity(n), vec![NOT_SENT; n * rpn]);
        // Rows of the packet that went to none but this rank are not in it.
        let mut rest = 0;
        for (j, (&m, &token)) in packet.masks.iter().zip(&packet.tokens).enumerate() {
            check_mask(m, token, topo, src)?;
            from.push(match direct && m >> topo.local & 1 != 0 {
                true => RelayedRow::Own,
                false => {
                    rest += 1;
                    RelayedRow::Packet(rest - 1)
                }
            });
            for (l, r) in topo.node_ranks(topo.node).enumerate() {
                if m >> l & 1 == 0 {
                    continue;
                }
                if pos[l] >= end(r) {
                    return Err(protocol!(
                        "rank {me}: rank {src}'s dispatch packet sends rank {r} more tokens than its counts announced ({})",
                        matrix[src * r_n + r]
                    ));
                }
                rows[j * rpn + l] = pos[l] as u32;
                pos[l] += 1;
            }
        }
        if rest as usize != n - n_direct {
            return Err(protocol!(
                "rank {me}: rank {src}'s dispatch packet carries {} rows for other ranks, but its masks name {rest}",
                n - n_direct
            ));
        }
        for (l, r) in topo.node_ranks(topo.node).enumerate() {
            if pos[l] != end(r) {
                return Err(protocol!(
                    "rank {me}: rank {src}'s dispatch packet sends rank {r} {} tokens, but its counts announced {}",
                    pos[l] - start(r),
                    matrix[src * r_n + r]
                ));
            }
        }
        Ok((from, rows))
    }

    /// Publish `src`'s relayed rows of dispatch `seq` to each rank of this node (once
    /// stored, or when `src` was lost, so that nobody waits for them).
    fn publish_relayed(&self, seq: u32, src: usize) -> Result<()> {
        let done = self.map.control.dispatch_done;
        let stores = (self.topo.node_ranks(self.topo.node))
            .map(|r| Store::at(r, done, src, seq as u64))
            .collect::<Result<Vec<_>>>()?;
        self.signal(&stores)
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
    /// [`crate::quant::reduce_rows`], on the device) and send the node's partial sums
    /// to the source in one packet.
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
            let Some(mut staged) = self.stage_unless_lost(Channel::Combine, src, wait)? else {
                continue;
            };
            let n = relayed.tokens.len();
            let p = CombinePacket::layout(n, h, k).at_base(staged.area.offset());
            // Slot of (source node, local rank l) for token t.
            let slot = move |l: usize, t: usize| relay_slot(topo, src, l) * t_max + t;
            // Per token, the live ranks of its mask in rank order: this rank's row is
            // in `x` (source 0), the others' in this rank's slots (source 1).
            let mine = &mine;
            let places = move |j: usize| {
                let (t, m) = (relayed.tokens[j] as usize, relayed.masks[j] & live);
                (0..rpn)
                    .filter(move |&l| m >> l & 1 != 0)
                    .map(move |l| match l == topo.local {
                        true => (0, mine[t]),
                        false => (1, slot(l, t)),
                    })
            };
            let (starts, parts) = Part::csr(n, places);
            let sources = [
                Rows::Tensor(x),
                Rows::Symmetric {
                    rank: me,
                    area: rows,
                },
            ];
            let phase = ReducePhase {
                hidden: h,
                sources: &sources,
                starts: &starts,
                parts: &parts,
                weighted: false,
                memory: Symmetric::new(&self.symm, published),
            };
            let packet_x: &mut [u16] = staged.view_mut(p.x)?;
            self.device
                .reduce(&phase, bytemuck::cast_slice_mut(packet_x))?;
            if let Some(own_w) = args.topk_weights {
                let w = summed_weights((&starts, &parts), [own_w, published.view(wrows)?], k);
                self.symm.local().put(p.weights, &w)?;
            }
            let sent = self.net()?.send(staged, p.len, &[]);
            self.unless_lost(src, sent)?;
        }
        Ok(())
    }
}

/// `[n, K]` each token's weights summed in f32 over its parts, in order, as the rows
/// are (`sources`: the weights of the reduction's two sources, `[rows, K]`).
fn summed_weights((starts, parts): (&[u32], &[Part]), sources: [&[f32]; 2], k: usize) -> Vec<f32> {
    let mut out = vec![0f32; (starts.len().saturating_sub(1)) * k];
    for (j, ends) in starts.windows(2).enumerate() {
        let sum = out.row_mut(j, k);
        for p in &parts[ends[0] as usize..ends[1] as usize] {
            let w = sources[p.source as usize].row(p.row as usize, k);
            for (a, &b) in sum.iter_mut().zip(w) {
                *a += b;
            }
        }
    }
    out
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
