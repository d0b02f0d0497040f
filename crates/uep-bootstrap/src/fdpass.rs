//! Handing rank 0 the launcher's listening socket across `exec`, and tying every rank's
//! life to its launcher's (the crate's only `unsafe`: hooks between fork and exec).
//!
//! The launcher binds `127.0.0.1:0`, so the port is chosen and held without a race, and lets
//! exactly one child, rank 0, inherit that socket. Rank 0 finds it via `UEP_LISTEN_FD` and adopts
//! it only if that descriptor is a TCP socket listening on the announced rendezvous port, so a process that
//! inherited the environment but not the descriptor never takes over an unrelated file. (If
//! rank 0 runs under a wrapper that does not `exec`, the wrapper keeps a copy of the socket, and
//! late connections then wait in its backlog until they time out instead of being refused.)
#![allow(unsafe_code)]

use std::io;
use std::net::TcpListener;
use std::os::fd::{FromRawFd, OwnedFd, RawFd};
use std::os::unix::process::CommandExt;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};

/// Environment variable holding the inherited listening socket's descriptor number.
pub const LISTEN_FD_VAR: &str = "UEP_LISTEN_FD";

/// Makes `fd` survive `exec` in the child `cmd` spawns, and only there.
///
/// The caller must keep `fd` open until the spawn returns.
pub(crate) fn inherit_in_child(cmd: &mut Command, fd: RawFd) {
    // SAFETY: the hook runs in the forked child between fork and exec. It only calls fcntl, which
    // is async-signal-safe, allocates nothing and takes no locks; `fd` is open in the parent for
    // the duration of the spawn (caller's contract), hence open in the child. Clearing
    // FD_CLOEXEC there changes only the child's descriptor table.
    unsafe {
        cmd.pre_exec(move || {
            let flags = libc::fcntl(fd, libc::F_GETFD);
            if flags < 0 || libc::fcntl(fd, libc::F_SETFD, flags & !libc::FD_CLOEXEC) < 0 {
                return Err(io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

/// Makes the child `cmd` spawns die with SIGKILL when the thread that spawned it ends (the
/// launcher exits or is killed), so that no rank outlives its launcher and holds its
/// cores and ports.
pub(crate) fn die_with_launcher(cmd: &mut Command) {
    let launcher = std::process::id() as libc::pid_t;
    // SAFETY: the hook runs in the forked child between fork and exec and calls only prctl,
    // getppid and raise, which are async-signal-safe, allocate nothing and take no locks.
    // They change only the child's own state.
    unsafe {
        cmd.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong) != 0 {
                return Err(io::Error::last_os_error());
            }
            // The launcher may have died before the prctl took effect: then the child was
            // already handed to another parent.
            if libc::getppid() != launcher {
                libc::raise(libc::SIGKILL);
            }
            Ok(())
        });
    }
}

/// Set once the inherited descriptor has been adopted, so it is never owned twice.
static TAKEN: AtomicBool = AtomicBool::new(false);

/// Adopts the listening socket a launcher passed as descriptor `fd_text`, which must be a TCP
/// socket listening on `port`.
///
/// The checks make adopting a wrong descriptor (say, a stale `UEP_LISTEN_FD` inherited by a
/// process that does not have the socket) fail cleanly instead of taking over an unrelated file.
pub(crate) fn take_inherited_listener(fd_text: &str, port: u16) -> io::Result<TcpListener> {
    let invalid = |m: String| io::Error::new(io::ErrorKind::InvalidInput, m);
    let fd: RawFd = fd_text
        .trim()
        .parse()
        .ok()
        .filter(|&fd| fd > 2)
        .ok_or_else(|| {
            invalid(format!(
                "{LISTEN_FD_VAR}={fd_text:?} is not a descriptor number above 2"
            ))
        })?;
    if TAKEN.swap(true, Ordering::SeqCst) {
        return Err(invalid(format!(
            "the listening socket from {LISTEN_FD_VAR} was already used by an earlier \
             Group::connect in this process"
        )));
    }
    let mut listening: libc::c_int = 0;
    let mut int_len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    let mut addr_len = std::mem::size_of::<libc::sockaddr_in6>() as libc::socklen_t;
    // SAFETY: an all-zero sockaddr_in6 is a valid value. fcntl, getsockopt and getsockname only
    // query `fd`, each writing at most the stated length into a local of at least that size
    // (`listening`; `addr`, which is large enough for IPv4 and IPv6 addresses).
    let (queried, addr) = unsafe {
        let mut addr: libc::sockaddr_in6 = std::mem::zeroed();
        let ok = libc::fcntl(fd, libc::F_GETFD) >= 0
            && libc::getsockopt(
                fd,
                libc::SOL_SOCKET,
                libc::SO_ACCEPTCONN,
                (&mut listening as *mut libc::c_int).cast(),
                &mut int_len,
            ) == 0
            && libc::getsockname(
                fd,
                (&mut addr as *mut libc::sockaddr_in6).cast(),
                &mut addr_len,
            ) == 0;
        (ok, addr)
    };
    // sockaddr_in's sin_port sits where sockaddr_in6's sin6_port does; both in network order.
    let family = libc::c_int::from(addr.sin6_family);
    let bound_port = u16::from_be(addr.sin6_port);
    if !queried || listening != 1 || !(family == libc::AF_INET || family == libc::AF_INET6) {
        TAKEN.store(false, Ordering::SeqCst);
        return Err(invalid(format!(
            "{LISTEN_FD_VAR}={fd} is not an open listening TCP socket in this process"
        )));
    }
    if bound_port != port {
        TAKEN.store(false, Ordering::SeqCst);
        return Err(invalid(format!(
            "{LISTEN_FD_VAR}={fd} listens on port {bound_port}, not on the rendezvous port {port}"
        )));
    }
    // SAFETY: `fd` is open and a listening socket bound to the port the launcher announced as the
    // rendezvous port (checked above), so it is the launcher's socket; nothing else in this process
    // wraps it, and TAKEN ensures it is adopted at most once, so the OwnedFd is its sole owner.
    let owned = unsafe { OwnedFd::from_raw_fd(fd) };
    // Re-duplicate with close-on-exec (std uses F_DUPFD_CLOEXEC) so that processes this rank
    // spawns do not inherit the listener, then close the inheritable original.
    let cloexec = owned.try_clone()?;
    drop(owned);
    Ok(TcpListener::from(cloexec))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{TcpStream, UdpSocket};
    use std::os::fd::IntoRawFd;

    // One test, because adoption is once per process.
    #[test]
    fn adopts_only_a_listener_on_the_expected_port_and_only_once() {
        assert!(take_inherited_listener("abc", 1).is_err());
        assert!(
            take_inherited_listener("1", 1).is_err(),
            "stdio is never adopted"
        );

        // A UDP socket is not a listener (its descriptor is leaked on purpose: nothing owns it).
        let udp = UdpSocket::bind("127.0.0.1:0").unwrap();
        let udp_port = udp.local_addr().unwrap().port();
        let e = take_inherited_listener(&udp.into_raw_fd().to_string(), udp_port).unwrap_err();
        assert!(
            e.to_string().contains("not an open listening TCP socket"),
            "{e}"
        );

        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        let fd = l.into_raw_fd().to_string();
        let e = take_inherited_listener(&fd, port.wrapping_add(1)).unwrap_err();
        assert!(e.to_string().contains("not on the rendezvous port"), "{e}");

        let adopted = take_inherited_listener(&fd, port).unwrap();
        assert_eq!(adopted.local_addr().unwrap().port(), port);
        let _client = TcpStream::connect(("127.0.0.1", port)).unwrap();
        adopted.accept().unwrap();

        let e = take_inherited_listener(&fd, port).unwrap_err();
        assert!(e.to_string().contains("already used"), "{e}");
    }
}
