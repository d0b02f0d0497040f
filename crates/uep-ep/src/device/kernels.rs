//! Which phases of the seam a device ran as kernels: names for reports (`uep bench`'s
//! `kernel_phases`), by the [`Device`](super::Device) method each phase is.

use std::sync::atomic::{AtomicU32, Ordering};

/// A phase of the seam, named as its [`Device`](super::Device) method.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Phase {
    /// [`Device::layout`](super::Device::layout).
    Layout,
    /// [`Device::cast`](super::Device::cast).
    Cast,
    /// [`Device::reduce`](super::Device::reduce).
    Reduce,
    /// [`Device::read`](super::Device::read).
    Read,
    /// [`Device::write`](super::Device::write).
    Write,
    /// [`Device::signal`](super::Device::signal).
    Signal,
    /// [`Device::wait`](super::Device::wait).
    Wait,
    /// [`Device::ll_place`](super::Device::ll_place).
    LlPlace,
    /// [`Device::ll_pack`](super::Device::ll_pack).
    LlPack,
    /// [`Device::ll_unpack`](super::Device::ll_unpack).
    LlUnpack,
    /// [`Device::ll_combine_pack`](super::Device::ll_combine_pack).
    LlCombinePack,
    /// [`Device::normal_notify`](super::Device::normal_notify).
    NormalNotify,
    /// [`Device::normal_pack`](super::Device::normal_pack).
    NormalPack,
    /// [`Device::relay`](super::Device::relay).
    Relay,
    /// [`Device::normal_combine_send`](super::Device::normal_combine_send).
    NormalCombineSend,
}

impl Phase {
    /// Every phase, in the order reports list them.
    pub const ALL: [Phase; 15] = [
        Phase::Layout,
        Phase::Cast,
        Phase::Reduce,
        Phase::Read,
        Phase::Write,
        Phase::Signal,
        Phase::Wait,
        Phase::LlPlace,
        Phase::LlPack,
        Phase::LlUnpack,
        Phase::LlCombinePack,
        Phase::NormalNotify,
        Phase::NormalPack,
        Phase::Relay,
        Phase::NormalCombineSend,
    ];

    /// The `Device` method's name (`"ll_pack"`).
    pub fn name(self) -> &'static str {
        match self {
            Phase::Layout => "layout",
            Phase::Cast => "cast",
            Phase::Reduce => "reduce",
            Phase::Read => "read",
            Phase::Write => "write",
            Phase::Signal => "signal",
            Phase::Wait => "wait",
            Phase::LlPlace => "ll_place",
            Phase::LlPack => "ll_pack",
            Phase::LlUnpack => "ll_unpack",
            Phase::LlCombinePack => "ll_combine_pack",
            Phase::NormalNotify => "normal_notify",
            Phase::NormalPack => "normal_pack",
            Phase::Relay => "relay",
            Phase::NormalCombineSend => "normal_combine_send",
        }
    }

    fn bit(self) -> u32 {
        1 << self as u32
    }
}

/// A set of phases, as a device notes those it ran as kernels.
///
/// ```
/// use uep_ep::device::{KernelPhases, Phase};
/// let mut ran = KernelPhases::default();
/// ran.insert(Phase::Reduce);
/// ran.insert(Phase::Layout);
/// assert_eq!(ran.names(), ["layout", "reduce"]);
/// assert!(ran.contains(Phase::Reduce) && !ran.contains(Phase::Cast));
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KernelPhases(u32);

impl KernelPhases {
    /// The set of these bits (as [`KernelPhases::bits`] gives them).
    pub fn from_bits(bits: u32) -> Self {
        KernelPhases(bits & ((1 << Phase::ALL.len()) - 1))
    }

    /// The set as bits, a phase each: what a device keeps in an atomic word.
    pub fn bits(self) -> u32 {
        self.0
    }

    /// Adds `phase`.
    pub fn insert(&mut self, phase: Phase) {
        self.0 |= phase.bit();
    }

    /// Whether `phase` is in.
    pub fn contains(self, phase: Phase) -> bool {
        self.0 & phase.bit() != 0
    }

    /// Both sets' phases.
    pub fn union(self, other: KernelPhases) -> Self {
        KernelPhases(self.0 | other.0)
    }

    /// The phases, in [`Phase::ALL`]'s order.
    pub fn iter(self) -> impl Iterator<Item = Phase> {
        Phase::ALL.into_iter().filter(move |p| self.contains(*p))
    }

    /// The phases' names, in [`Phase::ALL`]'s order.
    pub fn names(self) -> Vec<&'static str> {
        self.iter().map(Phase::name).collect()
    }
}

/// What a device notes as its phases run as kernels, and hands to
/// [`Device::take_kernel_phases`](super::Device::take_kernel_phases).
///
/// ```
/// use uep_ep::device::{KernelLog, Phase};
/// let log = KernelLog::default();
/// log.ran(Phase::Cast);
/// assert_eq!(log.take().names(), ["cast"]);
/// assert!(log.take().names().is_empty());
/// ```
#[derive(Debug, Default)]
pub struct KernelLog(AtomicU32);

impl KernelLog {
    /// `phase` ran as a kernel.
    pub fn ran(&self, phase: Phase) {
        self.0.fetch_or(phase.bit(), Ordering::Relaxed);
    }

    /// The phases noted since the last take, forgotten.
    pub fn take(&self) -> KernelPhases {
        KernelPhases::from_bits(self.0.swap(0, Ordering::Relaxed))
    }
}
