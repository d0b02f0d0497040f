//! Normal-mode streams past the old 64 (ranks x channels) limit, and the
//! per-stream send window, over an in-memory transport whose completions
//! the test controls.

mod common;

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{load, segment, wait_until, DEADLINE};
use uep_proxy::{cmds, CounterLayout, Proxy, ProxyConfig};
use uep_transport::{Arrival, Caps, Completion, PeerAddr, Transport, TransportError};
use uep_wire::{WriteImm, WRITE_SEQ_MODULUS};

/// The per-stream send window the proxy documents: half the seq modulus.
const SEND_WINDOW: usize = WRITE_SEQ_MODULUS as usize / 2;

/// One post as the "wire" saw it.
#[derive(Clone, Copy, Debug)]
struct Post {
    from: usize,
    to: usize,
    imm: u32,
}

#[derive(Default)]
struct Net {
    /// Every post, in posting order.
    posts: Vec<Post>,
    /// Arrivals not yet polled, per rank.
    inbox: Vec<VecDeque<u32>>,
    /// Send completions not yet polled, per rank.
    done: Vec<Vec<u64>>,
    /// Hold back the completion of the next this-many posts of rank 0.
    hold: usize,
    /// Completions held back.
    held: Vec<u64>,
}

/// Delivers every post at once (zero-length signals only: no data is
/// copied) and completes it on the sender's next poll, unless held.
struct MemTransport {
    rank: usize,
    net: Arc<Mutex<Net>>,
    caps: Caps,
}

fn mem_net(num_ranks: usize) -> Arc<Mutex<Net>> {
    Arc::new(Mutex::new(Net {
        inbox: vec![VecDeque::new(); num_ranks],
        done: vec![Vec::new(); num_ranks],
        ..Net::default()
    }))
}

fn mem(net: &Arc<Mutex<Net>>, rank: usize) -> Box<dyn Transport> {
    Box::new(MemTransport {
        rank,
        net: Arc::clone(net),
        caps: Caps {
            ordered: false,
            native_atomics: false,
            max_write_bytes: 1 << 20,
            provider: "mem".into(),
        },
    })
}

impl Transport for MemTransport {
    fn caps(&self) -> &Caps {
        &self.caps
    }
    fn local_addr(&self) -> PeerAddr {
        PeerAddr(vec![self.rank as u8])
    }
    fn connect(&mut self, _peers: &[PeerAddr]) -> Result<(), TransportError> {
        Ok(())
    }
    fn validate_write(
        &self,
        peer: usize,
        _local_off: u64,
        _remote_off: u64,
        len: usize,
    ) -> Result<(), TransportError> {
        let ranks = self.net.lock().unwrap().inbox.len();
        if peer >= ranks || len != 0 {
            return Err(TransportError::Invalid(format!(
                "mem transport: peer {peer} of {ranks}, len {len} (only signals)"
            )));
        }
        Ok(())
    }
    fn post_write(
        &mut self,
        peer: usize,
        local_off: u64,
        remote_off: u64,
        len: usize,
        imm: u32,
        ctx: u64,
    ) -> Result<(), TransportError> {
        self.validate_write(peer, local_off, remote_off, len)?;
        self.post_imm(peer, imm, ctx)
    }
    fn post_imm(&mut self, peer: usize, imm: u32, ctx: u64) -> Result<(), TransportError> {
        self.validate_write(peer, 0, 0, 0)?;
        let mut n = self.net.lock().unwrap();
        n.posts.push(Post {
            from: self.rank,
            to: peer,
            imm,
        });
        n.inbox[peer].push_back(imm);
        if self.rank == 0 && n.hold > 0 {
            n.hold -= 1;
            n.held.push(ctx);
        } else {
            n.done[self.rank].push(ctx);
        }
        Ok(())
    }
    fn post_atomic_add(
        &mut self,
        _peer: usize,
        _remote_off: u64,
        _value: u64,
        _ctx: u64,
    ) -> Result<(), TransportError> {
        Err(TransportError::Unsupported {
            op: "post_atomic_add",
            provider: "mem".into(),
            why: "emulated".into(),
        })
    }
    fn poll_send(&mut self, out: &mut Vec<Completion>) -> Result<usize, TransportError> {
        let mut n = self.net.lock().unwrap();
        let done = std::mem::take(&mut n.done[self.rank]);
        out.extend(done.iter().map(|&ctx| Completion::Write { ctx }));
        Ok(done.len())
    }
    fn poll_recv(&mut self, out: &mut Vec<Arrival>) -> Result<usize, TransportError> {
        let mut n = self.net.lock().unwrap();
        let k = n.inbox[self.rank].len();
        out.extend(n.inbox[self.rank].drain(..).map(|imm| Arrival { imm }));
        Ok(k)
    }
}

fn cfg() -> ProxyConfig {
    ProxyConfig {
        threads: 1,
        fifos_per_thread: 2,
        fifo_capacity: 4096,
        // Large, so that only the send window limits a stream.
        max_writes_in_flight_per_fifo: 4096,
        timeout: Duration::from_secs(20),
        ..ProxyConfig::default()
    }
}

/// 100 ranks x 2 channels: 200 streams, tails at 0..1600.
fn layout_100x2() -> CounterLayout {
    CounterLayout {
        num_ranks: 100,
        tail_base: 0,
        num_channels: 2,
        ll_base: 0,
        num_local_experts: 0,
        barrier_base: 1600,
        atomic_base: 0,
        num_atomic_slots: 0,
    }
}

/// Ranks 70 and 0 of a 100-rank job with 2 channels each (200 streams,
/// past the old 64) signal each other; every increment lands on the
/// sender's own (source, channel) tail and nowhere else.
#[test]
fn streams_above_64_end_to_end() {
    let net = mem_net(100);
    let l = layout_100x2();
    let segs = [segment(4096), segment(4096)];
    let ranks = [0usize, 70];
    let proxies: Vec<Proxy> = ranks
        .iter()
        .zip(&segs)
        .map(|(&r, s)| {
            Proxy::start(
                r,
                100,
                cfg(),
                s.region().clone(),
                l.clone(),
                vec![mem(&net, r)],
            )
        })
        .collect::<Result<_, _>>()
        .unwrap();
    let deadline = Instant::now() + DEADLINE;
    let push = |p: &Proxy, cmd| p.fifo(0, 0).unwrap().push(cmd, deadline).unwrap();
    push(&proxies[1], cmds::normal_write(0, 0, 0, 0, 1, 3).unwrap());
    push(&proxies[1], cmds::normal_write(0, 0, 0, 0, 0, 2).unwrap());
    push(&proxies[1], cmds::normal_write(0, 0, 0, 0, 1, 255).unwrap());
    push(&proxies[0], cmds::normal_write(70, 0, 0, 0, 1, 5).unwrap());
    for p in &proxies {
        p.wake();
    }
    let (r0, r70) = (segs[0].region().clone(), segs[1].region().clone());
    wait_until("rank 0's tails of rank 70", || {
        load(&r0, l.tail(70, 1).unwrap()) == 258 && load(&r0, l.tail(70, 0).unwrap()) == 2
    });
    wait_until("rank 70's tail of rank 0", || {
        load(&r70, l.tail(0, 1).unwrap()) == 5
    });
    for p in &proxies {
        p.check().unwrap();
    }
    // The immediates named streams 141 (= 70 * 2 + 1) and 140, and 1.
    let posts = net.lock().unwrap().posts.clone();
    let mut streams: Vec<(usize, usize, u16, u16)> = posts
        .iter()
        .map(|p| {
            let w = WriteImm::decode(p.imm).unwrap();
            (p.from, p.to, w.stream, w.seq)
        })
        .collect();
    streams.sort();
    assert_eq!(
        streams,
        [
            (0, 70, 1, 0),
            (70, 0, 140, 0),
            (70, 0, 141, 0),
            (70, 0, 141, 1)
        ]
    );
    // Nothing else moved.
    for (region, keep) in [(&r0, &[(70, 0), (70, 1)][..]), (&r70, &[(0, 1)][..])] {
        for src in 0..100 {
            for ch in 0..2 {
                if !keep.contains(&(src, ch)) {
                    assert_eq!(load(region, l.tail(src, ch).unwrap()), 0, "({src}, {ch})");
                }
            }
        }
    }
    for p in &proxies {
        p.request_stop();
    }
    for p in proxies {
        p.shutdown().unwrap();
    }
}

/// A layout past 1024 streams fails at start, saying what fits.
#[test]
fn too_many_streams_fail_at_start() {
    let net = mem_net(100);
    let seg = segment(1 << 16);
    let l = CounterLayout {
        num_channels: 11,
        barrier_base: 8800,
        ..layout_100x2()
    };
    let err = Proxy::start(0, 100, cfg(), seg.region().clone(), l, vec![mem(&net, 0)]).unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("1100") && msg.contains("1024") && msg.contains("at most 10 channels"),
        "{msg}"
    );
}

/// While the oldest write of a stream has no send completion, the proxy
/// posts at most SEND_WINDOW writes of that stream (so the receiver can
/// never see two pending writes whose 12-bit seqs alias); other streams
/// keep going, and the rest follow once the completion comes.
#[test]
fn send_window_waits_for_the_oldest_completion() {
    let net = mem_net(2);
    net.lock().unwrap().hold = 1;
    let l = CounterLayout {
        num_ranks: 2,
        num_channels: 2,
        barrier_base: 32,
        ..layout_100x2()
    };
    let seg = segment(4096);
    let proxy = Proxy::start(0, 2, cfg(), seg.region().clone(), l, vec![mem(&net, 0)]).unwrap();
    let deadline = Instant::now() + DEADLINE;
    let n = SEND_WINDOW + 52;
    let fifo = proxy.fifo(0, 0).unwrap();
    for _ in 0..n {
        fifo.push(cmds::normal_write(1, 0, 0, 0, 0, 1).unwrap(), deadline)
            .unwrap();
    }
    proxy.wake();
    let posted = |stream: u16| {
        net.lock()
            .unwrap()
            .posts
            .iter()
            .filter(|p| WriteImm::decode(p.imm).unwrap().stream == stream)
            .count()
    };
    wait_until("a full window of stream 0", || posted(0) >= SEND_WINDOW);
    // Another stream (channel 1, from the other FIFO) is not held up.
    proxy
        .fifo(0, 1)
        .unwrap()
        .push(cmds::normal_write(1, 0, 0, 0, 1, 1).unwrap(), deadline)
        .unwrap();
    proxy.wake();
    wait_until("stream 1's write", || posted(1) == 1);
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(posted(0), SEND_WINDOW, "stream 0 went past its window");
    assert_eq!(proxy.stats().writes_posted, SEND_WINDOW as u64 + 1);
    proxy.check().unwrap();
    // Release the oldest completion: the rest go.
    {
        let mut g = net.lock().unwrap();
        let held = std::mem::take(&mut g.held);
        g.done[0].extend(held);
    }
    proxy.wake();
    wait_until("every write of stream 0", || posted(0) == n);
    let seqs: Vec<u16> = net
        .lock()
        .unwrap()
        .posts
        .iter()
        .map(|p| WriteImm::decode(p.imm).unwrap())
        .filter(|w| w.stream == 0)
        .map(|w| w.seq)
        .collect();
    assert_eq!(seqs, (0..n as u16).collect::<Vec<_>>());
    proxy.request_stop();
    proxy.shutdown().unwrap();
}
