//! The door of an elastic job on one host: where a process started to replace a masked
//! rank finds the job, asks to be let in, and is told where the job is.
//!
//! A small shared-memory segment whose name the caller gives every rank
//! ([`BufferConfig::door`](crate::BufferConfig::door)), made by rank 0 when the Buffers
//! are. Every word is read and written atomically; a record is published by its first
//! word, stored last (release) and read first (acquire):
//!
//! | block | words | what |
//! |---|---|---|
//! | header | 5 + 9 | magic (stored last), ranks, digest of the config, region bytes, job token; the shapes (normal, low-latency: experts, hidden, top-k, tokens) and ranks per node, for a joiner that does not know them |
//! | `member[R]` | 1 + 8 | the rank's process id, then the name of its segment (64 bytes) |
//! | `request[R]` | 2 + 8 | a joiner's stamp (a random non-zero word), its process id, its segment's name |
//! | `welcome[R]` | 7 + W | the stamp of the request it answers, then [`Welcome`] |
//! | `reach[R]` | 1 + 128 | how a member is reached over the network ([`Reach`]: its proxy endpoints), its length stored last |
//! | `asking[R]` | 1 + 128 | a joiner's [`Reach`] (with where its liveness watch listens), written before its request |
//! | `ready[R]` | 1 | the survivors that let the joiner in and are ready for its traffic: (its stamp's low 32 bits, count) |
//!
//! The survivors keep their segments' names while the door is open, so that a joiner
//! maps them as a founding rank did.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use uep_shm::{Region, Segment};

use crate::config::{BufferConfig, Shape};
use crate::error::{EpError, Result};

const MAGIC: u64 = u64::from_le_bytes(*b"uepdoor1");
const HEADER: usize = 5 + 9;
/// Bytes of a segment name in a record.
const NAME_BYTES: usize = 64;
const NAME_WORDS: usize = NAME_BYTES / 8;
const MEMBER: usize = 1 + NAME_WORDS;
const REQUEST: usize = 2 + NAME_WORDS;
const WELCOME: usize = 7;
/// Bytes of a [`Reach`] record, and its words with the length word.
const REACH_BYTES: usize = 1024;
const REACH: usize = 1 + REACH_BYTES / 8;

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
}

impl Reach {
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
        }
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
        Some(Reach { addrs, watch })
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

/// A joiner's request, as the survivors read it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Request {
    pub stamp: u64,
    pub pid: u32,
    pub name: String,
}

/// The door, mapped.
pub(crate) struct Door {
    seg: Segment,
    ranks: usize,
    words: usize,
}

impl std::fmt::Debug for Door {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Door({})", self.seg.path().display())
    }
}

fn len(ranks: usize, words: usize) -> usize {
    8 * (HEADER + ranks * (MEMBER + REQUEST + WELCOME + words + 2 * REACH + 1))
}

impl Door {
    /// Make door `name` for `ranks` ranks of a job with config `cfg` (rank 0, once),
    /// replacing a stale one.
    pub fn create(
        name: &str,
        ranks: usize,
        cfg: &BufferConfig,
        (digest, bytes, job): (u64, usize, u64),
    ) -> Result<Door> {
        let path = std::path::Path::new(uep_shm::SHM_DIR).join(name);
        // A door left by a job that was killed: its ranks are gone.
        let _ = std::fs::remove_file(path);
        let words = crate::map::mask_words(ranks);
        let door = Door {
            seg: Segment::create(name, len(ranks, words))?,
            ranks,
            words,
        };
        let shape = |s: &Option<Shape>| match s {
            Some(s) => [s.num_experts, s.hidden, s.topk, s.max_tokens].map(|v| v as u64),
            None => [0; 4],
        };
        let header = [ranks as u64, digest, bytes as u64, job]
            .into_iter()
            .chain(shape(&cfg.normal))
            .chain(shape(&cfg.ll))
            .chain([cfg.ranks_per_node.unwrap_or(0) as u64]);
        for (i, v) in header.enumerate() {
            door.word(1 + i)?.store(v, Ordering::Relaxed);
        }
        door.word(0)?.store(MAGIC, Ordering::Release);
        Ok(door)
    }

    /// Open door `name` of a job of `ranks` ranks, waiting up to `timeout` for it.
    pub fn open(name: &str, ranks: usize, timeout: Duration) -> Result<Door> {
        let words = crate::map::mask_words(ranks);
        let door = Door {
            seg: Segment::open(name, len(ranks, words), timeout)?,
            ranks,
            words,
        };
        let (magic, found) = (door.word(0)?, door.word(1)?);
        if magic.load(Ordering::Acquire) != MAGIC || found.load(Ordering::Relaxed) != ranks as u64 {
            return Err(EpError::Protocol(format!(
                "{name} is not the door of a job of {ranks} ranks"
            )));
        }
        Ok(door)
    }

    /// `(digest of the config, region bytes, job token)` the founding ranks wrote.
    pub fn header(&self) -> Result<(u64, usize, u64)> {
        let w = |i| Ok::<_, EpError>(self.word(i)?.load(Ordering::Relaxed));
        Ok((w(2)?, w(3)? as usize, w(4)?))
    }

    /// The shapes and ranks per node of the job's config (the rest is each rank's own):
    /// `(normal, low-latency, ranks per node)`.
    pub fn shapes(&self) -> Result<(Option<Shape>, Option<Shape>, Option<usize>)> {
        let w = |i| Ok::<_, EpError>(self.word(i)?.load(Ordering::Relaxed) as usize);
        let shape = |at: usize| {
            let s = Shape {
                num_experts: w(at)?,
                hidden: w(at + 1)?,
                topk: w(at + 2)?,
                max_tokens: w(at + 3)?,
            };
            Ok::<_, EpError>((s.num_experts > 0).then_some(s))
        };
        let per_node = w(13)?;
        Ok((shape(5)?, shape(9)?, (per_node > 0).then_some(per_node)))
    }

    /// Remove the door's name (the job ends): no joiner finds it any more.
    pub fn close(&mut self) -> Result<()> {
        let path = self.seg.path().to_path_buf();
        match std::fs::remove_file(&path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(EpError::Resource(format!(
                "cannot remove the door {}: {e}",
                path.display()
            ))),
            _ => Ok(()),
        }
    }

    /// Rank `rank` is process `pid` with segment `name`.
    pub fn set_member(&self, rank: usize, pid: u32, name: &str) -> Result<()> {
        let at = self.member_at(rank)?;
        self.put_name(at + 1, name)?;
        self.word(at)?.store(pid.into(), Ordering::Release);
        Ok(())
    }

    /// Rank `rank`'s process and segment, if it ever had one.
    pub fn member(&self, rank: usize) -> Result<Option<(u32, String)>> {
        let at = self.member_at(rank)?;
        match self.word(at)?.load(Ordering::Acquire) {
            0 => Ok(None),
            pid => Ok(Some((pid as u32, self.name(at + 1)?))),
        }
    }

    /// Ask to be let in as `rank` (reached at `reach` when the job has several nodes):
    /// returns the stamp the welcome will carry.
    pub fn post_request(
        &self,
        rank: usize,
        (pid, name): (u32, &str),
        reach: Option<&Reach>,
    ) -> Result<u64> {
        let at = self.request_at(rank)?;
        match reach {
            Some(reach) => self.put_reach(self.reach_at(rank, 1)?, reach)?,
            None => self
                .word(self.reach_at(rank, 1)?)?
                .store(0, Ordering::Release),
        }
        let stamp = rand::random::<u64>() | 1;
        self.word(at + 1)?.store(pid.into(), Ordering::Relaxed);
        self.put_name(at + 2, name)?;
        self.word(at)?.store(stamp, Ordering::Release);
        Ok(stamp)
    }

    /// The request to be let in as `rank`, if any.
    pub fn request(&self, rank: usize) -> Result<Option<Request>> {
        let at = self.request_at(rank)?;
        match self.word(at)?.load(Ordering::Acquire) {
            0 => Ok(None),
            stamp => Ok(Some(Request {
                stamp,
                pid: self.word(at + 1)?.load(Ordering::Relaxed) as u32,
                name: self.name(at + 2)?,
            })),
        }
    }

    /// Answer the request `stamp` of `rank`. Every survivor writes the same words.
    pub fn welcome(&self, rank: usize, stamp: u64, w: &Welcome) -> Result<()> {
        let at = self.welcome_at(rank)?;
        let c = &w.calls;
        let first = match w.first {
            FirstCall::Barrier => 0,
            FirstCall::Dispatch => 1,
            FirstCall::LowLatencyDispatch => 2,
        };
        let fields = [
            w.round,
            w.digest,
            u64::from(c.ll_dispatch) | u64::from(c.ll_combine) << 32,
            u64::from(c.normal_dispatch) | u64::from(c.normal_combine) << 32,
            c.barriers,
            w.step << 2 | first,
        ];
        let bits = crate::agree::to_bits(&w.masked, self.words);
        for (i, v) in fields.into_iter().chain(bits).enumerate() {
            self.word(at + 1 + i)?.store(v, Ordering::Relaxed);
        }
        self.word(at)?.store(stamp, Ordering::Release);
        Ok(())
    }

    /// The answer to request `stamp` of `rank`, once it is there.
    pub fn welcomed(&self, rank: usize, stamp: u64) -> Result<Option<Welcome>> {
        let at = self.welcome_at(rank)?;
        if self.word(at)?.load(Ordering::Acquire) != stamp {
            return Ok(None);
        }
        let f = |i: usize| Ok::<_, EpError>(self.word(at + 1 + i)?.load(Ordering::Relaxed));
        let bits = (0..self.words)
            .map(|i| f(WELCOME - 1 + i))
            .collect::<Result<Vec<_>>>()?;
        let (ll, normal, tail) = (f(2)?, f(3)?, f(5)?);
        Ok(Some(Welcome {
            round: f(0)?,
            digest: f(1)?,
            calls: Calls {
                ll_dispatch: ll as u32,
                ll_combine: (ll >> 32) as u32,
                normal_dispatch: normal as u32,
                normal_combine: (normal >> 32) as u32,
                barriers: f(4)?,
            },
            step: tail >> 2,
            first: match tail & 3 {
                0 => FirstCall::Barrier,
                1 => FirstCall::Dispatch,
                _ => FirstCall::LowLatencyDispatch,
            },
            masked: crate::agree::to_mask(&bits, self.ranks),
        }))
    }

    /// How rank `rank` is reached across nodes (its founding process's, or its last
    /// joiner's), if published.
    pub fn reach(&self, rank: usize) -> Result<Option<Reach>> {
        self.get_reach(self.reach_at(rank, 0)?)
    }

    /// Publish how rank `rank` is reached across nodes.
    pub fn set_reach(&self, rank: usize, reach: &Reach) -> Result<()> {
        self.put_reach(self.reach_at(rank, 0)?, reach)
    }

    /// The [`Reach`] a joiner of `rank` posted with its request.
    pub fn asking_reach(&self, rank: usize) -> Result<Option<Reach>> {
        self.get_reach(self.reach_at(rank, 1)?)
    }

    /// A survivor let the joiner of `rank` (request `stamp`) in and is ready for its
    /// traffic: one more in the count the joiner waits for.
    pub fn ready(&self, rank: usize, stamp: u64) -> Result<()> {
        let word = self.word(self.ready_at(rank)?)?;
        let tag = stamp << 32;
        let mut cur = word.load(Ordering::Acquire);
        loop {
            let next = match cur & !0xffff_ffff == tag {
                true => cur + 1,
                false => tag | 1,
            };
            match word.compare_exchange_weak(cur, next, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return Ok(()),
                Err(now) => cur = now,
            }
        }
    }

    /// How many survivors are ready for the joiner of `rank` with request `stamp`.
    pub fn readied(&self, rank: usize, stamp: u64) -> Result<usize> {
        let v = self.word(self.ready_at(rank)?)?.load(Ordering::Acquire);
        Ok(match v & !0xffff_ffff == stamp << 32 {
            true => (v & 0xffff_ffff) as usize,
            false => 0,
        })
    }

    fn put_reach(&self, at: usize, reach: &Reach) -> Result<()> {
        let mut bytes = reach.encode()?;
        let len = bytes.len();
        bytes.resize(len.div_ceil(8) * 8, 0);
        for (i, w) in bytes.chunks_exact(8).enumerate() {
            let v = u64::from_le_bytes(w.try_into().expect("8 bytes"));
            self.word(at + 1 + i)?.store(v, Ordering::Relaxed);
        }
        self.word(at)?.store(len as u64, Ordering::Release);
        Ok(())
    }

    fn get_reach(&self, at: usize) -> Result<Option<Reach>> {
        let n = self.word(at)?.load(Ordering::Acquire) as usize;
        if n == 0 {
            return Ok(None);
        }
        let mut bytes = Vec::with_capacity(n.div_ceil(8) * 8);
        for i in 0..n.min(REACH_BYTES).div_ceil(8) {
            bytes.extend(self.word(at + 1 + i)?.load(Ordering::Relaxed).to_le_bytes());
        }
        bytes.truncate(n);
        Reach::decode(&bytes).map(Some).ok_or_else(|| {
            EpError::Protocol("a rank's network addresses at the door are not readable".into())
        })
    }

    /// Where block `which` (0: members', 1: joiners') of reach records holds `rank`'s.
    fn reach_at(&self, rank: usize, which: usize) -> Result<usize> {
        let base = HEADER + self.ranks * (MEMBER + REQUEST + WELCOME + self.words);
        self.check(rank)
            .map(|r| base + (which * self.ranks + r) * REACH)
    }

    fn ready_at(&self, rank: usize) -> Result<usize> {
        let base = HEADER + self.ranks * (MEMBER + REQUEST + WELCOME + self.words + 2 * REACH);
        self.check(rank).map(|r| base + r)
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

    fn region(&self) -> &Region {
        self.seg.region()
    }

    fn word(&self, i: usize) -> Result<&AtomicU64> {
        Ok(self.region().atomic_u64(8 * i)?)
    }

    /// A segment name, as words (zero-padded).
    fn put_name(&self, at: usize, name: &str) -> Result<()> {
        let bytes = name.as_bytes();
        if bytes.len() > NAME_BYTES {
            return Err(EpError::internal(format!(
                "segment name {name} is longer than {NAME_BYTES} bytes"
            )));
        }
        let mut padded = [0u8; NAME_BYTES];
        padded[..bytes.len()].copy_from_slice(bytes);
        for (i, w) in padded.chunks_exact(8).enumerate() {
            let v = u64::from_le_bytes(w.try_into().expect("8 bytes"));
            self.word(at + i)?.store(v, Ordering::Relaxed);
        }
        Ok(())
    }

    fn name(&self, at: usize) -> Result<String> {
        let mut bytes = Vec::with_capacity(NAME_BYTES);
        for i in 0..NAME_WORDS {
            bytes.extend(self.word(at + i)?.load(Ordering::Relaxed).to_le_bytes());
        }
        let end = bytes.iter().position(|&b| b == 0).unwrap_or(NAME_BYTES);
        String::from_utf8(bytes[..end].to_vec())
            .map_err(|_| EpError::Protocol("a segment name at the door is not UTF-8".into()))
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

    fn door_name(tag: &str) -> String {
        format!("{}test-{tag}-{}", uep_shm::DOOR_PREFIX, std::process::id())
    }

    #[test]
    fn records_keep_their_fields() {
        let name = door_name("records");
        let mut cfg = BufferConfig::new(64, 512, 8, 0, 128);
        cfg.ranks_per_node = Some(10);
        let mut door = Door::create(&name, 70, &cfg, (7, 4096, 9)).unwrap();
        let other = Door::open(&name, 70, Duration::ZERO).unwrap();
        assert_eq!(other.header().unwrap(), (7, 4096, 9));
        assert_eq!(other.shapes().unwrap(), (None, cfg.ll, Some(10)));
        assert!(Door::open(&name, 71, Duration::ZERO).is_err());
        door.set_member(69, 1234, "uep-abc-r69-p1234").unwrap();
        assert_eq!(
            other.member(69).unwrap(),
            Some((1234, "uep-abc-r69-p1234".into()))
        );
        assert_eq!(other.member(3).unwrap(), None);
        assert_eq!(other.request(5).unwrap(), None);
        let stamp = other.post_request(5, (77, "uep-abc-r5-p77"), None).unwrap();
        let req = door.request(5).unwrap().unwrap();
        assert_eq!(
            (req.stamp, req.pid, req.name.as_str()),
            (stamp, 77, "uep-abc-r5-p77")
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
        assert!(door.set_member(1, 1, &"x".repeat(65)).is_err());
        // A door with a live member stays; one whose members are all gone goes.
        let (a, b) = (door_name("alive"), door_name("dead"));
        let alive = Door::create(&a, 4, &cfg, (1, 1, 1)).unwrap();
        alive.set_member(2, std::process::id(), "uep-x").unwrap();
        let dead = Door::create(&b, 4, &cfg, (1, 1, 1)).unwrap();
        dead.set_member(1, u32::MAX - 1, "uep-y").unwrap();
        let removed = remove_stale_doors().unwrap();
        assert!(removed.iter().any(|p| p.ends_with(&b)), "{removed:?}");
        assert!(!removed.iter().any(|p| p.ends_with(&a)), "{removed:?}");
        drop((alive, dead)); // their makers' drop removes their names
        door.close().unwrap();
        assert!(Door::open(&name, 70, Duration::ZERO).is_err());
    }

    #[test]
    fn reach_records_and_the_ready_count_keep_their_fields() {
        let name = door_name("reach");
        let cfg = BufferConfig::new(64, 512, 8, 0, 128);
        let mut door = Door::create(&name, 6, &cfg, (1, 1, 1)).unwrap();
        let member = Reach {
            addrs: vec![vec![7; 90], vec![], vec![1, 2, 3]],
            watch: None,
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
        let stamp = door.post_request(5, (9, "uep-j"), Some(&joiner)).unwrap();
        assert_eq!(door.asking_reach(5).unwrap(), Some(joiner));
        assert_eq!(door.reach(5).unwrap(), None);
        let too_many = Reach {
            addrs: vec![vec![0; 600]; 2],
            watch: None,
        };
        assert!(door.set_reach(0, &too_many).is_err());
        // Survivors count in; an older request's count does not carry over.
        assert_eq!(door.readied(5, stamp).unwrap(), 0);
        door.ready(5, stamp ^ 2).unwrap();
        door.ready(5, stamp).unwrap();
        door.ready(5, stamp).unwrap();
        assert_eq!(door.readied(5, stamp).unwrap(), 2);
        assert_eq!(door.readied(5, stamp ^ 2).unwrap(), 0);
        door.close().unwrap();
    }
}
