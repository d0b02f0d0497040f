//! [`CounterLayout`]: where receiver-side emulation lands in the local region.

use uep_wire::{MAX_ATOMIC_SLOTS, MAX_LOCAL_EXPERTS, MAX_RANKS, MAX_STREAMS};

use crate::error::{ProxyError, Result};

/// Bytes of one counter (every counter is a `u64`).
pub const COUNTER_BYTES: u64 = 8;

/// Most normal-mode channels per source rank: the channel is a `u8` in
/// [`crate::cmds::normal_write`] and in the piggyback.
const MAX_CHANNELS_PER_RANK: usize = 256;

/// Where the receiving proxy applies emulated atomics in the rank's local
/// registered region: four dense arrays of little-endian `u64` counters, each
/// 8-byte aligned. The layout must be the same on every rank (symmetric
/// memory), because senders derive some fields from it.
///
/// | array    | index                              | offset |
/// |----------|------------------------------------|--------|
/// | tails    | `[src rank][channel]`              | `tail_base + 8 * (src * num_channels + channel)` |
/// | LL       | `[buffer 0/1][local expert][src]`  | `ll_base + 8 * ((buffer * num_local_experts + expert) * num_ranks + src)` |
/// | barrier  | `[src rank]`                       | `barrier_base + 8 * src` |
/// | atomics  | `[slot]`                           | `atomic_base + 8 * slot` |
///
/// An array with zero entries (`num_channels = 0`, ...) is unused and its
/// base is not checked.
///
/// Wire limits: the receiving transport does not say who sent a write, so
/// a normal-mode [`uep_wire::WriteImm`] names the tail counter by its
/// 10-bit `stream` = `src * num_channels + channel`; hence
/// `num_ranks * num_channels <=` [`MAX_STREAMS`] (1024, e.g. 256 ranks x 4
/// channels or 100 x 10). A channel is a `u8` in the commands, so
/// `num_channels <= 256`. [`CounterLayout::validate`] checks both.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct CounterLayout {
    /// Ranks in the job (the same as [`crate::Proxy::start`]'s `num_ranks`).
    pub num_ranks: usize,
    /// Byte offset of the tail counters.
    pub tail_base: u64,
    /// Normal-mode channels per source rank.
    pub num_channels: usize,
    /// Byte offset of the LL count-signal counters.
    pub ll_base: u64,
    /// Local experts per rank (LL mode).
    pub num_local_experts: usize,
    /// Byte offset of the barrier counters (one per source rank; 0 entries
    /// only when `num_ranks` is 0, which is invalid).
    pub barrier_base: u64,
    /// Byte offset of the generic atomic counters.
    pub atomic_base: u64,
    /// Generic atomic counter slots, at most 16384.
    pub num_atomic_slots: usize,
}

fn out_of_range(what: &str, value: usize, limit: usize) -> ProxyError {
    ProxyError::Invalid(format!(
        "{what} {value} is out of range (allowed 0..{limit})"
    ))
}

fn off(base: u64, index: usize) -> u64 {
    // Indices are range-checked against sizes validated to fit the region,
    // so this cannot overflow for a validated layout; saturate otherwise so
    // the region's own bounds check rejects it.
    base.saturating_add((index as u64).saturating_mul(COUNTER_BYTES))
}

impl CounterLayout {
    /// Offset of the tail counter of (`src`, `channel`).
    pub fn tail(&self, src: usize, channel: usize) -> Result<u64> {
        if src >= self.num_ranks {
            return Err(out_of_range(
                "tail counter: source rank",
                src,
                self.num_ranks,
            ));
        }
        if channel >= self.num_channels {
            return Err(out_of_range(
                "tail counter: channel",
                channel,
                self.num_channels,
            ));
        }
        Ok(off(self.tail_base, src * self.num_channels + channel))
    }

    /// Offset of the LL count-signal counter of (`buffer`, `local_expert`, `src`).
    pub fn ll_signal(&self, buffer: usize, local_expert: usize, src: usize) -> Result<u64> {
        if buffer > 1 {
            return Err(out_of_range("LL counter: buffer", buffer, 2));
        }
        if local_expert >= self.num_local_experts {
            return Err(out_of_range(
                "LL counter: local expert",
                local_expert,
                self.num_local_experts,
            ));
        }
        if src >= self.num_ranks {
            return Err(out_of_range("LL counter: source rank", src, self.num_ranks));
        }
        Ok(off(
            self.ll_base,
            (buffer * self.num_local_experts + local_expert) * self.num_ranks + src,
        ))
    }

    /// Offset of the barrier counter of `src`.
    pub fn barrier(&self, src: usize) -> Result<u64> {
        if src >= self.num_ranks {
            return Err(out_of_range(
                "barrier counter: source rank",
                src,
                self.num_ranks,
            ));
        }
        Ok(off(self.barrier_base, src))
    }

    /// Offset of generic atomic counter `slot`.
    pub fn atomic(&self, slot: usize) -> Result<u64> {
        if slot >= self.num_atomic_slots {
            return Err(out_of_range(
                "atomic counter: slot",
                slot,
                self.num_atomic_slots,
            ));
        }
        Ok(off(self.atomic_base, slot))
    }

    /// The arrays as (name, base, entries).
    fn arrays(&self) -> [(&'static str, u64, usize); 4] {
        [
            ("tail", self.tail_base, self.num_ranks * self.num_channels),
            (
                "LL",
                self.ll_base,
                2 * self.num_local_experts * self.num_ranks,
            ),
            ("barrier", self.barrier_base, self.num_ranks),
            ("atomic", self.atomic_base, self.num_atomic_slots),
        ]
    }

    /// Checks the sizes against the wire limits, and that every array is
    /// 8-byte aligned, lies inside a region of `region_len` bytes and does
    /// not overlap another array.
    pub fn validate(&self, region_len: usize) -> Result<()> {
        if self.num_ranks == 0 || self.num_ranks > MAX_RANKS {
            return Err(ProxyError::Invalid(format!(
                "CounterLayout.num_ranks = {} (allowed 1..={MAX_RANKS})",
                self.num_ranks
            )));
        }
        if self.num_channels > MAX_CHANNELS_PER_RANK {
            return Err(ProxyError::Invalid(format!(
                "CounterLayout.num_channels = {} (allowed 0..={MAX_CHANNELS_PER_RANK}: a \
                 command names its channel with a u8)",
                self.num_channels
            )));
        }
        if self.num_ranks * self.num_channels > MAX_STREAMS {
            return Err(ProxyError::Invalid(format!(
                "CounterLayout: num_ranks {} x num_channels {} = {} tail streams exceeds the \
                 {MAX_STREAMS} a WriteImm can name (its 10-bit stream field carries \
                 src * num_channels + channel); use at most {} channels for {} ranks",
                self.num_ranks,
                self.num_channels,
                self.num_ranks * self.num_channels,
                MAX_STREAMS / self.num_ranks,
                self.num_ranks
            )));
        }
        if self.num_local_experts > MAX_LOCAL_EXPERTS {
            return Err(ProxyError::Invalid(format!(
                "CounterLayout.num_local_experts = {} (allowed 0..={MAX_LOCAL_EXPERTS})",
                self.num_local_experts
            )));
        }
        if self.num_atomic_slots > MAX_ATOMIC_SLOTS {
            return Err(ProxyError::Invalid(format!(
                "CounterLayout.num_atomic_slots = {} (allowed 0..={MAX_ATOMIC_SLOTS})",
                self.num_atomic_slots
            )));
        }
        let arrays = self.arrays();
        let mut spans = Vec::new();
        for (name, base, n) in arrays {
            if n == 0 {
                continue;
            }
            if base % COUNTER_BYTES != 0 {
                return Err(ProxyError::Invalid(format!(
                    "CounterLayout: {name} counters at offset {base} are not 8-byte aligned"
                )));
            }
            let end = base.checked_add(n as u64 * COUNTER_BYTES);
            match end {
                Some(end) if end <= region_len as u64 => spans.push((name, base, end)),
                _ => {
                    return Err(ProxyError::Invalid(format!(
                        "CounterLayout: {name} counters [{base}, +{} bytes) do not fit the \
                         local region of {region_len} bytes",
                        n as u64 * COUNTER_BYTES
                    )))
                }
            }
        }
        for (i, a) in spans.iter().enumerate() {
            for b in &spans[i + 1..] {
                if a.1 < b.2 && b.1 < a.2 {
                    return Err(ProxyError::Invalid(format!(
                        "CounterLayout: {} counters [{}, {}) overlap {} counters [{}, {})",
                        a.0, a.1, a.2, b.0, b.1, b.2
                    )));
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout() -> CounterLayout {
        CounterLayout {
            num_ranks: 3,
            tail_base: 0,
            num_channels: 4,
            ll_base: 256,
            num_local_experts: 5,
            barrier_base: 1024,
            atomic_base: 1088,
            num_atomic_slots: 8,
        }
    }

    #[test]
    fn offsets_follow_the_table() {
        let l = layout();
        l.validate(4096).unwrap();
        assert_eq!(l.tail(0, 0).unwrap(), 0);
        assert_eq!(l.tail(2, 3).unwrap(), 8 * 11);
        assert_eq!(l.ll_signal(0, 0, 0).unwrap(), 256);
        assert_eq!(l.ll_signal(1, 4, 2).unwrap(), 256 + 8 * ((5 + 4) * 3 + 2));
        assert_eq!(l.barrier(2).unwrap(), 1024 + 16);
        assert_eq!(l.atomic(7).unwrap(), 1088 + 56);
        assert!(l.tail(3, 0).is_err() && l.tail(0, 4).is_err());
        assert!(l.ll_signal(2, 0, 0).is_err() && l.ll_signal(0, 5, 0).is_err());
        assert!(l.ll_signal(0, 0, 3).is_err());
        assert!(l.barrier(3).is_err() && l.atomic(8).is_err());
        let msg = l.tail(0, 9).unwrap_err().to_string();
        assert!(msg.contains("channel 9") && msg.contains("0..4"), "{msg}");
    }

    #[test]
    fn validate_catches_misplaced_arrays() {
        let l = layout();
        // The atomic array ends at 1088 + 64 = 1152.
        assert!(l.validate(1152).is_ok());
        assert!(l.validate(1151).is_err());
        let bad = CounterLayout {
            ll_base: 8,
            ..layout()
        };
        let msg = bad.validate(4096).unwrap_err().to_string();
        assert!(msg.contains("overlap"), "{msg}");
        let bad = CounterLayout {
            barrier_base: 1020,
            ..layout()
        };
        assert!(bad
            .validate(4096)
            .unwrap_err()
            .to_string()
            .contains("aligned"));
        let bad = CounterLayout {
            num_channels: 342,
            ..layout()
        };
        let msg = bad.validate(1 << 20).unwrap_err().to_string();
        assert!(
            msg.contains("num_channels = 342") && msg.contains("0..=256"),
            "{msg}"
        );
        let bad = CounterLayout {
            atomic_base: u64::MAX - 7,
            ..layout()
        };
        assert!(bad.validate(4096).is_err());
        assert!(CounterLayout::default().validate(4096).is_err());
        // Unused arrays are not checked.
        let only_barrier = CounterLayout {
            num_ranks: 2,
            barrier_base: 64,
            tail_base: 1 << 40,
            ll_base: 3,
            ..CounterLayout::default()
        };
        only_barrier.validate(80).unwrap();
    }

    /// More than 64 ranks x channels (the old 6-bit limit) validates and
    /// maps every (source, channel) to its own counter; past 1024 the
    /// error says what fits.
    #[test]
    fn many_ranks_times_channels() {
        let l = CounterLayout {
            num_ranks: 100,
            tail_base: 0,
            num_channels: 2,
            ll_base: 1600,
            num_local_experts: 1,
            barrier_base: 3200,
            atomic_base: 4000,
            num_atomic_slots: 0,
        };
        l.validate(4000).unwrap();
        assert_eq!(l.tail(99, 1).unwrap(), 8 * 199);
        assert_eq!(l.tail(70, 0).unwrap(), 8 * 140);
        assert!(l.tail(100, 0).is_err());
        let full = CounterLayout {
            num_ranks: 256,
            num_channels: 4,
            tail_base: 0,
            barrier_base: 8192,
            ..CounterLayout::default()
        };
        full.validate(8192 + 2048).unwrap();
        let over = CounterLayout {
            num_channels: 11,
            ..l
        };
        let msg = over.validate(1 << 20).unwrap_err().to_string();
        assert!(
            msg.contains("num_ranks 100 x num_channels 11 = 1100")
                && msg.contains("1024")
                && msg.contains("at most 10 channels for 100 ranks"),
            "{msg}"
        );
    }
}
