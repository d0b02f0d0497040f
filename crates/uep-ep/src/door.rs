//! The door of an elastic job: where a process started to replace a masked rank finds
//! the job, asks to be let in, and is told where the job is.
//!
//! A set of records that rank 0 makes when the Buffers are, kept in one of two places
//! ([`BufferConfig::door`](crate::BufferConfig::door) names it, and
//! [`BufferConfig::door_store`](crate::BufferConfig::door_store) says where):
//!
//! * **the job's store** ([`uep_bootstrap::Store`]), which every host reaches and the
//!   launcher keeps (torchrun's `TCPStore` at `MASTER_ADDR:MASTER_PORT` from Python,
//!   `uep bench`'s own): a record is one value, read and written whole, at
//!   `{door}/header` or `{door}/{job token}/{word offset}`;
//! * **a shared-memory segment** on this host, when every rank is on it: every word is
//!   atomic; a record is published by its first word, stored last (release) and read
//!   first (acquire).
//!
//! Both hold the same records, at the same word offsets:
//!
//! | block | words | what |
//! |---|---|---|
//! | header | 5 + 11 | magic, ranks, digest of the config, region bytes, job token; the shapes (normal, low-latency: experts, hidden, top-k, tokens), ranks per node, the room for ranks (`max_ranks`), and ranks of a node in the job's topology, for a joiner that does not know them |
//! | `member[R]` | 2 + 1 + 8 | the rank's [`Process`] (id, host), then the [`MemHandle`] its node peers map its memory by (length, 64 bytes) |
//! | `request[R]` | 3 + 1 + 8 | a joiner's stamp (a random non-zero word), its process, its memory's handle |
//! | `welcome[R]` | 7 + W | the stamp of the request it answers, then [`Welcome`] |
//! | `reach[R]` | 1 + 128 | how a member is reached over the network ([`Reach`]: its proxy endpoints), its length first |
//! | `asking[R]` | 1 + 128 | a joiner's [`Reach`] (with where its liveness watch listens), written before its request |
//! | `ready[R][S]` | 1 | survivor `S` let the joiner of `R` in and is ready for its traffic: the stamp of the request it answered |
//! | `lost[R]` | 2 | the [`Process`] of `R` that a survivor found lost (for a joiner that waits for it to be ready and cannot ask its host) |
//!
//! A process id means something on its own host only: whether a member or a joiner is
//! gone is asked there ([`Process::gone`]); elsewhere the agreement's masks say it.
//! The survivors keep their memory's handles open while the door is, so that a joiner
//! maps its node's as a founding rank did.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use uep_bootstrap::Store;
use uep_shm::Segment;

use crate::config::{BufferConfig, JobStore, Shape};
use crate::error::{EpError, Result};
use crate::symm::{MemHandle, HANDLE_BYTES};
use crate::wait::process_gone;

const MAGIC: u64 = u64::from_le_bytes(*b"uepdoor3");
const HEADER: usize = 5 + 11;
/// The header's word that holds the job token (after magic, ranks, digest, bytes),
/// which a joiner reads first to find the job's records in a store.
const JOB_WORD: usize = 4;
/// Words of a memory handle in a record: its length, then its bytes.
const HANDLE_WORDS: usize = 1 + HANDLE_BYTES / 8;
const MEMBER: usize = 2 + HANDLE_WORDS;
const REQUEST: usize = 3 + HANDLE_WORDS;
const WELCOME: usize = 7;
/// Bytes of a [`Reach`] record, and its words with the length word.
const REACH_BYTES: usize = 1024;
const REACH: usize = 1 + REACH_BYTES / 8;
const LOST: usize = 2;

/// Which call a joiner makes first: the one the survivors let it in at.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FirstCall {
    /// A barrier.
    Barrier,
    /// A normal-mode dispatch.
    Dispatch,
    /// A low-latency dispatch.
    LowLatencyDispatch,
}

/// Where a replacement rank joined a running job ([`Buffer::join`](crate::Buffer::join)).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct JoinPoint {
    /// The survivors' step ([`Buffer::set_step`](crate::Buffer::set_step)) at the call
    /// the joiner makes first.
    pub step: u64,
    /// That call.
    pub first: FirstCall,
    /// How long the joiner waited at the door: from its request to the survivors'
    /// welcome.
    pub waited: std::time::Duration,
}

/// The call numbers of a Buffer between calls (the same on every rank).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Calls {
    pub ll_dispatch: u32,
    pub ll_combine: u32,
    pub normal_dispatch: u32,
    pub normal_combine: u32,
    pub barriers: u64,
}

/// Where the job is when a joiner is let in: what the survivors tell it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Welcome {
    /// Agreements so far, and the digest of their decisions.
    pub round: u64,
    pub digest: u64,
    pub calls: Calls,
    /// The caller's step ([`Buffer::set_step`](crate::Buffer::set_step)).
    pub step: u64,
    pub first: FirstCall,
    /// `[rank]`: masked in the call the joiner makes first (the joiner is not).
    pub masked: Vec<bool>,
}

/// How a rank is reached across nodes: what a process on another node needs to
/// connect to it (a joiner to a member, the survivors to a joiner).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Reach {
    /// `[proxy thread]`: the address of that thread's endpoint.
    pub addrs: Vec<Vec<u8>>,
    /// A joiner's: where its liveness watch listens for the survivors.
    pub watch: Option<crate::liveness::Advert>,
    /// Its host as the network path names it (in messages).
    pub host: String,
}

impl Reach {
    /// As a member publishes it: without the watch, which only a joiner announces.
    pub fn as_member(&self) -> Reach {
        Reach {
            watch: None,
            ..self.clone()
        }
    }

    fn encode(&self) -> Result<Vec<u8>> {
        let mut b = vec![u8::try_from(self.addrs.len()).map_err(|_| too_long("threads"))?];
        for a in &self.addrs {
            put_bytes(&mut b, a)?;
        }
        if let Some(w) = &self.watch {
            b.push(1);
            put_bytes(&mut b, w.host.as_bytes())?;
            b.extend(w.port.to_le_bytes());
            b.extend(w.nonce.to_le_bytes());
        } else {
            b.push(0);
        }
        put_bytes(&mut b, self.host.as_bytes())?;
        match b.len() <= REACH_BYTES {
            true => Ok(b),
            false => Err(too_long("addresses")),
        }
    }

    fn decode(b: &[u8]) -> Option<Reach> {
        let mut r = Reader(b);
        let n = r.take(1)?[0];
        let addrs = (0..n).map(|_| r.bytes()).collect::<Option<Vec<_>>>()?;
        let watch = match r.take(1) {
            Some([1]) => Some(crate::liveness::Advert {
                host: String::from_utf8(r.bytes()?).ok()?,
                port: u16::from_le_bytes(r.take(2)?.try_into().ok()?),
                nonce: u64::from_le_bytes(r.take(8)?.try_into().ok()?),
            }),
            _ => None,
        };
        let host = String::from_utf8(r.bytes()?).ok()?;
        Some(Reach { addrs, watch, host })
    }
}

fn too_long(what: &str) -> EpError {
    EpError::internal(format!(
        "a rank's {what} do not fit the door's {REACH_BYTES} bytes"
    ))
}

fn put_bytes(b: &mut Vec<u8>, v: &[u8]) -> Result<()> {
    b.extend(
        u16::try_from(v.len())
            .map_err(|_| too_long("addresses"))?
            .to_le_bytes(),
    );
    b.extend(v);
    Ok(())
}

/// Reads a [`Reach`]'s bytes in order.
struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let (head, rest) = (self.0.get(..n)?, self.0.get(n..)?);
        self.0 = rest;
        Some(head)
    }

    fn bytes(&mut self) -> Option<Vec<u8>> {
        let n = u16::from_le_bytes(self.take(2)?.try_into().ok()?);
        self.take(n.into()).map(<[u8]>::to_vec)
    }
}

/// A process, as the door names it: its id and the host it runs on (a digest of
/// [`uep_bootstrap::host_id`]), since a process id means something only there.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Process {
    pub pid: u32,
    pub host: u64,
}

impl Process {
    /// This process.
    pub fn me() -> Process {
        Process {
            pid: std::process::id(),
            host: this_host(),
        }
    }

    /// Whether it runs on this host.
    pub fn here(&self) -> bool {
        self.host == this_host()
    }

    /// Whether it is gone, if this host can tell (`None`: it runs on another host).
    pub fn gone(&self) -> Option<bool> {
        self.here().then(|| process_gone(self.pid))
    }
}

/// The digest of this host's identity that door records carry.
pub(crate) fn this_host() -> u64 {
    static HOST: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *HOST.get_or_init(|| crate::fnv::hash(uep_bootstrap::host_id().bytes().map(u64::from)))
}

/// A joiner's request, as the survivors read it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Request {
    pub stamp: u64,
    pub process: Process,
    pub handle: MemHandle,
}

/// The header: what a joiner learns of the job before it asks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Header {
    /// The digest of the config every rank shares, its region bytes, and the job token.
    pub digest: u64,
    pub bytes: usize,
    pub job: u64,
    /// The shapes and ranks per node of the config (the rest is each rank's own).
    pub normal: Option<Shape>,
    pub ll: Option<Shape>,
    pub ranks_per_node: Option<usize>,
    pub max_ranks: Option<usize>,
    /// Ranks of a node in the job's topology (what its hosts and ranks per node made).
    pub node_ranks: usize,
}

/// Where the records are kept.
enum Backing {
    /// A shared-memory segment on this host: every word atomic, a record published by
    /// its first word, stored last (release) and read first (acquire).
    Shm(Segment),
    /// The job's store, reached from every host: a record is one value (whole, old or
    /// new), at `{name}/header` or `{name}/{job}/{word offset}`.
    Store {
        store: Arc<dyn Store>,
        name: String,
        job: u64,
    },
}

/// The door, opened.
pub(crate) struct Door {
    backing: Backing,
    ranks: usize,
    words: usize,
    /// When a survivor last looked for requests (a look at a store is a round trip).
    looked: std::cell::Cell<Option<std::time::Instant>>,
}

/// How often a survivor looks for requests at a door in a store: at most once in this
/// long, so that a rank masked for good costs a serving loop one round trip in many
/// calls, not one a call. (A joiner is let in up to this much later.)
const STORE_LOOKS: Duration = Duration::from_millis(10);

impl std::fmt::Debug for Door {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.backing {
            Backing::Shm(seg) => write!(f, "Door({})", seg.path().display()),
            Backing::Store { name, store, .. } => write!(f, "Door({name} in {store:?})"),
        }
    }
}

fn len(ranks: usize, words: usize) -> usize {
    8 * (HEADER + ranks * (MEMBER + REQUEST + WELCOME + words + 2 * REACH + ranks + LOST))
}

impl Door {
    /// Make door `name` (in `store`, or shared memory on this host) for the `ranks`
    /// ranks of a job with config `cfg` (rank 0, once), replacing a stale one.
    pub fn create(
        (name, store): (&str, Option<&JobStore>),
        ranks: usize,
        cfg: &BufferConfig,
        (digest, bytes, job, node_ranks): (u64, usize, u64, usize),
    ) -> Result<Door> {
        let words = crate::map::mask_words(ranks);
        let backing = match store {
            Some(store) => Backing::Store {
                store: store.0.clone(),
                name: name.into(),
                job,
            },
            None => {
                // A door left by a job that was killed: its ranks are gone.
                let _ = std::fs::remove_file(std::path::Path::new(uep_shm::SHM_DIR).join(name));
                Backing::Shm(Segment::create(name, len(ranks, words))?)
            }
        };
        let door = Door {
            backing,
            ranks,
            words,
            looked: Default::default(),
        };
        let shape = |s: &Option<Shape>| match s {
            Some(s) => [s.num_experts, s.hidden, s.topk, s.max_tokens].map(|v| v as u64),
            None => [0; 4],
        };
        let header: Vec<u64> = [MAGIC, ranks as u64, digest, bytes as u64, job]
            .into_iter()
            .chain(shape(&cfg.normal))
            .chain(shape(&cfg.ll))
            .chain([cfg.ranks_per_node, cfg.max_ranks].map(|v| v.unwrap_or(0) as u64))
            .chain([node_ranks as u64])
            .collect();
        door.put(0, &header)?;
        Ok(door)
    }

    /// Open door `name` (in `store`, or shared memory on this host) of a job of `ranks`
    /// ranks, waiting up to `timeout` for it.
    pub fn open(
        (name, store): (&str, Option<&JobStore>),
        ranks: usize,
        timeout: Duration,
    ) -> Result<Door> {
        let words = crate::map::mask_words(ranks);
        let backing = match store {
            Some(store) => Backing::Store {
                job: find_job(store.0.as_ref(), name, timeout)?,
                store: store.0.clone(),
                name: name.into(),
            },
            None => Backing::Shm(Segment::open(name, len(ranks, words), timeout)?),
        };
        let door = Door {
            backing,
            ranks,
            words,
            looked: Default::default(),
        };
        let head = door.get(0, 2)?;
        if head.as_deref() != Some(&[MAGIC, ranks as u64][..]) {
            return Err(EpError::Protocol(format!(
                "{name} is not the door of a job of {ranks} ranks"
            )));
        }
        Ok(door)
    }

    /// What the founding ranks wrote of the job.
    pub fn header(&self) -> Result<Header> {
        let w = self.get(0, HEADER)?.ok_or_else(gone_door)?;
        let shape = |at: usize| {
            let s = Shape {
                num_experts: w[at] as usize,
                hidden: w[at + 1] as usize,
                topk: w[at + 2] as usize,
                max_tokens: w[at + 3] as usize,
            };
            (s.num_experts > 0).then_some(s)
        };
        Ok(Header {
            digest: w[2],
            bytes: w[3] as usize,
            job: w[JOB_WORD],
            normal: shape(5),
            ll: shape(9),
            ranks_per_node: (w[13] > 0).then_some(w[13] as usize),
            max_ranks: (w[14] > 0).then_some(w[14] as usize),
            node_ranks: w[15] as usize,
        })
    }

    /// Remove the door (the job ends): no joiner finds it any more.
    pub fn close(&mut self) -> Result<()> {
        match &self.backing {
            Backing::Store { store, name, .. } => Ok(store.delete(&format!("{name}/header"))?),
            Backing::Shm(seg) => match std::fs::remove_file(seg.path()) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(EpError::Resource(
                    format!("cannot remove the door {}: {e}", seg.path().display()),
                )),
                _ => Ok(()),
            },
        }
    }

    /// Rank `rank` is process `p` whose memory opens by `handle`.
    pub fn set_member(&self, rank: usize, p: Process, handle: &MemHandle) -> Result<()> {
        let words = [u64::from(p.pid), p.host]
            .into_iter()
            .chain(handle_words(handle));
        self.put(self.member_at(rank)?, &words.collect::<Vec<_>>())
    }

    /// Rank `rank`'s process and memory handle, if it ever had one.
    pub fn member(&self, rank: usize) -> Result<Option<(Process, MemHandle)>> {
        let Some(w) = self.get(self.member_at(rank)?, MEMBER)? else {
            return Ok(None);
        };
        let p = Process {
            pid: w[0] as u32,
            host: w[1],
        };
        Ok(Some((p, words_handle(&w[2..])?)))
    }

    /// Ask to be let in as `rank` (reached at `reach` when the job has several nodes):
    /// returns the stamp the welcome will carry.
    pub fn post_request(
        &self,
        rank: usize,
        (p, handle): (Process, &MemHandle),
        reach: Option<&Reach>,
    ) -> Result<u64> {
        let asking = self.reach_at(rank, 1)?;
        match reach {
            Some(reach) => self.put(asking, &reach_words(reach)?)?,
            None => self.put(asking, &[0])?,
        }
        let stamp = rand::random::<u64>() | 1;
        let head = [stamp, u64::from(p.pid), p.host];
        let words = head.into_iter().chain(handle_words(handle));
        self.put(self.request_at(rank)?, &words.collect::<Vec<_>>())?;
        Ok(stamp)
    }

    /// The request to be let in as `rank`, if any.
    pub fn request(&self, rank: usize) -> Result<Option<Request>> {
        let Some(w) = self.get(self.request_at(rank)?, REQUEST)? else {
            return Ok(None);
        };
        Ok(Some(Request {
            stamp: w[0],
            process: Process {
                pid: w[1] as u32,
                host: w[2],
            },
            handle: words_handle(&w[3..])?,
        }))
    }

    /// Answer the request `stamp` of `rank`. Every survivor writes the same words.
    pub fn welcome(&self, rank: usize, stamp: u64, w: &Welcome) -> Result<()> {
        let c = &w.calls;
        let first = match w.first {
            FirstCall::Barrier => 0,
            FirstCall::Dispatch => 1,
            FirstCall::LowLatencyDispatch => 2,
        };
        let fields = [
            stamp,
            w.round,
            w.digest,
            u64::from(c.ll_dispatch) | u64::from(c.ll_combine) << 32,
            u64::from(c.normal_dispatch) | u64::from(c.normal_combine) << 32,
            c.barriers,
            w.step << 2 | first,
        ];
        let bits = crate::agree::to_bits(&w.masked, self.words);
        let words: Vec<u64> = fields.into_iter().chain(bits).collect();
        self.put(self.welcome_at(rank)?, &words)
    }

    /// The answer to request `stamp` of `rank`, once it is there.
    pub fn welcomed(&self, rank: usize, stamp: u64) -> Result<Option<Welcome>> {
        let n = WELCOME + self.words;
        let Some(f) = self
            .get(self.welcome_at(rank)?, n)?
            .filter(|f| f[0] == stamp)
        else {
            return Ok(None);
        };
        let (ll, normal, tail) = (f[3], f[4], f[6]);
        Ok(Some(Welcome {
            round: f[1],
            digest: f[2],
            calls: Calls {
                ll_dispatch: ll as u32,
                ll_combine: (ll >> 32) as u32,
                normal_dispatch: normal as u32,
                normal_combine: (normal >> 32) as u32,
                barriers: f[5],
            },
            step: tail >> 2,
            first: match tail & 3 {
                0 => FirstCall::Barrier,
                1 => FirstCall::Dispatch,
                _ => FirstCall::LowLatencyDispatch,
            },
            masked: crate::agree::to_mask(&f[WELCOME..], self.ranks),
        }))
    }

    /// How rank `rank` is reached across nodes (its founding process's, or its last
    /// joiner's), if published.
    pub fn reach(&self, rank: usize) -> Result<Option<Reach>> {
        self.get_reach(self.reach_at(rank, 0)?)
    }

    /// Publish how rank `rank` is reached across nodes.
    pub fn set_reach(&self, rank: usize, reach: &Reach) -> Result<()> {
        self.put(self.reach_at(rank, 0)?, &reach_words(reach)?)
    }

    /// The [`Reach`] a joiner of `rank` posted with its request.
    pub fn asking_reach(&self, rank: usize) -> Result<Option<Reach>> {
        self.get_reach(self.reach_at(rank, 1)?)
    }

    /// Survivor `by` let the joiner of `rank` (request `stamp`) in and is ready for its
    /// traffic. A record per survivor, not a count, so that the joiner can tell which
    /// survivors it still waits for (and skip one that died).
    pub fn ready(&self, rank: usize, by: usize, stamp: u64) -> Result<()> {
        self.put(self.ready_at(rank, by)?, &[stamp])
    }

    /// Whether survivor `by` is ready for the joiner of `rank` with request `stamp` (an
    /// older request's record does not count).
    pub fn is_ready(&self, rank: usize, by: usize, stamp: u64) -> Result<bool> {
        let words = self.get(self.ready_at(rank, by)?, 1)?;
        Ok(words.is_some_and(|w| w[0] == stamp))
    }

    /// A survivor found process `p` of `rank` lost.
    pub fn set_lost(&self, rank: usize, p: Process) -> Result<()> {
        self.put(self.lost_at(rank)?, &[u64::from(p.pid), p.host])
    }

    /// The process of `rank` that a survivor found lost last, if any.
    pub fn lost(&self, rank: usize) -> Result<Option<Process>> {
        let words = self.get(self.lost_at(rank)?, LOST)?;
        Ok(words.map(|w| Process {
            pid: w[0] as u32,
            host: w[1],
        }))
    }

    /// Whether a survivor looks for requests now: always in shared memory, where a look
    /// is a load; at a store, once per [`STORE_LOOKS`].
    pub fn worth_a_look(&self) -> bool {
        if let Backing::Shm(_) = self.backing {
            return true;
        }
        let now = std::time::Instant::now();
        let due = (self.looked.get()).is_none_or(|t| now.duration_since(t) >= STORE_LOOKS);
        if due {
            self.looked.set(Some(now));
        }
        due
    }

    /// How often a joiner looks at the door while it waits: a look is a load in
    /// shared memory, a round trip to the store.
    pub fn poll(&self) -> Duration {
        match self.backing {
            Backing::Shm(_) => Duration::from_micros(200),
            Backing::Store { .. } => Duration::from_millis(2),
        }
    }

    /// Publish the record of `words` at word `at` (its first word non-zero, but for an
    /// empty record `[0]`).
    fn put(&self, at: usize, words: &[u64]) -> Result<()> {
        let seg = match &self.backing {
            Backing::Store { store, .. } => {
                return Ok(store.set(&self.key(at), bytemuck::cast_slice(words))?);
            }
            Backing::Shm(seg) => seg.region(),
        };
        for (i, &v) in words.iter().enumerate().skip(1) {
            seg.atomic_u64(8 * (at + i))?.store(v, Ordering::Relaxed);
        }
        seg.atomic_u64(8 * at)?.store(words[0], Ordering::Release);
        Ok(())
    }

    /// The record of `n` words at word `at`, if published (its first word non-zero);
    /// words a shorter stored record lacks read as zero.
    fn get(&self, at: usize, n: usize) -> Result<Option<Vec<u64>>> {
        let mut words = vec![0u64; n];
        match &self.backing {
            Backing::Store { store, .. } => {
                let Some(bytes) = store.get(&self.key(at))? else {
                    return Ok(None);
                };
                let have = (bytes.len() / 8).min(n);
                bytemuck::cast_slice_mut(&mut words[..have]).copy_from_slice(&bytes[..8 * have]);
            }
            Backing::Shm(seg) => {
                let r = seg.region();
                words[0] = r.atomic_u64(8 * at)?.load(Ordering::Acquire);
                if words[0] == 0 {
                    return Ok(None);
                }
                for (i, w) in words.iter_mut().enumerate().skip(1) {
                    *w = r.atomic_u64(8 * (at + i))?.load(Ordering::Relaxed);
                }
            }
        }
        Ok((words[0] != 0).then_some(words))
    }

    /// A store key: the header's, or a record's at word `at`.
    fn key(&self, at: usize) -> String {
        let Backing::Store { name, job, .. } = &self.backing else {
            unreachable!("keys are the store's")
        };
        match at {
            0 => format!("{name}/header"),
            _ => format!("{name}/{job:016x}/{at}"),
        }
    }

    fn get_reach(&self, at: usize) -> Result<Option<Reach>> {
        let Some(w) = self.get(at, REACH)? else {
            return Ok(None);
        };
        let n = (w[0] as usize).min(REACH_BYTES);
        let bytes: &[u8] = bytemuck::cast_slice(&w[1..]);
        Reach::decode(&bytes[..n]).map(Some).ok_or_else(|| {
            EpError::Protocol("a rank's network addresses at the door are not readable".into())
        })
    }

    /// Where block `which` (0: members', 1: joiners') of reach records holds `rank`'s.
    fn reach_at(&self, rank: usize, which: usize) -> Result<usize> {
        let base = HEADER + self.ranks * (MEMBER + REQUEST + WELCOME + self.words);
        self.check(rank)
            .map(|r| base + (which * self.ranks + r) * REACH)
    }

    fn ready_at(&self, rank: usize, by: usize) -> Result<usize> {
        let base = HEADER + self.ranks * (MEMBER + REQUEST + WELCOME + self.words + 2 * REACH);
        Ok(base + self.check(rank)? * self.ranks + self.check(by)?)
    }

    fn lost_at(&self, rank: usize) -> Result<usize> {
        let base = HEADER
            + self.ranks * (MEMBER + REQUEST + WELCOME + self.words + 2 * REACH + self.ranks);
        self.check(rank).map(|r| base + r * LOST)
    }

    fn member_at(&self, rank: usize) -> Result<usize> {
        self.check(rank).map(|r| HEADER + r * MEMBER)
    }

    fn request_at(&self, rank: usize) -> Result<usize> {
        self.check(rank)
            .map(|r| HEADER + self.ranks * MEMBER + r * REQUEST)
    }

    fn welcome_at(&self, rank: usize) -> Result<usize> {
        let base = HEADER + self.ranks * (MEMBER + REQUEST);
        self.check(rank).map(|r| base + r * (WELCOME + self.words))
    }

    fn check(&self, rank: usize) -> Result<usize> {
        match rank < self.ranks {
            true => Ok(rank),
            false => Err(EpError::internal(format!(
                "rank {rank} has no place at a door of {} ranks",
                self.ranks
            ))),
        }
    }
}

/// The job token of door `name` in `store`, once its header is there (within `timeout`).
fn find_job(store: &dyn Store, name: &str, timeout: Duration) -> Result<u64> {
    let deadline = std::time::Instant::now() + timeout;
    loop {
        if let Some(b) = store.get(&format!("{name}/header"))? {
            let job = b
                .get(8 * JOB_WORD..8 * (JOB_WORD + 1))
                .map(bytemuck::pod_read_unaligned::<u64>);
            return job.ok_or_else(|| {
                EpError::Protocol(format!("the header of door {name} is cut short"))
            });
        }
        if std::time::Instant::now() >= deadline {
            return Err(EpError::Resource(format!(
                "door {name} is not in the job's store"
            )));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn gone_door() -> EpError {
    EpError::Resource("the door's header is gone (the job ended)".into())
}

/// A [`Reach`] as a record: its length in bytes, then the bytes.
fn reach_words(reach: &Reach) -> Result<Vec<u64>> {
    let bytes = reach.encode()?;
    let mut words = vec![0u64; 1 + bytes.len().div_ceil(8)];
    words[0] = bytes.len() as u64;
    bytemuck::cast_slice_mut::<u64, u8>(&mut words[1..])[..bytes.len()].copy_from_slice(&bytes);
    Ok(words)
}

/// A memory handle as words: its length, then its bytes (zero-padded).
fn handle_words(handle: &MemHandle) -> [u64; HANDLE_WORDS] {
    let bytes = handle.as_bytes();
    let mut words = [0u64; HANDLE_WORDS];
    words[0] = bytes.len() as u64;
    bytemuck::cast_slice_mut::<u64, u8>(&mut words[1..])[..bytes.len()].copy_from_slice(bytes);
    words
}

fn words_handle(words: &[u64]) -> Result<MemHandle> {
    let bytes: &[u8] = bytemuck::cast_slice(&words[1..HANDLE_WORDS]);
    let len = words[0] as usize;
    match bytes.get(..len) {
        Some(handle) => MemHandle::new(handle.to_vec()),
        None => Err(EpError::Protocol(format!(
            "a memory handle at the door says it has {len} bytes, more than {HANDLE_BYTES}"
        ))),
    }
}

/// The name of the door of the job whose launcher's rendezvous is `rendezvous` (for
/// example `MASTER_ADDR:MASTER_PORT`): the same on every rank and on a process started
/// with the same environment to replace one.
pub fn door_name(rendezvous: &str) -> String {
    let h = crate::fnv::hash(rendezvous.bytes().map(u64::from));
    format!("{}{h:016x}", uep_shm::DOOR_PREFIX)
}

/// Remove the doors on this host of which no member process lives (left by jobs that
/// were killed); returns their paths. A door whose job runs is left alone.
pub fn remove_stale_doors() -> Result<Vec<std::path::PathBuf>> {
    let dir = std::path::Path::new(uep_shm::SHM_DIR);
    let entries = std::fs::read_dir(dir)
        .map_err(|e| EpError::Resource(format!("cannot list {}: {e}", dir.display())))?;
    let mut removed = Vec::new();
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if !name.starts_with(uep_shm::DOOR_PREFIX) || door_lives(&name) {
            continue;
        }
        if std::fs::remove_file(entry.path()).is_ok() {
            removed.push(entry.path());
        }
    }
    Ok(removed)
}

/// Whether a member of door `name` lives (a door that cannot be read counts as dead).
fn door_lives(name: &str) -> bool {
    let Ok(bytes) = std::fs::read(std::path::Path::new(uep_shm::SHM_DIR).join(name)) else {
        return false;
    };
    let word = |i: usize| {
        let b = bytes.get(8 * i..8 * i + 8)?;
        Some(u64::from_le_bytes(b.try_into().ok()?))
    };
    let ranks = word(1).unwrap_or(0) as usize;
    (word(0) == Some(MAGIC))
        && (0..ranks.min(crate::topology::MAX_RANKS_PER_NODE)).any(|r| {
            let pid = word(HEADER + r * MEMBER).unwrap_or(0) as u32;
            pid != 0 && !crate::wait::process_gone(pid)
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn handle(name: &str) -> MemHandle {
        MemHandle::new(name.as_bytes().to_vec()).unwrap()
    }

    fn door_name(tag: &str) -> String {
        format!("{}test-{tag}-{}", uep_shm::DOOR_PREFIX, std::process::id())
    }

    /// A door's name, its store (`None`: shared memory), and the server it talks to.
    type Backed = (String, Option<JobStore>, Option<uep_bootstrap::StoreServer>);

    /// Every test runs on both backings: shared memory, and a store over TCP.
    fn backings(tag: &str) -> Vec<Backed> {
        let server = uep_bootstrap::StoreServer::bind("127.0.0.1:0").unwrap();
        let addr = server.addr().to_string();
        let store = uep_bootstrap::TcpStore::connect(&addr, Duration::from_secs(5)).unwrap();
        let store = JobStore(Arc::new(store));
        vec![
            (door_name(tag), None, None),
            (format!("job/{tag}"), Some(store), Some(server)),
        ]
    }

    fn process(pid: u32) -> Process {
        Process { pid, host: 42 }
    }

    #[test]
    fn records_keep_their_fields() {
        for (name, store, _server) in backings("records") {
            let at = || (name.as_str(), store.as_ref());
            let mut cfg = BufferConfig::new(64, 512, 8, 0, 128);
            (cfg.ranks_per_node, cfg.max_ranks) = (Some(10), Some(70));
            let mut door = Door::create(at(), 70, &cfg, (7, 4096, 9, 10)).unwrap();
            let other = Door::open(at(), 70, Duration::ZERO).unwrap();
            let h = other.header().unwrap();
            assert_eq!((h.digest, h.bytes, h.job, h.node_ranks), (7, 4096, 9, 10));
            assert_eq!((h.normal, h.ll, h.ranks_per_node), (None, cfg.ll, Some(10)));
            assert_eq!(h.max_ranks, Some(70));
            assert!(Door::open(at(), 71, Duration::ZERO).is_err());
            door.set_member(69, process(1234), &handle("uep-abc-r69-p1234"))
                .unwrap();
            assert_eq!(
                other.member(69).unwrap(),
                Some((process(1234), handle("uep-abc-r69-p1234")))
            );
            // A handle is bytes, trailing zeros and all (a GPU's IPC handle).
            let ipc = MemHandle::new([7u8, 0, 0, 0].repeat(16)).unwrap();
            door.set_member(68, process(1), &ipc).unwrap();
            assert_eq!(other.member(68).unwrap(), Some((process(1), ipc)));
            assert_eq!(other.member(3).unwrap(), None);
            assert_eq!(other.request(5).unwrap(), None);
            let stamp = other
                .post_request(5, (process(77), &handle("uep-abc-r5-p77")), None)
                .unwrap();
            let req = door.request(5).unwrap().unwrap();
            assert_eq!(
                (req.stamp, req.process, req.handle),
                (stamp, process(77), handle("uep-abc-r5-p77"))
            );
            assert_eq!(other.welcomed(5, stamp).unwrap(), None);
            let mut masked = vec![false; 70];
            masked[66] = true;
            let w = Welcome {
                round: 12,
                digest: 0xfeed,
                calls: Calls {
                    ll_dispatch: 5,
                    ll_combine: 4,
                    normal_dispatch: 8,
                    normal_combine: 7,
                    barriers: 3,
                },
                step: 99,
                first: FirstCall::LowLatencyDispatch,
                masked,
            };
            door.welcome(5, stamp, &w).unwrap();
            assert_eq!(other.welcomed(5, stamp).unwrap(), Some(w));
            assert_eq!(other.welcomed(5, stamp ^ 2).unwrap(), None);
            door.close().unwrap();
            assert!(Door::open(at(), 70, Duration::ZERO).is_err());
        }
    }

    #[test]
    fn a_door_whose_members_are_gone_is_stale() {
        let cfg = BufferConfig::new(64, 512, 8, 0, 128);
        let (a, b) = (door_name("alive"), door_name("dead"));
        let alive = Door::create((&a, None), 4, &cfg, (1, 1, 1, 4)).unwrap();
        alive
            .set_member(2, Process::me(), &handle("uep-x"))
            .unwrap();
        let dead = Door::create((&b, None), 4, &cfg, (1, 1, 1, 4)).unwrap();
        dead.set_member(1, process(u32::MAX - 1), &handle("uep-y"))
            .unwrap();
        let removed = remove_stale_doors().unwrap();
        assert!(removed.iter().any(|p| p.ends_with(&b)), "{removed:?}");
        assert!(!removed.iter().any(|p| p.ends_with(&a)), "{removed:?}");
        drop((alive, dead)); // their makers' drop removes their names
    }

    #[test]
    fn a_process_is_asked_about_on_its_own_host_only() {
        assert_eq!(Process::me().gone(), Some(false));
        let elsewhere = Process {
            pid: std::process::id(),
            host: this_host() ^ 1,
        };
        assert_eq!(elsewhere.gone(), None);
        let dead_here = Process {
            pid: u32::MAX - 1,
            host: this_host(),
        };
        assert_eq!(dead_here.gone(), Some(true));
    }

    #[test]
    fn a_store_door_is_waited_for_and_a_job_token_keys_its_records() {
        let (name, store, _server) = backings("token").pop().unwrap();
        let cfg = BufferConfig::new(64, 512, 8, 0, 128);
        let opener = {
            let (name, store) = (name.clone(), store.clone());
            std::thread::spawn(move || {
                Door::open((&name, store.as_ref()), 4, Duration::from_secs(5))
            })
        };
        std::thread::sleep(Duration::from_millis(100));
        let old = Door::create((&name, store.as_ref()), 4, &cfg, (1, 1, 1, 2)).unwrap();
        old.set_member(3, process(5), &handle("uep-old")).unwrap();
        assert_eq!(opener.join().unwrap().unwrap().header().unwrap().job, 1);
        // A later job at the same name sees none of the earlier one's records.
        let new = Door::create((&name, store.as_ref()), 4, &cfg, (1, 1, 2, 2)).unwrap();
        assert_eq!(new.member(3).unwrap(), None);
        assert!(Door::open((&name, store.as_ref()), 5, Duration::ZERO).is_err());
    }

    #[test]
    fn reach_ready_and_lost_records_keep_their_fields() {
        for (name, store, _server) in backings("reach") {
            let cfg = BufferConfig::new(64, 512, 8, 0, 128);
            let mut door = Door::create((&name, store.as_ref()), 6, &cfg, (1, 1, 1, 3)).unwrap();
            let member = Reach {
                addrs: vec![vec![7; 90], vec![], vec![1, 2, 3]],
                watch: None,
                host: "10.0.0.7".into(),
            };
            assert_eq!(door.reach(4).unwrap(), None);
            door.set_reach(4, &member).unwrap();
            assert_eq!(door.reach(4).unwrap(), Some(member.clone()));
            let joiner = Reach {
                watch: Some(crate::liveness::Advert {
                    host: "127.0.0.1".into(),
                    port: 4242,
                    nonce: u64::MAX - 3,
                }),
                ..member
            };
            let stamp = door
                .post_request(5, (process(9), &handle("uep-j")), Some(&joiner))
                .unwrap();
            assert_eq!(door.asking_reach(5).unwrap(), Some(joiner));
            door.post_request(5, (process(9), &handle("uep-j")), None)
                .unwrap();
            assert_eq!(door.asking_reach(5).unwrap(), None);
            assert_eq!(door.reach(5).unwrap(), None);
            let too_many = Reach {
                addrs: vec![vec![0; 600]; 2],
                ..Reach::default()
            };
            assert!(door.set_reach(0, &too_many).is_err());
            // Each survivor says it is ready; an older request's record does not count.
            assert!(!door.is_ready(5, 0, stamp).unwrap());
            door.ready(5, 0, stamp ^ 2).unwrap();
            assert!(!door.is_ready(5, 0, stamp).unwrap());
            door.ready(5, 0, stamp).unwrap();
            door.ready(5, 3, stamp).unwrap();
            let ready: Vec<bool> = (0..6)
                .map(|s| door.is_ready(5, s, stamp).unwrap())
                .collect();
            assert_eq!(ready, [true, false, false, true, false, false]);
            assert!(!door.is_ready(4, 0, stamp).unwrap());
            assert!(door.ready(5, 6, stamp).is_err());
            assert_eq!(door.lost(5).unwrap(), None);
            door.set_lost(5, process(9)).unwrap();
            assert_eq!(door.lost(5).unwrap(), Some(process(9)));
            assert_eq!(door.lost(4).unwrap(), None);
            door.close().unwrap();
        }
    }
}
