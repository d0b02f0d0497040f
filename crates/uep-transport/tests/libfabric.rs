//! Real libfabric over `tcp;ofi_rxm` on 127.0.0.1: several endpoints in one
//! process, each over its own heap region, connected through each other's
//! `PeerAddr`.
//!
//! The tcp provider is bound to loopback with the `node = "127.0.0.1"` +
//! `FI_SOURCE` hint (`FabricOptions::loopback`), so the tests do not depend on
//! the sandbox's other interfaces.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use uep_transport::{
    list_providers, Arrival, Completion, FabricOptions, FaultConfig, FaultyTransport, HeapRegion,
    LibfabricTransport, PeerAddr, RegionRef, Side, Transport, TransportError, WriteOp,
};

const PROVIDER: &str = "tcp;ofi_rxm";
const DEADLINE: Duration = Duration::from_secs(20);

fn open_ranks(n: usize, region_len: usize) -> (Vec<LibfabricTransport>, Vec<Arc<HeapRegion>>) {
    open_ranks_with(&FabricOptions::loopback(PROVIDER), n, region_len)
}

fn open_ranks_with(
    opts: &FabricOptions,
    n: usize,
    region_len: usize,
) -> (Vec<LibfabricTransport>, Vec<Arc<HeapRegion>>) {
    let mut ts = Vec::new();
    let mut rs = Vec::new();
    for _ in 0..n {
        let r = HeapRegion::new(region_len);
        ts.push(LibfabricTransport::new(opts, RegionRef::from_heap(&r)).expect("open transport"));
        rs.push(r);
    }
    let addrs: Vec<_> = ts.iter().map(|t| t.local_addr()).collect();
    for t in &mut ts {
        t.connect(&addrs).expect("connect");
    }
    (ts, rs)
}

/// Deterministic test bytes, different per `seed`.
fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// Polls every transport once; returns (completions per rank, arrivals per rank).
fn poll_all<T: Transport>(ts: &mut [T], done: &mut [Vec<Completion>], arr: &mut [Vec<Arrival>]) {
    for (i, t) in ts.iter_mut().enumerate() {
        t.poll_send(&mut done[i]).expect("poll_send");
        t.poll_recv(&mut arr[i]).expect("poll_recv");
    }
}

fn pump_until<T: Transport>(
    ts: &mut [T],
    done: &mut [Vec<Completion>],
    arr: &mut [Vec<Arrival>],
    what: &str,
    mut cond: impl FnMut(&[Vec<Completion>], &[Vec<Arrival>]) -> bool,
) {
    let start = Instant::now();
    while !cond(done, arr) {
        poll_all(ts, done, arr);
        assert!(
            start.elapsed() < DEADLINE,
            "timed out waiting for {what}: completions {:?}, arrivals {:?}",
            done.iter().map(Vec::len).collect::<Vec<_>>(),
            arr.iter().map(Vec::len).collect::<Vec<_>>()
        );
    }
}

fn post_retry<T: Transport>(
    ts: &mut [T],
    done: &mut [Vec<Completion>],
    arr: &mut [Vec<Arrival>],
    from: usize,
    mut post: impl FnMut(&mut T) -> Result<(), TransportError>,
) -> u64 {
    let start = Instant::now();
    let mut blocked = 0;
    loop {
        match post(&mut ts[from]) {
            Ok(()) => return blocked,
            Err(TransportError::WouldBlock) => {
                blocked += 1;
                poll_all(ts, done, arr);
                assert!(start.elapsed() < DEADLINE, "post stayed WouldBlock");
            }
            Err(e) => panic!("post failed: {e}"),
        }
    }
}

fn empty(n: usize) -> (Vec<Vec<Completion>>, Vec<Vec<Arrival>>) {
    (vec![Vec::new(); n], vec![Vec::new(); n])
}

#[test]
fn write_with_imm_lands_bit_exact() {
    let (mut ts, rs) = open_ranks(2, 1 << 16);
    let caps = ts[0].caps().clone();
    assert_eq!(caps.provider, PROVIDER);
    assert!(!caps.ordered, "tcp;ofi_rxm must be treated as unordered");
    assert!(!caps.native_atomics);
    let data = pattern(1, 4097);
    rs[0].write(100, &data).unwrap();
    let (mut done, mut arr) = empty(2);
    // The first post to a peer may answer WouldBlock while ofi_rxm connects.
    post_retry(&mut ts, &mut done, &mut arr, 0, |t| {
        t.post_write(WriteOp {
            peer: 1,
            local_off: 100,
            remote_off: 1000,
            len: data.len(),
            imm: 0xDEAD_BEEF,
            ctx: 42,
        })
    });
    pump_until(&mut ts, &mut done, &mut arr, "write+imm", |d, a| {
        !d[0].is_empty() && !a[1].is_empty()
    });
    assert_eq!(done[0], vec![Completion::Write { ctx: 42 }]);
    assert_eq!(arr[1], vec![Arrival { imm: 0xDEAD_BEEF }]);
    assert_eq!(rs[1].to_vec(1000, data.len()).unwrap(), data);
    // Nothing outside the target range was touched.
    assert!(rs[1].to_vec(0, 1000).unwrap().iter().all(|&b| b == 0));
    assert!(rs[1]
        .to_vec(1000 + 4097, 100)
        .unwrap()
        .iter()
        .all(|&b| b == 0));
    assert!(arr[0].is_empty(), "the sender must not see an arrival");
    // And the reverse direction.
    let back = pattern(2, 33);
    rs[1].write(0, &back).unwrap();
    post_retry(&mut ts, &mut done, &mut arr, 1, |t| {
        t.post_write(WriteOp {
            peer: 0,
            local_off: 0,
            remote_off: 60_000,
            len: back.len(),
            imm: 7,
            ctx: 8,
        })
    });
    pump_until(&mut ts, &mut done, &mut arr, "reverse write", |d, a| {
        !d[1].is_empty() && !a[0].is_empty()
    });
    assert_eq!(arr[0], vec![Arrival { imm: 7 }]);
    assert_eq!(rs[0].to_vec(60_000, 33).unwrap(), back);
}

#[test]
fn a_replaced_peer_gets_the_writes_and_answers() {
    // Rank 1 goes away (its endpoint closes, as when its process dies) and a new
    // endpoint takes its place: rank 0 learns the new address, and both directions
    // carry writes and immediates again.
    let (mut ts, rs) = open_ranks(2, 1 << 16);
    let (mut done, mut arr) = empty(2);
    let write = |peer, imm, ctx| WriteOp {
        peer,
        local_off: 0,
        remote_off: 512,
        len: 64,
        imm,
        ctx,
    };
    rs[0].write(0, &pattern(3, 64)).unwrap();
    post_retry(&mut ts, &mut done, &mut arr, 0, |t| {
        t.post_write(write(1, 1, 1))
    });
    pump_until(&mut ts, &mut done, &mut arr, "first write", |d, a| {
        !d[0].is_empty() && !a[1].is_empty()
    });
    drop(ts.pop());
    let fresh = HeapRegion::new(1 << 16);
    let opts = FabricOptions::loopback(PROVIDER);
    let mut new = LibfabricTransport::new(&opts, RegionRef::from_heap(&fresh)).unwrap();
    let err = ts[0].replace_peer(1, &PeerAddr(Vec::new())).unwrap_err();
    assert!(err.to_string().contains("an address"), "{err}");
    ts[0].replace_peer(1, &new.local_addr()).unwrap();
    new.connect(&[ts[0].local_addr(), PeerAddr(Vec::new())])
        .unwrap();
    ts.push(new);
    let (mut done, mut arr) = empty(2);
    rs[0].write(0, &pattern(4, 64)).unwrap();
    post_retry(&mut ts, &mut done, &mut arr, 0, |t| {
        t.post_write(write(1, 2, 2))
    });
    pump_until(
        &mut ts,
        &mut done,
        &mut arr,
        "write to the replacement",
        |d, a| !d[0].is_empty() && !a[1].is_empty(),
    );
    assert_eq!(arr[1], vec![Arrival { imm: 2 }]);
    assert_eq!(fresh.to_vec(512, 64).unwrap(), pattern(4, 64));
    fresh.write(0, &pattern(5, 64)).unwrap();
    post_retry(&mut ts, &mut done, &mut arr, 1, |t| {
        t.post_write(write(0, 3, 3))
    });
    pump_until(
        &mut ts,
        &mut done,
        &mut arr,
        "the replacement's write",
        |d, a| !d[1].is_empty() && !a[0].is_empty(),
    );
    assert_eq!(arr[0], vec![Arrival { imm: 3 }]);
    assert_eq!(rs[0].to_vec(512, 64).unwrap(), pattern(5, 64));
}

#[test]
fn many_writes_varied_sizes_arrive_exactly_once() {
    const MIB: usize = 1 << 20;
    let (mut ts, rs) = open_ranks(3, 8 * MIB);
    // Sizes 1 B .. 1 MiB, from rank 0 and rank 2 into disjoint slices of rank 1.
    let mut sizes: Vec<usize> = (0..=20).map(|s| 1usize << s).collect();
    sizes.extend([3, 17, 1000, 4095, 4097, 65_537, MIB - 1]);
    let (mut done, mut arr) = empty(3);
    let mut expect = HashMap::new();
    let mut dst = 0usize;
    let mut imm = 1u32;
    for (k, &len) in sizes.iter().enumerate() {
        for from in [0usize, 2] {
            let data = pattern(imm as u64, len);
            // Each sender reuses its source area after the previous completion.
            let src = (k * 4096) % MIB;
            rs[from].write(src, &data).unwrap();
            post_retry(&mut ts, &mut done, &mut arr, from, |t| {
                t.post_write(WriteOp {
                    peer: 1,
                    local_off: src as u64,
                    remote_off: dst as u64,
                    len,
                    imm,
                    ctx: imm as u64,
                })
            });
            // The source must stay unchanged until completion: wait for it.
            pump_until(&mut ts, &mut done, &mut arr, "source completion", |d, _| {
                d[from].iter().any(|c| c.ctx() == imm as u64)
            });
            expect.insert(imm, (dst, data));
            dst += len;
            imm += 1;
        }
    }
    let total = expect.len();
    pump_until(&mut ts, &mut done, &mut arr, "all arrivals", |_, a| {
        a[1].len() >= total
    });
    // One more round to catch duplicates.
    poll_all(&mut ts, &mut done, &mut arr);
    let mut seen: Vec<u32> = arr[1].iter().map(|a| a.imm).collect();
    seen.sort_unstable();
    assert_eq!(
        seen,
        (1..=total as u32).collect::<Vec<_>>(),
        "each imm exactly once"
    );
    for (imm, (off, data)) in &expect {
        assert_eq!(&rs[1].to_vec(*off, data.len()).unwrap(), data, "imm {imm}");
    }
    assert!(arr[0].is_empty() && arr[2].is_empty());
}

#[test]
fn imm_only_writes() {
    let (mut ts, rs) = open_ranks(2, 4096);
    let (mut done, mut arr) = empty(2);
    for i in 0..100u32 {
        post_retry(&mut ts, &mut done, &mut arr, 0, |t| {
            t.post_imm(1, 0x8000_0000 | i, u64::from(i))
        });
    }
    pump_until(&mut ts, &mut done, &mut arr, "imm-only", |d, a| {
        d[0].len() >= 100 && a[1].len() >= 100
    });
    let mut imms: Vec<u32> = arr[1].iter().map(|a| a.imm).collect();
    imms.sort_unstable();
    assert_eq!(imms, (0..100).map(|i| 0x8000_0000 | i).collect::<Vec<_>>());
    let mut ctxs: Vec<u64> = done[0].iter().map(Completion::ctx).collect();
    ctxs.sort_unstable();
    assert_eq!(ctxs, (0..100).collect::<Vec<_>>());
    assert!(
        rs[1].to_vec(0, 4096).unwrap().iter().all(|&b| b == 0),
        "no bytes written"
    );
}

#[test]
fn out_of_region_posts_are_rejected_before_sending() {
    // Rank 0 has 4096 bytes, rank 1 has 8192, so local and remote bounds differ.
    let opts = FabricOptions::loopback(PROVIDER);
    let (r4k, r8k) = (HeapRegion::new(4096), HeapRegion::new(8192));
    let mut pair = vec![
        LibfabricTransport::new(&opts, RegionRef::from_heap(&r4k)).unwrap(),
        LibfabricTransport::new(&opts, RegionRef::from_heap(&r8k)).unwrap(),
    ];
    let addrs: Vec<_> = pair.iter().map(|t| t.local_addr()).collect();
    for t in &mut pair {
        t.connect(&addrs).unwrap();
    }
    let (mut done, mut arr) = empty(2);

    let e = pair[0]
        .post_write(WriteOp {
            peer: 1,
            local_off: 4000,
            remote_off: 0,
            len: 200,
            imm: 1,
            ctx: 1,
        })
        .unwrap_err();
    match &e {
        TransportError::OutOfBounds {
            side,
            peer,
            local_off,
            len,
            region_len,
            ..
        } => {
            assert_eq!(
                (*side, *peer, *local_off, *len, *region_len),
                (Side::Local, 1, 4000, 200, 4096)
            );
        }
        other => panic!("expected OutOfBounds, got {other}"),
    }
    let msg = e.to_string();
    assert!(msg.contains("peer 1") && msg.contains("4096"), "{msg}");
    let e = pair[0]
        .post_write(WriteOp {
            peer: 1,
            local_off: 0,
            remote_off: 8100,
            len: 100,
            imm: 2,
            ctx: 2,
        })
        .unwrap_err();
    assert!(
        matches!(
            e,
            TransportError::OutOfBounds {
                side: Side::Remote,
                region_len: 8192,
                remote_off: 8100,
                ..
            }
        ),
        "{e}"
    );
    let e = pair[0]
        .post_write(WriteOp {
            peer: 1,
            local_off: 0,
            remote_off: u64::MAX - 10,
            len: 100,
            imm: 3,
            ctx: 3,
        })
        .unwrap_err();
    assert!(matches!(e, TransportError::OutOfBounds { .. }), "{e}");
    let e = pair[0]
        .post_write(WriteOp {
            peer: 7,
            local_off: 0,
            remote_off: 0,
            len: 8,
            imm: 4,
            ctx: 4,
        })
        .unwrap_err();
    assert!(matches!(e, TransportError::BadPeer { peer: 7, .. }), "{e}");
    let e = pair[0].post_imm(5, 4, 4).unwrap_err();
    assert!(matches!(e, TransportError::BadPeer { peer: 5, .. }), "{e}");
    // In-bounds at the very edge is fine (remote end == region length).
    post_retry(&mut pair, &mut done, &mut arr, 0, |t| {
        t.post_write(WriteOp {
            peer: 1,
            local_off: 0,
            remote_off: 8192 - 64,
            len: 64,
            imm: 9,
            ctx: 9,
        })
    });
    pump_until(&mut pair, &mut done, &mut arr, "edge write", |d, a| {
        !d[0].is_empty() && !a[1].is_empty()
    });
    // Only the valid write was ever sent.
    assert_eq!(arr[1], vec![Arrival { imm: 9 }]);
    assert_eq!(done[0], vec![Completion::Write { ctx: 9 }]);
    let e = pair[0].post_atomic_add(1, 0, 1, 1).unwrap_err();
    assert!(matches!(e, TransportError::Unsupported { .. }), "{e}");
}

#[test]
fn connect_rejects_bad_addresses() {
    let opts = FabricOptions::loopback(PROVIDER);
    let (ra, rb) = (HeapRegion::new(64), HeapRegion::new(64));
    let mut a = LibfabricTransport::new(&opts, RegionRef::from_heap(&ra)).unwrap();
    let mut b = LibfabricTransport::new(&opts, RegionRef::from_heap(&rb)).unwrap();
    let e = b
        .connect(&[a.local_addr(), PeerAddr(vec![1, 2, 3])])
        .unwrap_err();
    assert!(
        matches!(e, TransportError::BadPeerAddr { peer: 1, .. }),
        "{e}"
    );
    assert!(
        matches!(
            a.post_imm(0, 0, 0),
            Err(TransportError::BadPeer { peer: 0, .. })
        ),
        "posting before connect must fail"
    );
    // Empty entries are allowed (own slot), but cannot be targeted.
    let own = a.local_addr();
    a.connect(&[own, PeerAddr::default()]).unwrap();
    assert!(matches!(
        a.post_imm(1, 0, 0),
        Err(TransportError::BadPeer { peer: 1, .. })
    ));
    assert!(a.connect(&[]).is_err(), "second connect must be refused");
}

#[test]
fn burst_of_10k_small_writes_handles_would_block() {
    const N: u32 = 10_000;
    let (mut ts, rs) = open_ranks(2, 1 << 20);
    for i in 0..N as usize {
        rs[0].write(i * 64, &(i as u64).to_le_bytes()).unwrap();
    }
    let (mut done, mut arr) = empty(2);
    let mut blocked = 0;
    for i in 0..N {
        let off = u64::from(i) * 64;
        blocked += post_retry(&mut ts, &mut done, &mut arr, 0, |t| {
            t.post_write(WriteOp {
                peer: 1,
                local_off: off,
                remote_off: off,
                len: 8,
                imm: i,
                ctx: u64::from(i),
            })
        });
    }
    assert!(
        blocked > 0,
        "a 10k burst without polling should hit WouldBlock at least once"
    );
    pump_until(&mut ts, &mut done, &mut arr, "10k arrivals", |d, a| {
        d[0].len() >= N as usize && a[1].len() >= N as usize
    });
    let mut imms: Vec<u32> = arr[1].iter().map(|a| a.imm).collect();
    imms.sort_unstable();
    assert_eq!(imms, (0..N).collect::<Vec<_>>());
    for i in (0..N as usize).step_by(97) {
        assert_eq!(rs[1].to_vec(i * 64, 8).unwrap(), (i as u64).to_le_bytes());
    }
}

#[test]
fn faulty_over_libfabric_delivers_exactly_once_and_reorders() {
    const DATA: u32 = 12;
    const SIGNAL: u32 = 0xFFFF_0000;
    let mut signal_overtook = false;
    for seed in 0..6u64 {
        let (ts, rs) = open_ranks(2, 1 << 20);
        let cfg = FaultConfig {
            seed,
            window: 16,
            delay_prob: 0.25,
            max_delay_polls: 3,
            split_prob: 0.4,
        };
        let mut fs: Vec<_> = ts
            .into_iter()
            .map(|t| FaultyTransport::new(t, cfg.clone()).unwrap())
            .collect();
        let (mut done, mut arr) = empty(2);
        let mut expect = HashMap::new();
        for i in 0..DATA {
            let len = 1 + (i as usize * 7919) % 30_000;
            let data = pattern(seed * 100 + u64::from(i), len);
            let off = i as usize * 32_768;
            rs[0].write(off, &data).unwrap();
            post_retry(&mut fs, &mut done, &mut arr, 0, |t| {
                t.post_write(WriteOp {
                    peer: 1,
                    local_off: off as u64,
                    remote_off: off as u64,
                    len,
                    imm: i,
                    ctx: u64::from(i),
                })
            });
            expect.insert(i, (off, data));
        }
        post_retry(&mut fs, &mut done, &mut arr, 0, |t| {
            t.post_imm(1, SIGNAL, 999)
        });
        // Check each data write at the moment its imm is observed.
        let start = Instant::now();
        let mut checked = 0;
        let mut order = Vec::new();
        while order.len() < DATA as usize + 1 || done[0].len() < DATA as usize + 1 {
            poll_all(&mut fs, &mut done, &mut arr);
            for a in arr[1].drain(..) {
                order.push(a.imm);
                if let Some((off, data)) = expect.get(&a.imm) {
                    assert_eq!(
                        &rs[1].to_vec(*off, data.len()).unwrap(),
                        data,
                        "seed {seed} imm {}",
                        a.imm
                    );
                    checked += 1;
                }
            }
            assert!(
                start.elapsed() < DEADLINE,
                "seed {seed}: stuck with {} arrivals",
                order.len()
            );
        }
        poll_all(&mut fs, &mut done, &mut arr);
        assert!(
            arr[1].is_empty(),
            "seed {seed}: duplicate arrivals {:?}",
            arr[1]
        );
        assert_eq!(checked, DATA);
        let mut sorted = order.clone();
        sorted.sort_unstable();
        let mut want: Vec<u32> = (0..DATA).collect();
        want.push(SIGNAL);
        assert_eq!(sorted, want, "seed {seed}: every imm exactly once");
        let mut ctxs: Vec<u64> = done[0].iter().map(Completion::ctx).collect();
        ctxs.sort_unstable();
        let mut want_ctx: Vec<u64> = (0..u64::from(DATA)).collect();
        want_ctx.push(999);
        assert_eq!(ctxs, want_ctx, "seed {seed}: completions exactly once");
        let st = fs[0].fault_stats();
        assert!(st.injected() > 0, "seed {seed}: no faults injected {st:?}");
        assert_eq!(
            (st.posted, st.issued),
            (u64::from(DATA) + 1, u64::from(DATA) + 1)
        );
        let sig_pos = order.iter().position(|&x| x == SIGNAL).unwrap();
        if sig_pos < DATA as usize {
            signal_overtook = true;
        }
    }
    assert!(
        signal_overtook,
        "for no seed did the signal arrive before earlier data"
    );
}

#[test]
fn list_providers_includes_tcp() {
    let ps = list_providers().expect("list_providers");
    let tcp: Vec<_> = ps.iter().filter(|p| p.provider == PROVIDER).collect();
    assert!(
        !tcp.is_empty(),
        "no {PROVIDER} in {:?}",
        ps.iter().map(|p| &p.provider).collect::<Vec<_>>()
    );
    assert!(tcp.iter().any(|p| p.fits()), "{tcp:#?}");
    assert!(tcp.iter().all(|p| !p.ordered));
}

fn provider_available(name: &str) -> bool {
    let ok = list_providers()
        .unwrap()
        .iter()
        .any(|p| p.provider == name && p.fits());
    if !ok {
        // Only the provider's absence skips; the Debian 1.17 build has all of these.
        eprintln!("skipping: libfabric offers no usable {name:?} provider here");
    }
    ok
}

#[test]
fn other_providers_carry_write_and_imm() {
    // shm has FI_MR_VIRT_ADDR (remote address = peer base + offset), so it
    // exercises the other addressing mode; udp;ofi_rxd is a different
    // reliability layer; sockets proves ordering.
    for (prov, node, virt) in [
        ("shm", None, true),
        ("udp;ofi_rxd", Some("127.0.0.1"), false),
        ("sockets", Some("127.0.0.1"), false),
    ] {
        if !provider_available(prov) {
            continue;
        }
        let opts = FabricOptions {
            provider: prov.into(),
            domain: None,
            node: node.map(Into::into),
            atomics: false,
        };
        let (mut ts, rs) = open_ranks_with(&opts, 2, 1 << 16);
        assert_eq!(ts[0].caps().provider, prov);
        assert_eq!(
            ts[0]
                .provider_info()
                .mr_mode
                .iter()
                .any(|m| m == "VIRT_ADDR"),
            virt,
            "{prov}: {:?}",
            ts[0].provider_info()
        );
        let data = pattern(3, 3000);
        rs[0].write(10, &data).unwrap();
        let (mut done, mut arr) = empty(2);
        post_retry(&mut ts, &mut done, &mut arr, 0, |t| {
            t.post_write(WriteOp {
                peer: 1,
                local_off: 10,
                remote_off: 50_000,
                len: data.len(),
                imm: 11,
                ctx: 1,
            })
        });
        post_retry(&mut ts, &mut done, &mut arr, 0, |t| t.post_imm(1, 12, 2));
        pump_until(&mut ts, &mut done, &mut arr, prov, |d, a| {
            d[0].len() >= 2 && a[1].len() >= 2
        });
        let mut imms: Vec<u32> = arr[1].iter().map(|a| a.imm).collect();
        imms.sort_unstable();
        assert_eq!(imms, vec![11, 12], "{prov}");
        assert_eq!(rs[1].to_vec(50_000, data.len()).unwrap(), data, "{prov}");
        assert!(
            rs[1].to_vec(0, 50_000).unwrap().iter().all(|&b| b == 0),
            "{prov}"
        );
    }
}

#[test]
fn sockets_native_atomic_add_after_write() {
    if !provider_available("sockets") {
        return;
    }
    let opts = FabricOptions {
        atomics: true,
        ..FabricOptions::loopback("sockets")
    };
    let (mut ts, rs) = open_ranks_with(&opts, 2, 4096);
    // sockets advertises RMA/ATOMIC WAW order and strict rx completion order.
    assert!(
        ts[0].caps().ordered && ts[0].caps().native_atomics,
        "{:?}",
        ts[0].caps()
    );
    let (mut done, mut arr) = empty(2);
    rs[0].write(0, &[9u8; 16]).unwrap();
    post_retry(&mut ts, &mut done, &mut arr, 0, |t| {
        t.post_write(WriteOp {
            peer: 1,
            local_off: 0,
            remote_off: 64,
            len: 16,
            imm: 1,
            ctx: 1,
        })
    });
    post_retry(&mut ts, &mut done, &mut arr, 0, |t| {
        t.post_atomic_add(1, 128, 40, 2)
    });
    post_retry(&mut ts, &mut done, &mut arr, 0, |t| {
        t.post_atomic_add(1, 128, 2, 3)
    });
    pump_until(&mut ts, &mut done, &mut arr, "atomics", |d, a| {
        d[0].len() >= 3 && !a[1].is_empty()
    });
    let atomics: Vec<_> = done[0]
        .iter()
        .filter(|c| matches!(c, Completion::Atomic { .. }))
        .map(Completion::ctx)
        .collect();
    assert_eq!(atomics.len(), 2, "{:?}", done[0]);
    assert_eq!(rs[1].load_u64(128).unwrap(), 42);
    assert_eq!(rs[1].to_vec(64, 16).unwrap(), vec![9u8; 16]);
    let e = ts[0].post_atomic_add(1, 4, 1, 4).unwrap_err();
    assert!(
        matches!(e, TransportError::Misaligned { remote_off: 4, .. }),
        "{e}"
    );
    let e = ts[0].post_atomic_add(1, 4096, 1, 5).unwrap_err();
    assert!(
        matches!(
            e,
            TransportError::OutOfBounds {
                side: Side::Remote,
                ..
            }
        ),
        "{e}"
    );
    // Without asking for atomics, the same provider reports none.
    let (plain, _r) = open_ranks_with(&FabricOptions::loopback("sockets"), 1, 64);
    assert!(!plain[0].caps().native_atomics);
}

#[test]
fn transports_move_to_proxy_threads() {
    fn assert_send<T: Send>() {}
    assert_send::<LibfabricTransport>();
    assert_send::<FaultyTransport<LibfabricTransport>>();
    assert_send::<Box<dyn Transport>>();

    // Like proxies: each endpoint is created here and then owned and polled
    // by its own thread; rank 0 sends, rank 1 receives.
    const N: u32 = 500;
    let (mut ts, rs) = open_ranks(2, 1 << 16);
    for i in 0..N as usize {
        rs[0].write(i * 8, &(i as u64 * 3).to_le_bytes()).unwrap();
    }
    let mut rx = ts.pop().unwrap();
    let mut tx: Box<dyn Transport> = Box::new(ts.pop().unwrap());
    let receiver = std::thread::spawn(move || {
        let start = Instant::now();
        let mut arr = Vec::new();
        let mut done = Vec::new();
        while arr.len() < N as usize {
            rx.poll_recv(&mut arr).unwrap();
            rx.poll_send(&mut done).unwrap();
            assert!(
                start.elapsed() < DEADLINE,
                "receiver got {} of {N}",
                arr.len()
            );
        }
        arr
    });
    let sender = std::thread::spawn(move || {
        let start = Instant::now();
        let mut done = Vec::new();
        let mut arr = Vec::new();
        let mut i = 0;
        while done.len() < N as usize {
            if i < N {
                let off = u64::from(i) * 8;
                match tx.post_write(WriteOp {
                    peer: 1,
                    local_off: off,
                    remote_off: off,
                    len: 8,
                    imm: i,
                    ctx: u64::from(i),
                }) {
                    Ok(()) => i += 1,
                    Err(TransportError::WouldBlock) => {}
                    Err(e) => panic!("{e}"),
                }
            }
            tx.poll_send(&mut done).unwrap();
            tx.poll_recv(&mut arr).unwrap();
            assert!(
                start.elapsed() < DEADLINE,
                "sender stuck at {} completions",
                done.len()
            );
        }
        tx
    });
    let arr = receiver.join().unwrap();
    drop(sender.join().unwrap());
    let mut imms: Vec<u32> = arr.iter().map(|a| a.imm).collect();
    imms.sort_unstable();
    assert_eq!(imms, (0..N).collect::<Vec<_>>());
    for i in 0..N as usize {
        assert_eq!(
            rs[1].to_vec(i * 8, 8).unwrap(),
            (i as u64 * 3).to_le_bytes()
        );
    }
}

#[test]
fn unknown_provider_and_mixed_providers_are_clear_errors() {
    let r = HeapRegion::new(64);
    let e = LibfabricTransport::new(
        &FabricOptions::loopback("no-such-provider"),
        RegionRef::from_heap(&r),
    )
    .unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.contains("no-such-provider") && msg.contains("UEP_FI_PROVIDER"),
        "{msg}"
    );
    if !provider_available("sockets") {
        return;
    }
    let rs = HeapRegion::new(64);
    let sock = LibfabricTransport::new(
        &FabricOptions::loopback("sockets"),
        RegionRef::from_heap(&rs),
    )
    .unwrap();
    let mut tcp =
        LibfabricTransport::new(&FabricOptions::loopback(PROVIDER), RegionRef::from_heap(&r))
            .unwrap();
    let e = tcp
        .connect(&[tcp.local_addr(), sock.local_addr()])
        .unwrap_err();
    let msg = e.to_string();
    assert!(
        matches!(e, TransportError::BadPeerAddr { peer: 1, .. }) && msg.contains("sockets"),
        "{msg}"
    );
}
