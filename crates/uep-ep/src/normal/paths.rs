//! Which rank relays each source's tokens into each other node, under a call's mask.
//!
//! With nobody masked, the relay of source `s` in node `m` is the rank of `m` with
//! `s`'s local index ([`Topology::relay`]), as DeepEP pairs RDMA peers. In elastic mode
//! that rank may be masked; then a live rank of `m` *substitutes* for it. Every
//! survivor derives the same table from the same agreed mask, so senders and relays
//! pair up without a message. A substitute keeps the source's combine rows in the
//! slots of its combine area that same-node ranks never use (those of the source's
//! node), so it relays at most one substitute source per node; a node with more masked
//! ranks than that allows cannot be relayed into, and the call says so.

use crate::error::Result;
use crate::invalid;
use crate::topology::Topology;

/// The rank that relays a source into a node.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Relay {
    /// The relaying rank.
    pub rank: usize,
    /// A live rank standing in for the masked one with the source's local index: its
    /// combine rows for the source are in `combine_x`, not `relay_x`.
    pub substitute: bool,
}

/// The mask one normal call works with (the same on every survivor) and its relays.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct CallMask {
    /// `[R]`: masked ranks: sent nothing, waited for by nobody.
    pub masked: Vec<bool>,
    /// Who relays what under it.
    pub relays: Relays,
}

impl CallMask {
    /// The call's mask `masked` (`[R]`).
    pub(crate) fn new(topo: Topology, masked: Vec<bool>) -> Result<CallMask> {
        let relays = Relays::new(topo, &masked)?;
        Ok(CallMask { masked, relays })
    }

    /// Whether rank `r` is masked.
    pub(crate) fn is(&self, r: usize) -> bool {
        self.masked[r]
    }
}

/// The relays of every (source, node) pair under one mask.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Relays {
    topo: Topology,
    /// `[src * nodes + node]`: `None` where `src` is masked, on `node`, or `node` has no
    /// live rank.
    table: Vec<Option<Relay>>,
}

impl Relays {
    /// The relays under `masked` (`[R]`; empty: nobody masked).
    pub(crate) fn new(topo: Topology, masked: &[bool]) -> Result<Relays> {
        let is_masked = |r: usize| masked.get(r).copied().unwrap_or(false);
        let nodes = topo.num_nodes;
        let mut table = vec![None; topo.num_ranks * nodes];
        for m in 0..nodes {
            let live: Vec<usize> = topo.node_ranks(m).filter(|&r| !is_masked(r)).collect();
            for source_node in (0..nodes).filter(|&n| n != m) {
                let mut subs = live.iter();
                for s in topo.node_ranks(source_node).filter(|&s| !is_masked(s)) {
                    let natural = topo.relay(s, m);
                    let relay = match is_masked(natural) {
                        false => Relay {
                            rank: natural,
                            substitute: false,
                        },
                        true if live.is_empty() => continue,
                        true => Relay {
                            rank: *subs.next().ok_or_else(|| too_few(topo, m, &live))?,
                            substitute: true,
                        },
                    };
                    table[s * nodes + m] = Some(relay);
                }
            }
        }
        Ok(Relays { topo, table })
    }

    /// The relay of `src` into node `m` (`None`: nothing goes there).
    pub(crate) fn of(&self, src: usize, m: usize) -> Option<Relay> {
        self.table[src * self.topo.num_nodes + m]
    }

    /// The sources on other nodes that `relay` relays into its node, ascending.
    pub(crate) fn sources(&self, relay: usize) -> impl Iterator<Item = usize> + '_ {
        let m = self.topo.node_of(relay);
        (0..self.topo.num_ranks).filter(move |&s| self.of(s, m).is_some_and(|r| r.rank == relay))
    }
}

fn too_few(topo: Topology, m: usize, live: &[usize]) -> crate::error::EpError {
    invalid!(
        "node {m} has {} live ranks of {}: too few to relay for every live source of another \
         node (each live rank relays at most one more), so normal mode cannot reach it",
        live.len(),
        topo.ranks_per_node
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn topo(rank: usize, nodes: usize, per_node: usize) -> Topology {
        Topology::new(rank, nodes * per_node, per_node).unwrap()
    }

    #[test]
    fn nobody_masked_pairs_local_indices() {
        let t = topo(0, 3, 4);
        let relays = Relays::new(t, &[]).unwrap();
        for s in 0..12 {
            for m in (0..3).filter(|&m| m != s / 4) {
                let r = relays.of(s, m).unwrap();
                assert_eq!((r.rank, r.substitute), (t.relay(s, m), false));
            }
            assert_eq!(relays.of(s, s / 4), None);
        }
        assert_eq!(relays.sources(5).collect::<Vec<_>>(), vec![1, 9]);
    }

    #[test]
    fn a_masked_relay_is_substituted_once_per_source_node() {
        let t = topo(0, 2, 4);
        let mut masked = vec![false; 8];
        masked[5] = true;
        masked[6] = true;
        let relays = Relays::new(t, &masked).unwrap();
        // Sources 1 and 2 lost their relays 5 and 6; 4 and 7 stand in, one each.
        let subs: Vec<_> = [1, 2].iter().map(|&s| relays.of(s, 1).unwrap()).collect();
        assert!(subs.iter().all(|r| r.substitute));
        assert_eq!(subs.iter().map(|r| r.rank).collect::<Vec<_>>(), vec![4, 7]);
        assert_eq!(relays.sources(4).collect::<Vec<_>>(), vec![0, 1]);
        // Masked sources have no relay; the masked ranks relay nothing.
        assert_eq!(relays.of(5, 0), None);
        assert_eq!(relays.sources(5).count(), 0);
        // Node 0's sources into node 1 all still have one.
        assert!((0..4).all(|s| relays.of(s, 1).is_some()));
    }

    #[test]
    fn too_many_masked_in_a_node_is_refused_and_a_dead_node_gets_nothing() {
        let t = topo(0, 2, 4);
        let mut masked = vec![false; 8];
        for r in [4, 5, 6] {
            masked[r] = true;
        }
        assert!(Relays::new(t, &masked).is_err());
        masked[7] = true;
        let relays = Relays::new(t, &masked).unwrap();
        assert!((0..4).all(|s| relays.of(s, 1).is_none()));
    }
}
