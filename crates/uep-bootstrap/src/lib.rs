//! uep-bootstrap: how the ranks of a uep job find each other.
//!
//! * [`WorldInfo`] reads a rank's place in the job from torchrun, Open MPI or Slurm variables (or
//!   those [`launch_local`] sets).
//! * [`Group`] is the rendezvous: rank 0 listens on `MASTER_ADDR` at `UEP_MASTER_PORT`, else
//!   `MASTER_PORT + 1` (the launcher's store holds `MASTER_PORT`), admits exactly the
//!   invited ranks (same world size, unique in-range ranks, same protocol version, and proof of the
//!   shared `UEP_SECRET` via HMAC-SHA256 over fresh nonces, checked in constant time), and then
//!   relays small collectives ([`Group::all_gather`], [`Group::barrier`]) over a star of TCP
//!   connections. Every wait has a deadline; a rank that crashes, leaves or calls
//!   [`Group::abort`] makes every other rank's pending or next collective fail with an error
//!   naming it.
//! * [`ControlPlane`] is what the data path needs of the job's control plane; [`Group`]
//!   implements it, and so can a framework's process group.
//! * [`launch_local`] runs all ranks of a job as processes on this machine (what `uep bench`
//!   does), handing rank 0 a pre-bound listening socket so the port is chosen without races.
//!
//! * [`Store`] is a key-value store every process of a job reaches, a replacement started
//!   later included: [`StoreServer`] and [`TcpStore`] are uep's own, which the launcher
//!   keeps (an elastic job's door lives there).
//!
//! The wire protocol is documented in the `proto` module's source.
#![deny(unsafe_code)]

mod control;
mod env;
mod error;
mod fdpass;
mod group;
mod launch;
mod launcher;
mod own;
mod proto;
mod store;

#[cfg(test)]
mod tests;

pub use control::{host_id, ControlPlane};
pub use env::{EnvSource, WorldInfo, LAUNCHER_LOCAL, LAUNCHER_VAR, PORT_VAR, SECRET_VAR};
pub use error::BootstrapError;
pub use fdpass::LISTEN_FD_VAR;
pub use group::{raise_backlog, Group};
pub use launch::{launch_local, launch_local_with_grace, LaunchOutcome, LaunchSpec, DEFAULT_GRACE};
pub use proto::PROTOCOL_VERSION;
pub use store::{Store, StoreServer, TcpStore, STORE_VAR};
