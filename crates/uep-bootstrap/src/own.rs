//! A group of uep's own, formed through another control plane.
//!
//! A framework's process group (the caller's `torch.distributed` group, an MPI
//! communicator) is where ranks already meet; but a collective of uep's on it can pair
//! with one of the caller's when a rank fails between them, and it waits for as long as
//! the framework's timeout (30 minutes for a torch group). So uep uses the caller's
//! control plane once, when a Buffer is made, to agree on a rendezvous: rank 0 listens
//! on a fresh port with a fresh secret and tells the others where, through one
//! `all_gather`; they join it ([`Group`]: authenticated, a star through rank 0, uep's
//! own deadline on every collective, a failed rank failing everyone's next one). Every
//! later exchange goes through that group, never through the caller's.

use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use crate::control::ControlPlane;
use crate::env::WorldInfo;
use crate::error::BootstrapError;
use crate::group::{alone, Group};
use crate::launcher::EnvSource;
use crate::proto;

/// The first line of rank 0's invitation (and its version).
const INVITATION: &str = "uep-own-group/1";
/// How long a joiner tries one of rank 0's addresses before the next.
const PROBE: Duration = Duration::from_millis(500);
/// The environment variable that names rank 0's address for its invitation, first.
const ADDR_VAR: &str = "MASTER_ADDR";

/// Where rank 0 listens, as its invitation says.
#[derive(Debug, PartialEq, Eq)]
struct Invitation {
    port: u16,
    secret: String,
    addrs: Vec<IpAddr>,
}

impl Invitation {
    fn encode(&self) -> Vec<u8> {
        let addrs: Vec<String> = self.addrs.iter().map(IpAddr::to_string).collect();
        format!(
            "{INVITATION}\n{}\n{}\n{}",
            self.port,
            self.secret,
            addrs.join(" ")
        )
        .into_bytes()
    }

    fn decode(bytes: &[u8]) -> Result<Invitation, BootstrapError> {
        let bad = || {
            BootstrapError::InconsistentWorld(
                "rank 0's invitation to uep's own group is malformed (different uep versions?)"
                    .into(),
            )
        };
        let text = std::str::from_utf8(bytes).map_err(|_| bad())?;
        let mut lines = text.split('\n');
        if lines.next() != Some(INVITATION) {
            return Err(bad());
        }
        let port = lines.next().and_then(|p| p.parse().ok()).ok_or_else(bad)?;
        let secret = lines.next().ok_or_else(bad)?.to_string();
        let addrs = (lines.next().ok_or_else(bad)?.split(' '))
            .filter(|a| !a.is_empty())
            .map(|a| a.parse().map_err(|_| bad()))
            .collect::<Result<_, _>>()?;
        Ok(Invitation {
            port,
            secret,
            addrs,
        })
    }
}

/// Rank 0's addresses, most likely reachable first: `MASTER_ADDR` (the launcher's
/// choice), then every interface's, loopback last.
fn own_addrs() -> Vec<IpAddr> {
    let mut addrs: Vec<IpAddr> = std::env::var(ADDR_VAR)
        .ok()
        .and_then(|a| std::net::ToSocketAddrs::to_socket_addrs(&(a.as_str(), 0)).ok())
        .into_iter()
        .flatten()
        .map(|s| s.ip())
        .collect();
    let mut ifaces: Vec<IpAddr> = if_addrs::get_if_addrs()
        .map(|v| v.into_iter().map(|i| i.ip()).collect())
        .unwrap_or_default();
    ifaces.sort_by_key(|ip| (ip.is_loopback(), ip.is_ipv6()));
    for ip in ifaces {
        if !addrs.contains(&ip) {
            addrs.push(ip);
        }
    }
    if addrs.is_empty() {
        addrs.push(IpAddr::V4(Ipv4Addr::LOCALHOST));
    }
    addrs
}

/// The first of rank 0's addresses that accepts a connection.
fn reachable(inv: &Invitation, timeout: Duration) -> Result<IpAddr, BootstrapError> {
    let deadline = Instant::now() + timeout;
    let mut attempts = 0;
    loop {
        let mut last = String::new();
        for &ip in &inv.addrs {
            attempts += 1;
            match TcpStream::connect_timeout(&SocketAddr::new(ip, inv.port), PROBE) {
                Ok(_) => return Ok(ip),
                Err(e) => last = format!("{ip}: {e}"),
            }
        }
        if Instant::now() >= deadline {
            return Err(BootstrapError::ConnectTimeout {
                addr: format!("{:?} port {}", inv.addrs, inv.port),
                timeout,
                attempts,
                last,
            });
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

impl Group {
    /// Forms a group of uep's own through `caller`'s one `all_gather` (see the module
    /// docs): every rank of `caller` must call it at the same point. `timeout` bounds the
    /// forming and becomes every later collective's timeout.
    pub fn form_over(
        caller: &dyn ControlPlane,
        timeout: Duration,
    ) -> Result<Group, BootstrapError> {
        let (rank, world_size) = (caller.rank(), caller.world_size());
        let start = Instant::now();
        let mut listener = None;
        let mine = if rank == 0 && world_size > 1 {
            let l = TcpListener::bind((Ipv4Addr::UNSPECIFIED, 0))
                .map_err(|e| BootstrapError::io("listening for uep's own group", e))?;
            let port = l
                .local_addr()
                .map_err(|e| BootstrapError::io("reading the port", e))?
                .port();
            let secret = proto::random_hex::<16>()
                .map_err(|e| BootstrapError::io("drawing the group's secret", e))?;
            listener = Some(l);
            Invitation {
                port,
                secret,
                addrs: own_addrs(),
            }
            .encode()
        } else {
            Vec::new()
        };
        let all = caller.all_gather(&mine)?;
        if world_size == 1 {
            return Ok(alone(&world(rank, 1, "127.0.0.1", 1, None), timeout));
        }
        let inv = Invitation::decode(all.first().map(Vec::as_slice).unwrap_or_default())?;
        match listener {
            Some(l) => {
                let info = world(rank, world_size, "0.0.0.0", inv.port, Some(inv.secret));
                Group::connect_with_listener(&info, l, timeout)
            }
            None => {
                let ip = reachable(&inv, timeout)?;
                let info = world(
                    rank,
                    world_size,
                    &ip.to_string(),
                    inv.port,
                    Some(inv.secret),
                );
                let left = timeout.saturating_sub(start.elapsed()).max(PROBE);
                let group = Group::connect(&info, left)?;
                group.set_timeout(timeout);
                Ok(group)
            }
        }
    }
}

fn world(
    rank: usize,
    world_size: usize,
    addr: &str,
    port: u16,
    secret: Option<String>,
) -> WorldInfo {
    WorldInfo {
        rank,
        world_size,
        // The caller's control plane knows nodes; this group only carries records.
        local_rank: 0,
        local_world_size: 1,
        master_addr: addr.to_string(),
        rendezvous_port: port,
        secret,
        source: EnvSource::Caller,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn invitations_round_trip_and_reject_garbage() {
        let inv = Invitation {
            port: 4242,
            secret: "00ff".into(),
            addrs: vec!["10.0.0.1".parse().unwrap(), "::1".parse().unwrap()],
        };
        assert_eq!(Invitation::decode(&inv.encode()).unwrap(), inv);
        assert!(Invitation::decode(b"hello").is_err());
        assert!(Invitation::decode(b"uep-own-group/1\nnot a port\n\n").is_err());
    }

    /// Each thread's contribution, and the barrier they meet at.
    type Table = std::sync::Arc<(std::sync::Mutex<Vec<Option<Vec<u8>>>>, std::sync::Barrier)>;

    /// A caller's control plane of `n` threads: one all_gather, through a shared table.
    #[derive(Debug)]
    struct Threads {
        rank: usize,
        table: Table,
    }

    impl ControlPlane for Threads {
        fn rank(&self) -> usize {
            self.rank
        }
        fn world_size(&self) -> usize {
            self.table.0.lock().unwrap().len()
        }
        fn all_gather(&self, data: &[u8]) -> Result<Vec<Vec<u8>>, BootstrapError> {
            self.table.0.lock().unwrap()[self.rank] = Some(data.to_vec());
            self.table.1.wait();
            let all = self
                .table
                .0
                .lock()
                .unwrap()
                .iter()
                .map(|d| d.clone().unwrap())
                .collect();
            self.table.1.wait();
            Ok(all)
        }
        fn abort(&self, _: &str) {}
    }

    #[test]
    fn a_group_formed_over_the_callers_carries_collectives_and_names_absent_ranks() {
        let n = 3;
        let table: Table = std::sync::Arc::new((
            std::sync::Mutex::new(vec![None; n]),
            std::sync::Barrier::new(n),
        ));
        let groups: Vec<Group> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..n)
                .map(|rank| {
                    let caller = Threads {
                        rank,
                        table: table.clone(),
                    };
                    s.spawn(move || Group::form_over(&caller, Duration::from_secs(10)).unwrap())
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let got: Vec<_> = std::thread::scope(|s| {
            let hs: Vec<_> = groups
                .iter()
                .map(|g| s.spawn(move || g.all_gather(&[g.rank() as u8])))
                .collect();
            hs.into_iter().map(|h| h.join().unwrap().unwrap()).collect()
        });
        assert!(got
            .iter()
            .all(|all| *all == vec![vec![0], vec![1], vec![2]]));
        // Rank 1 stays away: rank 0 and rank 2 both name it, within the deadline.
        groups
            .iter()
            .for_each(|g| g.set_timeout(Duration::from_millis(300)));
        let (r0, r2) = std::thread::scope(|s| {
            let a = s.spawn(|| groups[0].barrier());
            let b = s.spawn(|| groups[2].barrier());
            (a.join().unwrap(), b.join().unwrap())
        });
        assert!(r0.unwrap_err().to_string().contains("rank 1 "));
        assert!(r2.unwrap_err().to_string().contains("rank 1 failed"));
    }

    #[test]
    fn rank_zeros_addresses_include_loopback_last() {
        let addrs = own_addrs();
        assert!(!addrs.is_empty());
        assert!(addrs.iter().any(IpAddr::is_loopback), "{addrs:?}");
    }
}
