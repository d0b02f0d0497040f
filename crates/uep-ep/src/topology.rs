//! Where ranks sit: nodes of consecutive ranks, and who relays for whom.

use std::ops::Range;

use crate::error::Result;
use crate::invalid;

/// Widest node the relay handles: a token's destinations inside a node travel as a
/// 64-bit mask.
pub const MAX_RANKS_PER_NODE: usize = 64;

/// Ranks are numbered node by node: rank `r` is local rank `r % L` of node `r / L`.
/// Ranks of one node share memory; ranks of different nodes talk through the proxy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Topology {
    /// This rank.
    pub rank: usize,
    /// Ranks in the job.
    pub num_ranks: usize,
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
    /// `rank` of `num_ranks`, nodes of `ranks_per_node` consecutive ranks.
    pub fn new(rank: usize, num_ranks: usize, ranks_per_node: usize) -> Result<Topology> {
        if ranks_per_node == 0 || num_ranks % ranks_per_node != 0 || rank >= num_ranks {
            return Err(invalid!(
                "rank {rank} of {num_ranks} ranks in nodes of {ranks_per_node}: the ranks per node must divide the ranks"
            ));
        }
        if ranks_per_node > MAX_RANKS_PER_NODE {
            return Err(invalid!(
                "{ranks_per_node} ranks per node: at most {MAX_RANKS_PER_NODE} are supported (a token's destinations inside a node travel as a 64-bit mask)"
            ));
        }
        Ok(Topology {
            rank,
            num_ranks,
            ranks_per_node,
            node: rank / ranks_per_node,
            local: rank % ranks_per_node,
            num_nodes: num_ranks / ranks_per_node,
        })
    }

    /// Nodes from the ranks' hosts (`hosts[r]`: rank `r`'s host id): ranks that share a
    /// host share memory and form a node. Hosts must hold consecutive, equally many
    /// ranks, as launchers place them. `emulate = Some(l)` cuts the ranks into nodes of
    /// `l` instead (to run the multi-node path on one host); such a node must not span
    /// hosts.
    pub fn from_hosts(rank: usize, hosts: &[String], emulate: Option<usize>) -> Result<Topology> {
        let n = hosts.len();
        let per_host = hosts.iter().take_while(|h| **h == hosts[0]).count();
        let uneven = || {
            invalid!(
                "ranks of one host must be consecutive and every host must run the same number of ranks, \
                 but ranks 0..{per_host} run on {:?} and the {n} ranks run on {:?}",
                hosts.first(),
                hosts
            )
        };
        if per_host == 0 || n % per_host != 0 {
            return Err(uneven());
        }
        let mut seen = std::collections::HashSet::new();
        for block in hosts.chunks(per_host) {
            if block.iter().any(|h| *h != block[0]) || !seen.insert(&block[0]) {
                return Err(uneven());
            }
        }
        let l = match emulate {
            Some(l) => {
                if l == 0 || per_host % l != 0 {
                    return Err(invalid!(
                        "emulated nodes of {l} ranks do not fit hosts of {per_host} ranks: a node's ranks must share a host"
                    ));
                }
                l
            }
            None => per_host,
        };
        Topology::new(rank, n, l)
    }

    /// Nodes from the hosts of every rank of `cp`, exchanged over it (collective); see
    /// [`Topology::from_hosts`].
    pub fn discover(
        cp: &dyn uep_bootstrap::ControlPlane,
        emulate: Option<usize>,
    ) -> Result<Topology> {
        let hosts = crate::exchange::all_gather(cp, "host", &uep_bootstrap::host_id())?;
        Topology::from_hosts(cp.rank(), &hosts, emulate)
    }

    /// The ranks of node `m`.
    pub fn node_ranks(self, m: usize) -> Range<usize> {
        m * self.ranks_per_node..(m + 1) * self.ranks_per_node
    }

    /// The node of rank `r`.
    pub fn node_of(self, r: usize) -> usize {
        r / self.ranks_per_node
    }

    /// Whether rank `r` is on this rank's node.
    pub fn is_local(self, r: usize) -> bool {
        self.node_of(r) == self.node
    }

    /// Every node but this rank's.
    pub fn remote_nodes(self) -> impl Iterator<Item = usize> {
        (0..self.num_nodes).filter(move |&m| m != self.node)
    }

    /// Bit `l` set for each local rank `l` of node `m` (rank `m * L + l`) that `pick`
    /// names: a token's destinations inside a node, as a packet carries them.
    pub fn local_bits(self, m: usize, pick: impl Fn(usize) -> bool) -> u64 {
        (self.node_ranks(m).enumerate())
            .filter(|&(_, r)| pick(r))
            .fold(0, |acc, (l, _)| acc | 1 << l)
    }

    /// The rank of node `m` with `r`'s local index: it relays `r`'s tokens inside `m`
    /// (and returns `m`'s partial sums to `r`), as DeepEP pairs RDMA peers by local rank.
    pub fn relay(self, r: usize, m: usize) -> usize {
        m * self.ranks_per_node + r % self.ranks_per_node
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hosts(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn nodes_come_from_hosts() {
        let h = hosts(&["a", "a", "b", "b"]);
        let t = Topology::from_hosts(3, &h, None).unwrap();
        assert_eq!(
            (t.ranks_per_node, t.num_nodes, t.node, t.local),
            (2, 2, 1, 1)
        );
        assert_eq!(t.relay(0, 1), 2);
        assert!(t.is_local(2) && !t.is_local(1));
        assert_eq!(t.remote_nodes().collect::<Vec<_>>(), vec![0]);
        // One host, emulated nodes.
        let one = hosts(&["a"; 6]);
        let t = Topology::from_hosts(4, &one, Some(3)).unwrap();
        assert_eq!((t.num_nodes, t.node, t.local), (2, 1, 1));
        let t = Topology::from_hosts(4, &one, None).unwrap();
        assert_eq!(t.num_nodes, 1);
    }

    #[test]
    fn odd_placements_are_rejected() {
        let err = |h: &[&str], e| {
            Topology::from_hosts(0, &hosts(h), e)
                .unwrap_err()
                .to_string()
        };
        assert!(err(&["a", "b", "a", "b"], None).contains("consecutive"));
        assert!(err(&["a", "a", "b"], None).contains("same number"));
        assert!(err(&["a", "a", "b", "a"], None).contains("consecutive"));
        assert!(err(&["a", "a", "b", "b"], Some(4)).contains("share a host"));
        assert!(Topology::new(0, 130, 65)
            .unwrap_err()
            .to_string()
            .contains("64-bit mask"));
        assert!(Topology::new(0, 6, 4).is_err());
    }
}
