//! The copy phases' descriptor: the host's own small reads and writes of symmetric
//! memory, outside any kernel: the counts and flags a wait acquired, a combine's block
//! offsets, the source indices of a dispatch, its padding rows. Named as a rank and an
//! [`Area`], so that on a GPU they are copies between its memory and the host's, as
//! DeepEP's host reads the counters its notify kernel filled.

use crate::area::{Area, Mem};
use crate::error::{EpError, Result};
use crate::symm;

/// One host copy into or out of `area` of `rank`'s symmetric memory (this rank's own,
/// or a same-node peer's).
pub struct CopyPhase<'a> {
    /// Whose memory.
    pub rank: usize,
    /// The bytes copied.
    pub area: Area<u8>,
    /// This rank's memory and its node's ranks'.
    pub(crate) memory: &'a symm::Symmetric,
}

impl std::fmt::Debug for CopyPhase<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CopyPhase")
            .field("rank", &self.rank)
            .field("area", &self.area)
            .finish_non_exhaustive()
    }
}

impl CopyPhase<'_> {
    /// Checks that `len` bytes are the area's: what a device relies on before it copies.
    pub fn check(&self, len: usize) -> Result<()> {
        match len == self.area.len() {
            true => Ok(()),
            false => Err(EpError::internal(format!(
                "a copy of {len} bytes to or from {:?} of rank {}",
                self.area, self.rank
            ))),
        }
    }

    /// The host definition of a read: `out` gets the area's bytes from the host's
    /// mapping of the rank's memory.
    pub(crate) fn host_read(&self, out: &mut [u8]) -> Result<()> {
        self.check(out.len())?;
        self.memory.peer_region(self.rank)?.get(self.area, out)
    }

    /// The host definition of a write: `bytes` into the host's mapping.
    pub(crate) fn host_write(&self, bytes: &[u8]) -> Result<()> {
        self.check(bytes.len())?;
        self.memory.peer_region(self.rank)?.put(self.area, bytes)
    }
}
