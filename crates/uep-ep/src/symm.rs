//! Symmetric memory: this rank's region, the mapped regions of the ranks on its node,
//! and the banks of output rows that can outlive a call.
//!
//! Peers and the NIC write this rank's region while it runs, so a Rust slice of it is
//! taken only with a proof that nobody writes the area while the slice lives, as a
//! type: [`Published`] (made from what a wait acquired: the writers are done for this
//! call) or [`Exclusive`] (areas this rank alone writes, reached only while the Buffer
//! is held mutably); a staging area is its `Staged`'s alone (`net`). Everything else
//! goes through copies and atomics (`Mem`).

use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

use bytemuck::Pod;
use uep_shm::{Region, Segment, View};

use crate::area::Area;
use crate::error::{EpError, Result};
use crate::map::BankArea;
use crate::wait::Seen;

mod alloc;

pub use alloc::{MemHandle, ShmSymmetric, SymmetricAlloc, HANDLE_BYTES};

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
    /// Map the memory of the peers `p` in `local` (rank ids on this node, `rank`
    /// included) through `alloc` by their handles `handles[p]`, each of `bytes` bytes.
    pub fn map_peers(
        (rank, own): (usize, Segment),
        handles: &[MemHandle],
        local: &[usize],
        bytes: usize,
        (alloc, timeout): (&dyn SymmetricAlloc, Duration),
    ) -> Result<Symmetric> {
        let mut peers: Vec<Option<Region>> = vec![None; handles.len()];
        for &p in local {
            if p != rank {
                peers[p] = Some(alloc.open(&handles[p], bytes, timeout)?);
            }
        }
        Ok(Symmetric { rank, own, peers })
    }

    /// This rank's segment and the regions `peers[p]` it already mapped (a replacement
    /// rank's, `elastic::join`).
    pub fn from_parts(rank: usize, own: Segment, peers: Vec<Option<Region>>) -> Symmetric {
        Symmetric { rank, own, peers }
    }

    /// `peer`'s region is now `region` (a replacement took its place).
    pub fn replace_peer(&mut self, peer: usize, region: Region) {
        if let Some(slot) = self.peers.get_mut(peer) {
            *slot = Some(region);
        }
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

    /// The region of `peer`, or an error naming both ranks where it shares none.
    pub fn peer_region(&self, peer: usize) -> Result<&Region> {
        self.peer(peer).ok_or_else(|| {
            EpError::internal(format!(
                "rank {peer} shares no memory with rank {}",
                self.rank
            ))
        })
    }

    /// The address and length of `peer`'s region in this process, as a device's
    /// kernel reaches it.
    pub fn peer_address(&self, peer: usize) -> Result<(usize, usize)> {
        self.peer_region(peer).map(address)
    }

    /// The address and length of this rank's own region in this process.
    pub fn local_address(&self) -> (usize, usize) {
        address(self.local())
    }

    /// This rank's memory as published for the call whose wait acquired `seen`.
    pub fn published(&self, _seen: &Seen) -> Published<'_> {
        Published {
            own: self.own.region(),
        }
    }

    /// `area` of this rank's region (the low-latency combine buffer), written by this
    /// rank alone: `_key` is the Buffer's one [`Exclusive`], which only a call holding
    /// the Buffer mutably can lend, so no other slice of the area is alive while this
    /// one is, and the proxy and peers read it only for a combine sent from it, which
    /// the caller has waited out.
    #[allow(clippy::mut_from_ref)]
    pub fn exclusive<'a, T: Pod>(
        &'a self,
        area: Area<T>,
        _key: &'a mut Exclusive,
    ) -> Result<&'a mut [T]> {
        // SAFETY: exclusive (the key's borrow, above); bounds and alignment are checked
        // by `slice_mut`.
        #[allow(unsafe_code)]
        let rows = unsafe {
            self.own
                .region()
                .slice_mut::<T>(area.offset(), area.len())?
        };
        Ok(rows)
    }

    /// A new mapping of `bank`, for outputs that outlive the call.
    fn map_bank(&self, bank: BankArea) -> Result<View> {
        Ok(self.own.view(bank.bytes.offset(), bank.bytes.len())?)
    }
}

/// This rank's memory (and its node's) as published to it for one call: reading an
/// area that peers or the proxy write takes one, made from what a wait acquired
/// ([`Seen`]). The argument, made once here: the writers of what is read through it
/// published that they are done with it for this call (the wait acquired their epoch,
/// count signal or announcement), and they write it again only after this rank enters
/// its next call on the same areas, which needs the Buffer mutably, while a
/// `Published`, and every slice read through it, borrows the Buffer's context.
#[derive(Clone, Copy, Debug)]
pub struct Published<'a> {
    own: &'a Region,
}

impl<'a> Published<'a> {
    /// `area` of this rank's region.
    pub fn view<T: Pod>(self, area: Area<T>) -> Result<&'a [T]> {
        self.view_of(self.own, area)
    }

    /// `area` of `region` (this rank's, or a same-node peer's whose publication the
    /// wait acquired).
    pub fn view_of<T: Pod>(self, region: &'a Region, area: Area<T>) -> Result<&'a [T]> {
        // SAFETY: no writer while the slice lives (the type's argument, above); bounds
        // and alignment are checked by `slice`.
        #[allow(unsafe_code)]
        let rows = unsafe { region.slice::<T>(area.offset(), area.len())? };
        Ok(rows)
    }
}

/// The key to the areas this rank alone writes (the low-latency combine buffers): one a
/// Buffer, in its low-latency state, so `&mut` access to it means the Buffer is held
/// mutably ([`Symmetric::exclusive`]).
#[derive(Debug)]
pub struct Exclusive(());

impl Exclusive {
    /// The Buffer's key; made once, when the Buffer is.
    pub(crate) fn for_new_buffer() -> Exclusive {
        Exclusive(())
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

/// Outputs of a call mapped so that they outlive it: a view of the bank of normal-mode
/// output areas they were written into, and the byte range of each output in the view.
/// The outputs stay valid for as long as someone holds the view; the Buffer's next
/// calls do not touch them.
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

/// A region's address and length.
fn address(region: &Region) -> (usize, usize) {
    (region.as_ptr() as usize, region.len())
}
