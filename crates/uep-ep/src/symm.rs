//! Symmetric memory: this rank's region, the mapped regions of the ranks on its node,
//! and the banks of output rows that can outlive a call.
//!
//! Peers and the NIC write this rank's region while it runs, so taking a Rust slice of
//! it is `unsafe`: the caller states which protocol step guarantees that nobody writes
//! the area while the slice lives. Everything else goes through copies and atomics
//! ([`crate::area::Mem`]).

use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

use bytemuck::Pod;
use uep_shm::{Region, Segment, View};

use crate::area::Area;
use crate::error::Result;
use crate::map::BankArea;

/// This rank's region and the regions of the ranks it shares memory with.
pub struct Symmetric {
    rank: usize,
    own: Segment,
    peers: Vec<Option<Region>>,
}

impl std::fmt::Debug for Symmetric {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Symmetric")
            .field("rank", &self.rank)
            .field("own", &self.own)
            .finish()
    }
}

impl Symmetric {
    /// Map the segments `names[p]` of the peers `p` in `local` (rank ids on this node,
    /// `rank` included), each of `bytes` bytes.
    pub fn map_peers(
        rank: usize,
        own: Segment,
        names: &[String],
        local: &[usize],
        bytes: usize,
        timeout: Duration,
    ) -> Result<Symmetric> {
        let mut peers: Vec<Option<Region>> = vec![None; names.len()];
        for &p in local {
            if p != rank {
                peers[p] = Some(Segment::open(&names[p], bytes, timeout)?.region().clone());
            }
        }
        Ok(Symmetric { rank, own, peers })
    }

    /// Remove the name of this rank's segment: every peer has mapped it.
    pub fn unlink(&mut self) -> Result<()> {
        Ok(self.own.unlink()?)
    }

    /// This rank's region.
    pub fn local(&self) -> &Region {
        self.own.region()
    }

    /// The region of `peer`, if it shares memory with this rank.
    pub fn peer(&self, peer: usize) -> Option<&Region> {
        if peer == self.rank {
            Some(self.own.region())
        } else {
            self.peers.get(peer).and_then(Option::as_ref)
        }
    }

    /// Borrow `area` of this rank's region.
    ///
    /// # Safety
    /// Nobody (no peer, no proxy thread, no transport) may write `area` while the slice
    /// lives. The callers' argument is always the same shape: the writers of the area
    /// have published that they are done with it for this call (the caller acquired
    /// their epoch, count or packet), and they write it again only after this rank
    /// enters its next call on the same area, which needs `&mut Buffer`.
    #[allow(unsafe_code)]
    pub unsafe fn view<T: Pod>(&self, area: Area<T>) -> Result<&[T]> {
        // SAFETY: no concurrent writer (the caller's contract); bounds and alignment
        // are checked by `slice`.
        Ok(unsafe { self.own.region().slice::<T>(area.offset(), area.len())? })
    }

    /// Borrow `area` of this rank's region mutably.
    ///
    /// # Safety
    /// Nobody else (no peer, no proxy thread, no transport, no other slice) may read or
    /// write `area` while the slice lives.
    #[allow(unsafe_code, clippy::mut_from_ref)]
    pub unsafe fn view_mut<T: Pod>(&self, area: Area<T>) -> Result<&mut [T]> {
        // SAFETY: exclusive (the caller's contract); bounds and alignment are checked by
        // `slice_mut`.
        Ok(unsafe {
            self.own
                .region()
                .slice_mut::<T>(area.offset(), area.len())?
        })
    }

    /// A new mapping of `bank`, for outputs that outlive the call.
    fn map_bank(&self, bank: BankArea) -> Result<View> {
        Ok(self.own.view(bank.bytes.offset(), bank.bytes.len())?)
    }
}

/// A bank of output rows and the view last handed out of it.
///
/// Handing out outputs without a copy: the rows peers wrote into the bank are mapped
/// again on their own ([`Bank::lease`]) and the mapping goes to whoever keeps the
/// outputs (a tensor's storage). Before peers may write the bank again
/// ([`Bank::reclaim`], at the start of the next call that uses it), a view that is still
/// held is detached: its pages become private copies of the rows it shows, in one
/// `mremap`, and the bank gets a fresh view next time. Outputs nobody holds any more
/// cost nothing; outputs still held cost one copy of their rows.
#[derive(Debug)]
pub struct Bank {
    area: BankArea,
    view: Option<Arc<View>>,
    /// Byte ranges of the bank that hold the outputs of the last lease.
    keep: Vec<Range<usize>>,
}

impl Bank {
    /// A bank over `area`, no view yet.
    pub fn new(area: BankArea) -> Bank {
        Bank {
            area,
            view: None,
            keep: Vec::new(),
        }
    }

    /// Before peers write the bank again: detach the last view if anyone still holds it.
    pub fn reclaim(&mut self) -> Result<()> {
        if let Some(view) = &self.view {
            if Arc::strong_count(view) > 1 {
                view.detach(&self.keep)?;
                self.view = None;
            }
        }
        Ok(())
    }

    /// A view of the bank whose `keep` ranges (bank-relative areas) are this call's
    /// outputs; the byte offset of an area `a` inside the view is `a.offset() - base`.
    pub fn lease(&mut self, symm: &Symmetric, keep: &[Area<u8>]) -> Result<Arc<View>> {
        let base = self.area.bytes.offset();
        let view = match &self.view {
            Some(v) if !v.is_detached() => v.clone(),
            _ => {
                let v = Arc::new(symm.map_bank(self.area)?);
                self.view = Some(v.clone());
                v
            }
        };
        self.keep = keep
            .iter()
            .map(|a| a.offset() - base..a.end() - base)
            .collect();
        Ok(view)
    }

    /// The bank's first byte in the region.
    pub fn base(&self) -> usize {
        self.area.bytes.offset()
    }
}

/// Outputs of a call mapped so that they outlive it (see [`Bank`]): a view of their
/// bank, and the byte range of each output in the view. The outputs stay valid for as
/// long as someone holds the view; the Buffer's next calls do not touch them.
#[derive(Debug, Clone)]
pub struct Lease {
    /// The mapping.
    pub view: Arc<View>,
    /// Byte ranges of the outputs in `view`, in the order the call's docs give.
    pub parts: Vec<Range<usize>>,
}

impl Lease {
    /// A lease of `parts` (areas of `bank`), keeping the bytes of `keep` when detached.
    pub(crate) fn of(
        bank: &mut Bank,
        symm: &Symmetric,
        parts: &[Area<u8>],
        keep: &[Area<u8>],
    ) -> Result<Lease> {
        let view = bank.lease(symm, keep)?;
        let base = bank.base();
        Ok(Lease {
            view,
            parts: parts
                .iter()
                .map(|a| a.offset() - base..a.end() - base)
                .collect(),
        })
    }
}
