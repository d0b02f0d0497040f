//! Hosts on one machine: one Linux network namespace per host, joined by a switch.
//!
//! Multi-node tests need ranks that do not share an address: traffic between them must
//! cross a real interface, and a link between them must be able to fail. [`Hosts`]
//! builds that on one machine with iproute2:
//!
//! ```text
//!   host 0 netns          switch netns            host 1 netns
//!   eth0 10.77.0.1 ──veth── p0 ┐
//!                              ├ br0 (bridge)
//!   eth0 10.77.0.2 ──veth── p1 ┘ ...
//! ```
//!
//! Every namespace is *anonymous*: it is held by one `unshare --net cat` process whose
//! stdin is a pipe from this process, and nothing is ever created in the caller's own
//! namespace (each veth pair is made inside the switch and one end moved into its
//! host). A namespace lives while a process is in it, so everything vanishes when the
//! holders exit: on drop, and also when the test is killed, because the pipe closes
//! and `cat` ends. The addresses exist only inside these namespaces.
//!
//! Needs root (or `CAP_SYS_ADMIN` and `CAP_NET_ADMIN`) and the `unshare`, `nsenter`
//! and `ip` programs; [`Hosts::unavailable`] says why they cannot be used here.

use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Why a set of hosts could not be built or changed.
#[derive(Debug, thiserror::Error)]
pub enum NetnsError {
    /// A program could not be started.
    #[error("netns: starting `{program}`: {source}")]
    Spawn {
        /// The program.
        program: String,
        /// Why it did not start.
        #[source]
        source: std::io::Error,
    },
    /// A command ran and failed.
    #[error("netns: `{command}` failed ({status}): {stderr}")]
    Command {
        /// The command line.
        command: String,
        /// How it ended.
        status: std::process::ExitStatus,
        /// What it printed on stderr.
        stderr: String,
    },
    /// A namespace holder did not get its own namespace, or ended early.
    #[error("netns: {0}")]
    Holder(String),
}

/// One process that owns an anonymous network namespace.
#[derive(Debug)]
struct Holder {
    /// `unshare --net cat`, never reaped before drop, so its pid cannot be reused.
    child: Child,
}

impl Holder {
    /// Starts a holder and waits until it is in a namespace of its own.
    fn spawn() -> Result<Holder, NetnsError> {
        let child = Command::new("unshare")
            .args(["--net", "cat"])
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|source| NetnsError::Spawn {
                program: "unshare".into(),
                source,
            })?;
        let mut holder = Holder { child };
        // Until unshare(2) has run, the child's namespace is ours: configuring it then
        // would change this machine's network. Wait until it differs.
        let ours = std::fs::read_link("/proc/self/ns/net").ok();
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Ok(Some(status)) = holder.child.try_wait() {
                let mut stderr = String::new();
                if let Some(mut e) = holder.child.stderr.take() {
                    use std::io::Read;
                    let _ = e.read_to_string(&mut stderr);
                }
                return Err(NetnsError::Holder(format!(
                    "`unshare --net` exited ({status}): {}",
                    stderr.trim()
                )));
            }
            let theirs = std::fs::read_link(holder.ns_path()).ok();
            if theirs.is_some() && theirs != ours {
                return Ok(holder);
            }
            if Instant::now() > deadline {
                return Err(NetnsError::Holder(
                    "`unshare --net` did not enter a new namespace within 10 s".into(),
                ));
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    fn ns_path(&self) -> PathBuf {
        PathBuf::from(format!("/proc/{}/ns/net", self.pid()))
    }

    /// `program args...` inside this namespace (`nsenter` execs it, so the pid is the
    /// program's own).
    fn command(&self, program: impl AsRef<std::ffi::OsStr>) -> Command {
        let mut c = Command::new("nsenter");
        c.arg(format!("--net={}", self.ns_path().display()))
            .arg("--")
            .arg(program);
        c
    }

    /// Runs `ip args...` inside this namespace.
    fn ip(&self, args: &[&str]) -> Result<(), NetnsError> {
        let out = self
            .command("ip")
            .args(args)
            .stdin(Stdio::null())
            .output()
            .map_err(|source| NetnsError::Spawn {
                program: "nsenter".into(),
                source,
            })?;
        if out.status.success() {
            Ok(())
        } else {
            Err(NetnsError::Command {
                command: format!("ip {}", args.join(" ")),
                status: out.status,
                stderr: String::from_utf8_lossy(&out.stderr).trim().to_owned(),
            })
        }
    }
}

impl Drop for Holder {
    fn drop(&mut self) {
        // Closing stdin ends `cat`; kill in case it is stopped.
        drop(self.child.stdin.take());
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Emulated hosts, each with its own network namespace and address, joined by a
/// bridge; see the module docs. Dropping it removes everything it made.
#[derive(Debug)]
pub struct Hosts {
    // Hosts first: dropped before the switch, though either order leaves nothing.
    hosts: Vec<Holder>,
    switch: Holder,
}

/// The interface of every host, in its namespace.
pub const HOST_IF: &str = "eth0";

impl Hosts {
    /// Why namespaces cannot be used on this machine (not root, a program missing),
    /// or `None` if [`Hosts::new`] should work.
    pub fn unavailable() -> Option<String> {
        for program in ["unshare", "nsenter", "ip"] {
            let found = std::env::var_os("PATH").is_some_and(|path| {
                std::env::split_paths(&path).any(|d| d.join(program).is_file())
            });
            if !found {
                return Some(format!(
                    "`{program}` is not installed (packages util-linux and iproute2)"
                ));
            }
        }
        // Creating a namespace is the real test of the privileges it needs.
        match Holder::spawn() {
            Ok(h) => h
                .ip(&["link", "set", "lo", "up"])
                .err()
                .map(|e| format!("cannot configure a network namespace: {e}")),
            Err(e) => Some(format!(
                "cannot create a network namespace (run as root): {e}"
            )),
        }
    }

    /// Builds `n` hosts, host `i` at [`Hosts::addr`]`(i)` on interface [`HOST_IF`].
    pub fn new(n: usize) -> Result<Hosts, NetnsError> {
        assert!((1..=250).contains(&n), "1..=250 hosts fit the /24, got {n}");
        let switch = Holder::spawn()?;
        switch.ip(&["link", "add", "name", "br0", "type", "bridge"])?;
        switch.ip(&["link", "set", "br0", "up"])?;
        let mut hosts = Vec::with_capacity(n);
        for i in 0..n {
            let host = Holder::spawn()?;
            let (port, end) = (format!("p{i}"), format!("e{i}"));
            let pid = host.pid().to_string();
            switch.ip(&[
                "link", "add", "name", &port, "type", "veth", "peer", "name", &end,
            ])?;
            switch.ip(&["link", "set", &end, "netns", &pid])?;
            switch.ip(&["link", "set", &port, "master", "br0", "up"])?;
            host.ip(&["link", "set", &end, "name", HOST_IF])?;
            let cidr = format!("{}/24", Self::addr(i));
            host.ip(&["addr", "add", &cidr, "dev", HOST_IF])?;
            host.ip(&["link", "set", HOST_IF, "up"])?;
            // Local traffic (a rank to its own address) goes through `lo`.
            host.ip(&["link", "set", "lo", "up"])?;
            hosts.push(host);
        }
        Ok(Hosts { hosts, switch })
    }

    /// Number of hosts.
    pub fn len(&self) -> usize {
        self.hosts.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.hosts.is_empty()
    }

    /// Host `i`'s address: `10.77.0.(i + 1)`, private and only inside these namespaces.
    pub fn addr(i: usize) -> Ipv4Addr {
        Ipv4Addr::new(10, 77, 0, (i + 1) as u8)
    }

    /// A command that runs `program` on host `i` (in its namespace).
    pub fn command(&self, i: usize, program: impl AsRef<std::ffi::OsStr>) -> Command {
        self.hosts[i].command(program)
    }

    /// Pulls host `i`'s cable: its switch port goes down, so nothing reaches it or
    /// leaves it, while its own interface and processes stay as they are.
    pub fn cut(&self, i: usize) -> Result<(), NetnsError> {
        self.switch.ip(&["link", "set", &format!("p{i}"), "down"])
    }

    /// Plugs host `i`'s cable back in.
    pub fn restore(&self, i: usize) -> Result<(), NetnsError> {
        self.switch.ip(&["link", "set", &format!("p{i}"), "up"])
    }

    /// Bytes host `i` has sent on [`HOST_IF`] so far (the kernel's counter), to show
    /// that traffic crossed the link rather than `lo`.
    pub fn tx_bytes(&self, i: usize) -> Result<u64, NetnsError> {
        // /proc/net/dev shows the reader's namespace: read it from inside.
        let out = self.hosts[i]
            .command("cat")
            .arg("/proc/net/dev")
            .output()
            .map_err(|source| NetnsError::Spawn {
                program: "nsenter".into(),
                source,
            })?;
        let text = String::from_utf8_lossy(&out.stdout);
        // `eth0: rx bytes, packets, errs, drop, fifo, frame, compressed, multicast, tx bytes, ...`
        text.lines()
            .find_map(|l| l.trim().strip_prefix(HOST_IF)?.strip_prefix(':'))
            .and_then(|fields| fields.split_whitespace().nth(8)?.parse().ok())
            .ok_or_else(|| NetnsError::Command {
                command: "cat /proc/net/dev".into(),
                status: out.status,
                stderr: format!("no {HOST_IF} counters in: {text}"),
            })
    }

    /// The namespace of host `i`, as `/proc/<pid>/ns/net` (for `nsenter --net=`).
    pub fn ns_path(&self, i: usize) -> PathBuf {
        self.hosts[i].ns_path()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Skips (with the reason) where namespaces cannot be made, except in CI, where
    /// they must work.
    fn hosts(n: usize) -> Option<Hosts> {
        if let Some(why) = Hosts::unavailable() {
            assert!(
                std::env::var_os("CI").is_none(),
                "CI must be able to create network namespaces: {why}"
            );
            eprintln!("skipped: {why}");
            return None;
        }
        Some(Hosts::new(n).expect("build hosts"))
    }

    fn ping(hosts: &Hosts, from: usize, to: usize) -> bool {
        hosts
            .command(from, "ping")
            .args(["-c", "1", "-W", "1", &Hosts::addr(to).to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    }

    /// Whether `from` reaches `to` within a few pings: the first after a link comes back
    /// may be lost while the bridge port and ARP settle.
    fn reaches(hosts: &Hosts, from: usize, to: usize) -> bool {
        (0..5).any(|_| ping(hosts, from, to))
    }

    fn our_links() -> String {
        let out = Command::new("ip").args(["-o", "link"]).output().unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    #[test]
    fn hosts_reach_each_other_until_cut_and_vanish_on_drop() {
        let before = our_links();
        let Some(hosts) = hosts(3) else { return };
        let own = std::fs::read_link("/proc/self/ns/net").unwrap();
        let paths: Vec<_> = (0..3).map(|i| hosts.ns_path(i)).collect();
        for p in &paths {
            assert_ne!(
                std::fs::read_link(p).unwrap(),
                own,
                "{p:?} is our own netns"
            );
        }
        // ping may be missing; the address check below needs only `ip`.
        let has_ping = Command::new("ping").arg("-V").output().is_ok();
        if has_ping {
            assert!(reaches(&hosts, 0, 2) && reaches(&hosts, 2, 1));
            hosts.cut(2).unwrap();
            assert!(!ping(&hosts, 0, 2));
            hosts.restore(2).unwrap();
            assert!(reaches(&hosts, 0, 2));
        }
        let out = hosts
            .command(1, "ip")
            .args(["-4", "-o", "addr", "show", "dev", HOST_IF])
            .output()
            .unwrap();
        assert!(String::from_utf8_lossy(&out.stdout).contains("10.77.0.2/24"));
        // Nothing was created in our own namespace.
        assert_eq!(our_links(), before);
        drop(hosts);
        for p in &paths {
            assert!(std::fs::read_link(p).is_err(), "{p:?} outlived its Hosts");
        }
    }
}
