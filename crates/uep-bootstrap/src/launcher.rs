//! Which launcher started the job: a leaf that the environment reader and the errors
//! both name.

use std::fmt;

/// Which launcher's variables a [`WorldInfo`](crate::WorldInfo) was read from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EnvSource {
    /// torchrun (or any launcher that sets `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, ...).
    Torchrun,
    /// Open MPI's `mpirun` (`OMPI_COMM_WORLD_*`).
    OpenMpi,
    /// Slurm's `srun` (`SLURM_PROCID`, ...).
    Slurm,
    /// `uep` itself ([`crate::launch_local`]): torchrun-style variables plus `UEP_LAUNCHER=local`.
    Uep,
    /// The caller's own control plane (a `torch.distributed` group, an MPI communicator),
    /// through which uep formed a group of its own ([`crate::Group::form_over`]).
    Caller,
}

impl fmt::Display for EnvSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            EnvSource::Torchrun => "torchrun",
            EnvSource::OpenMpi => "Open MPI",
            EnvSource::Slurm => "Slurm",
            EnvSource::Uep => "uep",
            EnvSource::Caller => "the caller's process group",
        })
    }
}
