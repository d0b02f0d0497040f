//! The host definitions of the signal and wait phases: release stores, and the
//! watch's spin word by word, on the calling thread.

use std::sync::atomic::Ordering;

use crate::device::{SignalPhase, Until, WaitPhase};
use crate::error::Result;
use crate::wait::Seen;

/// [`Device::signal`](crate::device::Device::signal) on the calling thread.
pub(crate) fn signal(phase: &SignalPhase<'_>) -> Result<()> {
    for (i, s) in phase.stores.iter().enumerate() {
        phase.host_word(i)?.store(s.value, Ordering::Release);
    }
    Ok(())
}

/// [`Device::wait`](crate::device::Device::wait) on the calling thread.
pub(crate) fn wait(phase: &WaitPhase<'_>) -> Result<Vec<Seen>> {
    let peer = Some(phase.watched_peer());
    (0..phase.words.len())
        .map(|i| {
            let word = phase.host_word(i)?;
            let what = || (phase.what)(i);
            match phase.words[i].until {
                Until::AtLeast(t) => phase.watch.at_least(word, t, peer, &what),
                Until::Epoch(e) => phase.watch.epoch(word, e, peer, &what),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::Ordering;
    use std::time::{Duration, Instant};

    use uep_shm::Region;

    use super::*;
    use crate::area::{Area, Mem};
    use crate::config::BufferConfig;
    use crate::device::{CopyPhase, Device, HostDevice, Store, Word};
    use crate::error::EpError;
    use crate::map::RegionMap;
    use crate::symm::Symmetric;
    use crate::wait::Wait;

    /// Rank 0's own memory and rank 1's region, as a node of two maps them.
    fn node_of_two() -> (Symmetric, RegionMap) {
        let map = RegionMap::new(&BufferConfig::new(4, 8, 1, 4, 0), 2, false);
        static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let name = uep_shm::segment_name(&format!("wait-phase-test{n}"), 0, std::process::id());
        let own = uep_shm::Segment::create(&name, map.total).unwrap();
        let peer = Region::anonymous(map.total).unwrap();
        let mut memory = Symmetric::from_parts(0, own, vec![None, Some(peer)]);
        memory.unlink().unwrap();
        (memory, map)
    }

    /// Waits through the host device for `words`, stored by rank 1, within `timeout`.
    fn wait_for(
        memory: &Symmetric,
        map: &RegionMap,
        words: &[Word],
        timeout: Duration,
    ) -> Result<Vec<u64>> {
        let watch = Wait::new(timeout, memory.local(), &map.control, None);
        let phase = WaitPhase {
            words,
            peer: 1,
            what: &|i| format!("rank 0 waiting for rank 1's word {i}"),
            watch: &watch,
            memory,
        };
        let seen = HostDevice::new(2).wait(&phase)?;
        Ok(seen.iter().map(|s| s.value()).collect())
    }

    #[test]
    fn a_signal_phase_stores_each_word_in_order_into_its_ranks_memory() {
        let (memory, map) = node_of_two();
        let words = Area::<u64>::new(map.control.barrier.offset(), 2);
        let stores = [
            Store::at(1, words, 1, 5).unwrap(),
            Store::at(0, words, 0, 6).unwrap(),
            Store::at(0, words, 0, 7).unwrap(),
        ];
        let phase = SignalPhase {
            stores: &stores,
            memory: &memory,
        };
        HostDevice::new(1).signal(&phase).unwrap();
        let load = |region: &Region, i| region.word(words, i).unwrap().load(Ordering::Acquire);
        let (own, peer) = (memory.local(), memory.peer(1).unwrap());
        assert_eq!(
            [load(own, 0), load(own, 1), load(peer, 0), load(peer, 1)],
            [7, 0, 0, 5]
        );
        let outside = [Store::at(1, words, 2, 1)];
        assert!(outside[0].is_err());
    }

    #[test]
    fn a_wait_phase_returns_each_words_value_once_the_peer_stores_it() {
        let (memory, map) = node_of_two();
        let words = Area::<u64>::new(map.control.barrier.offset(), 2);
        let want = [
            Word::at(0, words, 0, Until::Epoch(7)).unwrap(),
            Word::at(1, words, 1, Until::AtLeast(3)).unwrap(),
        ];
        std::thread::scope(|s| {
            s.spawn(|| {
                std::thread::sleep(Duration::from_millis(20));
                let stores = [
                    Store::at(0, words, 0, (6 << 32) | 1).unwrap(),
                    Store::at(0, words, 0, (7 << 32) | 42).unwrap(),
                    Store::at(1, words, 1, 5).unwrap(),
                ];
                let phase = SignalPhase {
                    stores: &stores,
                    memory: &memory,
                };
                HostDevice::new(1).signal(&phase).unwrap();
            });
            let got = wait_for(&memory, &map, &want, Duration::from_secs(30)).unwrap();
            assert_eq!(got, [42, 5]);
        });
    }

    #[test]
    fn a_copy_phase_reads_what_a_wait_acquired() {
        let (memory, map) = node_of_two();
        let device = HostDevice::new(1);
        // Rank 1 writes bytes into rank 0's memory, then signals.
        let area = Area::<u8>::new(map.control.barrier.offset() + 64, 24);
        let bytes: Vec<u8> = (1..=24).collect();
        let copy = |rank| CopyPhase {
            rank,
            area,
            memory: &memory,
        };
        device.write(&copy(0), &bytes).unwrap();
        let flag = Area::<u64>::new(map.control.barrier.offset(), 1);
        let stores = [Store::at(0, flag, 0, 1).unwrap()];
        let signal = SignalPhase {
            stores: &stores,
            memory: &memory,
        };
        device.signal(&signal).unwrap();
        let watch = Wait::new(Duration::from_secs(30), memory.local(), &map.control, None);
        let words = [Word::at(0, flag, 0, Until::AtLeast(1)).unwrap()];
        let wait = WaitPhase {
            words: &words,
            peer: 1,
            what: &|_| "rank 0 waiting for rank 1".into(),
            watch: &watch,
            memory: &memory,
        };
        let seen = device.wait(&wait).unwrap().remove(0);
        let mut out = vec![0u8; 24];
        device.read(&copy(0), &seen, &mut out).unwrap();
        assert_eq!(out, bytes);
        // A copy is the whole area, no more and no less.
        assert!(device.read(&copy(0), &seen, &mut out[..23]).is_err());
        assert!(device.write(&copy(1), &[0u8; 25]).is_err());
        let peer = memory.peer(1).unwrap().get_vec(area).unwrap();
        assert!(peer.iter().all(|&b| b == 0), "a refused write wrote");
    }

    #[test]
    fn a_wait_phase_that_times_out_names_the_word_it_waited_for() {
        let (memory, map) = node_of_two();
        let words = Area::<u64>::new(map.control.barrier.offset(), 2);
        memory
            .local()
            .word(words, 0)
            .unwrap()
            .store(9, Ordering::Release);
        let want = [
            Word::at(0, words, 0, Until::AtLeast(9)).unwrap(),
            Word::at(0, words, 1, Until::Epoch(4)).unwrap(),
        ];
        let err = wait_for(&memory, &map, &want, Duration::from_millis(5)).unwrap_err();
        let msg = err.to_string();
        assert!(
            matches!(err, EpError::Timeout { .. })
                && msg.contains("rank 1's word 1")
                && msg.contains("expected epoch 4, saw epoch 0"),
            "{msg}"
        );
    }

    #[test]
    fn a_wait_phase_on_a_dead_peer_ends_with_its_death() {
        let (memory, map) = node_of_two();
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        child.wait().unwrap();
        let peer = memory.peer(1).unwrap();
        let pid_word = peer.word(map.control.pid, 0).unwrap();
        pid_word.store(u64::from(pid), Ordering::Release);
        let words = Area::<u64>::new(map.control.barrier.offset(), 1);
        let want = [Word::at(0, words, 0, Until::AtLeast(1)).unwrap()];
        let start = Instant::now();
        let err = wait_for(&memory, &map, &want, Duration::from_secs(60)).unwrap_err();
        assert!(
            matches!(err, EpError::PeerDied { peer: 1, pid: p, .. } if p == pid),
            "{err}"
        );
        assert!(start.elapsed() < Duration::from_secs(5));
    }

    #[test]
    fn a_device_s_seen_must_meet_the_word_s_until() {
        let (memory, map) = node_of_two();
        let watch = Wait::new(Duration::from_secs(1), memory.local(), &map.control, None);
        let words = [
            Word::at(1, map.control.barrier, 0, Until::Epoch(7)).unwrap(),
            Word::at(1, map.control.barrier, 1, Until::AtLeast(3)).unwrap(),
        ];
        let phase = WaitPhase {
            words: &words,
            peer: 1,
            what: &|i| format!("word {i}"),
            watch: &watch,
            memory: &memory,
        };
        // What the host's wait would return: the epoch's low half, the word itself.
        assert_eq!(phase.seen(0, (7 << 32) | 42).unwrap().value(), 42);
        assert_eq!(phase.seen(1, 5).unwrap().value(), 5);
        assert!(phase.seen(0, (6 << 32) | 42).is_err());
        assert!(phase.seen(1, 2).is_err());
        assert!(phase.seen(2, 9).is_err());
    }
}
