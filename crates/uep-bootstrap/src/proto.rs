//! The rendezvous wire protocol: length-prefixed binary frames over TCP.
//!
//! Every frame is `len: u32 LE` followed by `len` body bytes; the body's first byte is the message
//! type. All integers are little-endian. Handshake (rank 0 = server, other ranks = joiners):
//!
//! ```text
//! server -> joiner  Challenge  1 | magic "UEPB" | version u16 | server_nonce [16]
//! joiner -> server  Hello      2 | magic "UEPB" | version u16 | rank u32 | world_size u32
//!                                | local_world_size u32 | client_nonce [16] | auth u8 | mac [32]?
//! server -> joiner  Reject     3 | reason (UTF-8)
//! server -> joiner  Welcome    4 | job_id [16 ASCII hex] | auth u8 | proof [32]?
//! ```
//!
//! `auth` is 0 (no secret, no MAC follows) or 1 (a 32-byte HMAC-SHA256 follows). The hello MAC
//! binds the secret to both nonces and the hello's fields, so it cannot be replayed to another
//! connection; the welcome proof shows the joiner that rank 0 knows the secret too. Only the magic
//! and version of a hello are parsed when the version is foreign, so that future versions can be
//! refused with a clear message. After the handshake:
//!
//! ```text
//! Gather   16 | seq u64 | kind u8 | data            (rank r -> rank 0)
//! Result   17 | seq u64 | kind u8 | count u32 | count x (len u32 | bytes)   (rank 0 -> rank r)
//! Abort    18 | rank u32 | reason (UTF-8)           (either way: `rank` failed)
//! Goodbye  19                                       (either way: sender dropped its Group)
//! ```

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use hmac::{Hmac, Mac};
use sha2::Sha256;

/// First bytes of every handshake message.
pub(crate) const MAGIC: [u8; 4] = *b"UEPB";
/// This implementation's protocol version; rank 0 refuses joiners with any other.
pub const PROTOCOL_VERSION: u16 = 1;
/// Largest handshake frame accepted from a not-yet-authenticated peer.
pub(crate) const HANDSHAKE_MAX: usize = 1024;
/// Largest frame accepted after the handshake (an all_gather result holds every rank's data).
pub(crate) const MAX_FRAME: usize = 1 << 30;
/// Longest reason string put on the wire.
const MAX_REASON: usize = 900;

pub(crate) type Nonce = [u8; 16];
pub(crate) type Tag = [u8; 32];

const T_CHALLENGE: u8 = 1;
const T_HELLO: u8 = 2;
const T_REJECT: u8 = 3;
const T_WELCOME: u8 = 4;
const T_GATHER: u8 = 16;
const T_RESULT: u8 = 17;
const T_ABORT: u8 = 18;
const T_GOODBYE: u8 = 19;

/// Which collective a Gather/Result belongs to (checked so that mismatched calls fail loudly).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum OpKind {
    AllGather,
    Barrier,
}

impl OpKind {
    fn code(self) -> u8 {
        match self {
            OpKind::AllGather => 0,
            OpKind::Barrier => 1,
        }
    }
    fn from_code(c: u8) -> Option<Self> {
        match c {
            0 => Some(OpKind::AllGather),
            1 => Some(OpKind::Barrier),
            _ => None,
        }
    }
    pub(crate) fn name(self) -> &'static str {
        match self {
            OpKind::AllGather => "all_gather",
            OpKind::Barrier => "barrier",
        }
    }
}

/// A joiner's hello, as far as it could be parsed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Hello {
    pub version: u16,
    pub rank: u32,
    pub world_size: u32,
    pub local_world_size: u32,
    pub nonce: Nonce,
    pub mac: Option<Tag>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Msg {
    Challenge {
        version: u16,
        nonce: Nonce,
    },
    Hello(Hello),
    /// A hello of another protocol version; only the version is known.
    ForeignHello {
        version: u16,
    },
    Reject {
        reason: String,
    },
    Welcome {
        job_id: String,
        proof: Option<Tag>,
    },
    Gather {
        seq: u64,
        kind: OpKind,
        data: Vec<u8>,
    },
    Result {
        seq: u64,
        kind: OpKind,
        parts: Vec<Vec<u8>>,
    },
    Abort {
        rank: u32,
        reason: String,
    },
    Goodbye,
}

impl Msg {
    pub(crate) fn name(&self) -> &'static str {
        match self {
            Msg::Challenge { .. } => "Challenge",
            Msg::Hello(_) | Msg::ForeignHello { .. } => "Hello",
            Msg::Reject { .. } => "Reject",
            Msg::Welcome { .. } => "Welcome",
            Msg::Gather { .. } => "Gather",
            Msg::Result { .. } => "Result",
            Msg::Abort { .. } => "Abort",
            Msg::Goodbye => "Goodbye",
        }
    }

    /// Encodes the whole frame, length prefix included.
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut b = vec![0u8; 4];
        match self {
            Msg::Challenge { version, nonce } => {
                b.push(T_CHALLENGE);
                b.extend_from_slice(&MAGIC);
                b.extend_from_slice(&version.to_le_bytes());
                b.extend_from_slice(nonce);
            }
            Msg::Hello(h) => {
                b.push(T_HELLO);
                b.extend_from_slice(&MAGIC);
                b.extend_from_slice(&h.version.to_le_bytes());
                b.extend_from_slice(&h.rank.to_le_bytes());
                b.extend_from_slice(&h.world_size.to_le_bytes());
                b.extend_from_slice(&h.local_world_size.to_le_bytes());
                b.extend_from_slice(&h.nonce);
                push_tag(&mut b, h.mac.as_ref());
            }
            Msg::ForeignHello { version } => {
                b.push(T_HELLO);
                b.extend_from_slice(&MAGIC);
                b.extend_from_slice(&version.to_le_bytes());
            }
            Msg::Reject { reason } => {
                b.push(T_REJECT);
                b.extend_from_slice(truncate(reason).as_bytes());
            }
            Msg::Welcome { job_id, proof } => {
                b.push(T_WELCOME);
                b.extend_from_slice(job_id.as_bytes());
                push_tag(&mut b, proof.as_ref());
            }
            Msg::Gather { seq, kind, data } => return encode_gather(*seq, *kind, data),
            Msg::Result { seq, kind, parts } => return encode_result(*seq, *kind, parts),
            Msg::Abort { rank, reason } => {
                b.push(T_ABORT);
                b.extend_from_slice(&rank.to_le_bytes());
                b.extend_from_slice(truncate(reason).as_bytes());
            }
            Msg::Goodbye => b.push(T_GOODBYE),
        }
        let len = (b.len() - 4) as u32;
        b[..4].copy_from_slice(&len.to_le_bytes());
        b
    }

    /// Decodes one frame body (without the length prefix). Never panics on garbage.
    pub(crate) fn decode(body: &[u8]) -> Result<Msg, String> {
        let mut c = Cursor { b: body };
        let ty = c.u8()?;
        let msg = match ty {
            T_CHALLENGE => {
                c.magic()?;
                Msg::Challenge {
                    version: c.u16()?,
                    nonce: c.array()?,
                }
            }
            T_HELLO => {
                c.magic()?;
                let version = c.u16()?;
                if version != PROTOCOL_VERSION {
                    return Ok(Msg::ForeignHello { version });
                }
                Msg::Hello(Hello {
                    version,
                    rank: c.u32()?,
                    world_size: c.u32()?,
                    local_world_size: c.u32()?,
                    nonce: c.array()?,
                    mac: c.tag()?,
                })
            }
            T_REJECT => Msg::Reject { reason: c.text() },
            T_WELCOME => {
                let id: [u8; 16] = c.array()?;
                if !id.iter().all(|b| b.is_ascii_hexdigit()) {
                    return Err("job id is not 16 hex characters".into());
                }
                Msg::Welcome {
                    job_id: id.iter().map(|&b| b as char).collect(),
                    proof: c.tag()?,
                }
            }
            T_GATHER => {
                let seq = c.u64()?;
                let kind = c.kind()?;
                Msg::Gather {
                    seq,
                    kind,
                    data: std::mem::take(&mut c.b).to_vec(),
                }
            }
            T_RESULT => {
                let seq = c.u64()?;
                let kind = c.kind()?;
                let count = c.u32()? as usize;
                // Each part needs at least its 4-byte length, which bounds the allocation.
                let mut parts = Vec::with_capacity(count.min(c.b.len() / 4));
                for _ in 0..count {
                    let len = c.u32()? as usize;
                    parts.push(c.take(len)?.to_vec());
                }
                Msg::Result { seq, kind, parts }
            }
            T_ABORT => Msg::Abort {
                rank: c.u32()?,
                reason: c.text(),
            },
            T_GOODBYE => Msg::Goodbye,
            other => return Err(format!("unknown message type {other}")),
        };
        if !c.b.is_empty() {
            return Err(format!("{} trailing bytes after {}", c.b.len(), msg.name()));
        }
        Ok(msg)
    }
}

/// Encodes a Gather frame without first copying `data` into a [`Msg`].
pub(crate) fn encode_gather(seq: u64, kind: OpKind, data: &[u8]) -> Vec<u8> {
    let mut b = Vec::with_capacity(data.len() + 14);
    b.extend_from_slice(&((data.len() + 10) as u32).to_le_bytes());
    b.push(T_GATHER);
    b.extend_from_slice(&seq.to_le_bytes());
    b.push(kind.code());
    b.extend_from_slice(data);
    b
}

/// Encodes a Result frame without first moving `parts` into a [`Msg`].
pub(crate) fn encode_result(seq: u64, kind: OpKind, parts: &[Vec<u8>]) -> Vec<u8> {
    let body = 14 + parts.iter().map(|p| p.len() + 4).sum::<usize>();
    let mut b = Vec::with_capacity(body + 4);
    b.extend_from_slice(&(body as u32).to_le_bytes());
    b.push(T_RESULT);
    b.extend_from_slice(&seq.to_le_bytes());
    b.push(kind.code());
    b.extend_from_slice(&(parts.len() as u32).to_le_bytes());
    for p in parts {
        b.extend_from_slice(&(p.len() as u32).to_le_bytes());
        b.extend_from_slice(p);
    }
    b
}

/// Largest payload one rank may contribute to an all_gather in a group of `world_size`, so that
/// the relayed result stays within [`MAX_FRAME`].
pub(crate) fn max_part(world_size: usize) -> usize {
    (MAX_FRAME - 64) / world_size.max(1) - 4
}

fn push_tag(b: &mut Vec<u8>, tag: Option<&Tag>) {
    match tag {
        Some(t) => {
            b.push(1);
            b.extend_from_slice(t);
        }
        None => b.push(0),
    }
}

fn truncate(s: &str) -> &str {
    if s.len() <= MAX_REASON {
        return s;
    }
    let mut end = MAX_REASON;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

struct Cursor<'a> {
    b: &'a [u8],
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        if self.b.len() < n {
            return Err(format!(
                "message truncated: needed {n} more bytes, {} left",
                self.b.len()
            ));
        }
        let (head, rest) = self.b.split_at(n);
        self.b = rest;
        Ok(head)
    }
    fn array<const N: usize>(&mut self) -> Result<[u8; N], String> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }
    fn u8(&mut self) -> Result<u8, String> {
        Ok(self.array::<1>()?[0])
    }
    fn u16(&mut self) -> Result<u16, String> {
        Ok(u16::from_le_bytes(self.array()?))
    }
    fn u32(&mut self) -> Result<u32, String> {
        Ok(u32::from_le_bytes(self.array()?))
    }
    fn u64(&mut self) -> Result<u64, String> {
        Ok(u64::from_le_bytes(self.array()?))
    }
    fn magic(&mut self) -> Result<(), String> {
        let m: [u8; 4] = self.array()?;
        if m != MAGIC {
            return Err(format!("bad magic {m:02x?} (expected \"UEPB\")"));
        }
        Ok(())
    }
    fn kind(&mut self) -> Result<OpKind, String> {
        let k = self.u8()?;
        OpKind::from_code(k).ok_or_else(|| format!("unknown collective kind {k}"))
    }
    fn tag(&mut self) -> Result<Option<Tag>, String> {
        match self.u8()? {
            0 => Ok(None),
            1 => Ok(Some(self.array()?)),
            a => Err(format!("unknown auth flag {a}")),
        }
    }
    fn text(&mut self) -> String {
        String::from_utf8_lossy(std::mem::take(&mut self.b)).into_owned()
    }
}

/// Why a frame could not be read.
#[derive(Debug)]
pub(crate) enum ReadError {
    /// The deadline passed (possibly mid-frame: the stream is then unusable).
    Timeout,
    /// The peer closed the connection.
    Eof,
    Io(io::Error),
    /// Too large or undecodable.
    Malformed(String),
}

impl std::fmt::Display for ReadError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ReadError::Timeout => f.write_str("timed out"),
            ReadError::Eof => f.write_str("connection closed"),
            ReadError::Io(e) => write!(f, "{e}"),
            ReadError::Malformed(m) => write!(f, "malformed message: {m}"),
        }
    }
}

fn is_timeout(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
    )
}

/// Time left until `deadline`, or `None` if it has passed. Never returns a zero duration
/// (socket timeouts reject zero).
pub(crate) fn remaining(deadline: Instant) -> Option<Duration> {
    let left = deadline.saturating_duration_since(Instant::now());
    (left > Duration::ZERO).then(|| left.max(Duration::from_millis(1)))
}

/// Reads from a socket, re-arming its read timeout before every call so the whole read respects
/// one deadline (`None`: block indefinitely).
struct DeadlineReader<'a> {
    stream: &'a TcpStream,
    deadline: Option<Instant>,
}

impl Read for DeadlineReader<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let timeout = match self.deadline {
            Some(d) => Some(remaining(d).ok_or(io::ErrorKind::TimedOut)?),
            None => None,
        };
        self.stream.set_read_timeout(timeout)?;
        let mut s = self.stream;
        s.read(buf)
    }
}

/// Reads and decodes one frame of at most `max` bytes before `deadline` (`None`: no deadline).
pub(crate) fn read_msg(
    stream: &TcpStream,
    deadline: Option<Instant>,
    max: usize,
) -> Result<Msg, ReadError> {
    let mut r = DeadlineReader { stream, deadline };
    let map = |e: io::Error| {
        if is_timeout(&e) {
            ReadError::Timeout
        } else if e.kind() == io::ErrorKind::UnexpectedEof {
            ReadError::Eof
        } else {
            ReadError::Io(e)
        }
    };
    let mut len = [0u8; 4];
    r.read_exact(&mut len).map_err(map)?;
    let len = u32::from_le_bytes(len) as usize;
    if len > max {
        return Err(ReadError::Malformed(format!(
            "frame of {len} bytes exceeds the limit of {max}"
        )));
    }
    // Grow while reading rather than trusting `len` for one big allocation.
    let mut body = Vec::with_capacity(len.min(1 << 20));
    let got = r
        .by_ref()
        .take(len as u64)
        .read_to_end(&mut body)
        .map_err(map)?;
    if got < len {
        return Err(ReadError::Eof);
    }
    Msg::decode(&body).map_err(ReadError::Malformed)
}

/// Writes a pre-encoded frame before `deadline`, re-arming the write timeout per call.
pub(crate) fn write_frame(stream: &TcpStream, frame: &[u8], deadline: Instant) -> io::Result<()> {
    let mut s = stream;
    let mut off = 0;
    while off < frame.len() {
        let left = remaining(deadline)
            .ok_or_else(|| io::Error::new(io::ErrorKind::TimedOut, "write deadline passed"))?;
        stream.set_write_timeout(Some(left))?;
        // std's socket write passes MSG_NOSIGNAL, so a vanished peer is an error, not SIGPIPE.
        match s.write(&frame[off..]) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => off += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if is_timeout(&e) => {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "peer did not read in time",
                ))
            }
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Random bytes from the operating system.
pub(crate) fn random<const N: usize>() -> io::Result<[u8; N]> {
    let mut b = [0u8; N];
    getrandom::getrandom(&mut b)
        .map_err(|e| io::Error::other(format!("OS random number generator: {e}")))?;
    Ok(b)
}

/// `N` random bytes as lowercase hex.
pub(crate) fn random_hex<const N: usize>() -> io::Result<String> {
    Ok(random::<N>()?.iter().map(|b| format!("{b:02x}")).collect())
}

fn mac_with(secret: &str, label: &[u8], parts: &[&[u8]]) -> Hmac<Sha256> {
    // HMAC accepts keys of any length, so this cannot fail.
    let mut m = <Hmac<Sha256> as Mac>::new_from_slice(secret.as_bytes())
        .expect("HMAC-SHA256 accepts keys of any length");
    m.update(label);
    for p in parts {
        m.update(p);
    }
    m
}

fn hello_parts(h: &Hello) -> [[u8; 4]; 3] {
    [
        h.rank.to_le_bytes(),
        h.world_size.to_le_bytes(),
        h.local_world_size.to_le_bytes(),
    ]
}

/// The MAC a joiner puts in its hello: binds the secret to both nonces and the hello's fields.
pub(crate) fn hello_mac(secret: &str, server_nonce: &Nonce, h: &Hello) -> Tag {
    let [a, b, c] = hello_parts(h);
    mac_with(
        secret,
        b"uep-bootstrap hello v1",
        &[server_nonce, &h.nonce, &h.version.to_le_bytes(), &a, &b, &c],
    )
    .finalize()
    .into_bytes()
    .into()
}

/// Constant-time check of a hello's MAC.
pub(crate) fn verify_hello_mac(secret: &str, server_nonce: &Nonce, h: &Hello, tag: &Tag) -> bool {
    let [a, b, c] = hello_parts(h);
    mac_with(
        secret,
        b"uep-bootstrap hello v1",
        &[server_nonce, &h.nonce, &h.version.to_le_bytes(), &a, &b, &c],
    )
    .verify_slice(tag)
    .is_ok()
}

fn welcome_mac(
    secret: &str,
    client_nonce: &Nonce,
    server_nonce: &Nonce,
    rank: u32,
    job_id: &str,
) -> Hmac<Sha256> {
    mac_with(
        secret,
        b"uep-bootstrap welcome v1",
        &[
            client_nonce,
            server_nonce,
            &rank.to_le_bytes(),
            job_id.as_bytes(),
        ],
    )
}

/// Rank 0's proof, in its welcome, that it knows the secret.
pub(crate) fn welcome_proof(
    secret: &str,
    client_nonce: &Nonce,
    server_nonce: &Nonce,
    rank: u32,
    job_id: &str,
) -> Tag {
    welcome_mac(secret, client_nonce, server_nonce, rank, job_id)
        .finalize()
        .into_bytes()
        .into()
}

/// Constant-time check of rank 0's welcome proof.
pub(crate) fn verify_welcome_proof(
    secret: &str,
    client_nonce: &Nonce,
    server_nonce: &Nonce,
    rank: u32,
    job_id: &str,
    tag: &Tag,
) -> bool {
    welcome_mac(secret, client_nonce, server_nonce, rank, job_id)
        .verify_slice(tag)
        .is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn roundtrip(m: Msg) {
        let f = m.encode();
        assert_eq!(
            u32::from_le_bytes(f[..4].try_into().unwrap()) as usize,
            f.len() - 4
        );
        assert_eq!(Msg::decode(&f[4..]).unwrap(), m);
    }

    #[test]
    fn all_messages_roundtrip() {
        let hello = Hello {
            version: PROTOCOL_VERSION,
            rank: 3,
            world_size: 8,
            local_world_size: 4,
            nonce: [7; 16],
            mac: Some([9; 32]),
        };
        roundtrip(Msg::Challenge {
            version: 1,
            nonce: [1; 16],
        });
        roundtrip(Msg::Hello(hello.clone()));
        roundtrip(Msg::Hello(Hello { mac: None, ..hello }));
        roundtrip(Msg::ForeignHello { version: 2 });
        roundtrip(Msg::Reject {
            reason: "no".into(),
        });
        roundtrip(Msg::Welcome {
            job_id: "0123456789abcdef".into(),
            proof: None,
        });
        roundtrip(Msg::Welcome {
            job_id: "0123456789abcdef".into(),
            proof: Some([2; 32]),
        });
        roundtrip(Msg::Gather {
            seq: 5,
            kind: OpKind::AllGather,
            data: vec![1, 2, 3],
        });
        roundtrip(Msg::Result {
            seq: 5,
            kind: OpKind::Barrier,
            parts: vec![],
        });
        roundtrip(Msg::Result {
            seq: 9,
            kind: OpKind::AllGather,
            parts: vec![vec![], vec![4; 10]],
        });
        roundtrip(Msg::Abort {
            rank: 2,
            reason: "boom".into(),
        });
        roundtrip(Msg::Goodbye);
    }

    #[test]
    fn long_reasons_are_truncated_on_a_char_boundary() {
        let reason = "é".repeat(1000);
        let f = Msg::Reject { reason }.encode();
        match Msg::decode(&f[4..]).unwrap() {
            Msg::Reject { reason } => {
                assert!(reason.len() <= MAX_REASON && reason.chars().all(|c| c == 'é'));
            }
            m => panic!("{m:?}"),
        }
    }

    #[test]
    fn garbage_is_rejected() {
        assert!(Msg::decode(&[]).is_err());
        assert!(Msg::decode(&[99]).is_err());
        assert!(Msg::decode(&[T_CHALLENGE, b'X', b'E', b'P', b'B', 1, 0])
            .unwrap_err()
            .contains("magic"));
        // A Result claiming more parts than present.
        let mut b = vec![T_RESULT];
        b.extend_from_slice(&1u64.to_le_bytes());
        b.push(0);
        b.extend_from_slice(&u32::MAX.to_le_bytes());
        assert!(Msg::decode(&b).is_err());
        // Trailing bytes.
        let mut f = Msg::Goodbye.encode();
        f.push(0);
        assert!(Msg::decode(&f[4..]).unwrap_err().contains("trailing"));
    }

    #[test]
    fn macs_bind_secret_nonces_and_fields() {
        let h = Hello {
            version: PROTOCOL_VERSION,
            rank: 1,
            world_size: 2,
            local_world_size: 2,
            nonce: [3; 16],
            mac: None,
        };
        let sn = [4; 16];
        let tag = hello_mac("k", &sn, &h);
        assert!(verify_hello_mac("k", &sn, &h, &tag));
        assert!(!verify_hello_mac("K", &sn, &h, &tag));
        assert!(!verify_hello_mac("k", &[5; 16], &h, &tag));
        assert!(!verify_hello_mac(
            "k",
            &sn,
            &Hello {
                rank: 0,
                ..h.clone()
            },
            &tag
        ));
        let p = welcome_proof("k", &h.nonce, &sn, 1, "00000000000000ff");
        assert!(verify_welcome_proof(
            "k",
            &h.nonce,
            &sn,
            1,
            "00000000000000ff",
            &p
        ));
        assert!(!verify_welcome_proof(
            "k",
            &h.nonce,
            &sn,
            2,
            "00000000000000ff",
            &p
        ));
        assert_ne!(p, tag);
    }

    #[test]
    fn hmac_matches_rfc4231_case_2() {
        let tag: Tag = mac_with("Jefe", b"what do ya want ", &[b"for nothing?"])
            .finalize()
            .into_bytes()
            .into();
        let hex: String = tag.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(
            hex,
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
        );
    }

    proptest! {
        #[test]
        fn decode_never_panics(body in proptest::collection::vec(any::<u8>(), 0..64)) {
            let _ = Msg::decode(&body);
        }

        #[test]
        fn result_roundtrips(seq in any::<u64>(), parts in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..16), 0..6)) {
            let m = Msg::Result { seq, kind: OpKind::AllGather, parts };
            let f = m.encode();
            prop_assert_eq!(Msg::decode(&f[4..]).unwrap(), m);
        }
    }
}
