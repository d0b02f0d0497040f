//! A key-value store every process of a job reaches, including processes started after
//! it (a replacement rank): where an elastic job keeps its door.
//!
//! [`Store`] is the interface (the Python package implements it over torchrun's
//! `TCPStore`, which the launcher's agent keeps at `MASTER_ADDR:MASTER_PORT`);
//! [`StoreServer`] and [`TcpStore`] are uep's own, which `uep bench`'s launcher runs
//! ([`crate::launch_local`] sets [`STORE_VAR`]) and `uep store` serves on a cluster.
//! The store outlives every rank: it lives in the launcher, not in rank 0.
//!
//! Wire (little-endian), one request and its reply at a time on a connection:
//!
//! | request | bytes | reply |
//! |---|---|---|
//! | set | `1`, key, `u32` length, value | `0` |
//! | get | `2`, key | `0` (absent) or `1`, `u32` length, value |
//! | add | `3`, key, `i64` delta | `i64` the new value (a key not there counts from 0) |
//! | delete | `4`, key | `0` |
//!
//! A key is a `u16` length and UTF-8 bytes; an added key holds its value as 8 bytes.
//! There is no authentication (as with torch's `TCPStore`): listen only where the job's
//! hosts, and nobody else, reach.

use std::collections::HashMap;
use std::fmt::Debug;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use crate::error::BootstrapError;

/// The variable that tells a rank (and a replacement started with its environment)
/// where the job's store is: `HOST:PORT`.
pub const STORE_VAR: &str = "UEP_STORE";

const MAX_KEY: usize = 4096;
const MAX_VALUE: usize = 16 << 20;

/// What uep needs of a key-value store that every process of a job reaches.
/// Each operation is atomic: a reader sees a value whole, old or new.
pub trait Store: Send + Sync + Debug {
    /// Store `value` at `key`.
    fn set(&self, key: &str, value: &[u8]) -> Result<(), BootstrapError>;
    /// The value at `key`, if any (without waiting for one).
    fn get(&self, key: &str) -> Result<Option<Vec<u8>>, BootstrapError>;
    /// Add `delta` to the counter at `key` (0 if absent) and return the new value.
    fn add(&self, key: &str, delta: i64) -> Result<i64, BootstrapError>;
    /// Remove `key` (nothing if absent).
    fn delete(&self, key: &str) -> Result<(), BootstrapError>;
}

/// uep's own store, served over TCP until dropped.
///
/// ```
/// use uep_bootstrap::{Store, StoreServer, TcpStore};
/// let server = StoreServer::bind("127.0.0.1:0").unwrap();
/// let store = TcpStore::connect(&server.addr().to_string(), std::time::Duration::from_secs(5)).unwrap();
/// store.set("k", b"v").unwrap();
/// assert_eq!(store.get("k").unwrap().as_deref(), Some(&b"v"[..]));
/// assert_eq!(store.add("n", 2).unwrap(), 2);
/// ```
#[derive(Debug)]
pub struct StoreServer {
    addr: SocketAddr,
    stop: Arc<std::sync::atomic::AtomicBool>,
}

type Map = Arc<Mutex<HashMap<String, Vec<u8>>>>;

impl StoreServer {
    /// Listen at `addr` (`HOST:PORT`; port 0 picks a free one) and serve from a thread.
    pub fn bind(addr: &str) -> Result<StoreServer, BootstrapError> {
        let listener = TcpListener::bind(addr)
            .map_err(|e| BootstrapError::io(format!("binding the store at {addr}"), e))?;
        let addr = listener
            .local_addr()
            .map_err(|e| BootstrapError::io("reading the store's address", e))?;
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (map, halt) = (Map::default(), stop.clone());
        std::thread::Builder::new()
            .name("uep-store".into())
            .spawn(move || accept(&listener, &map, &halt))
            .map_err(|e| BootstrapError::io("starting the store's thread", e))?;
        Ok(StoreServer { addr, stop })
    }

    /// Where it listens.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for StoreServer {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Release);
        // Wake the accepting thread, which then sees the flag.
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_secs(1));
    }
}

fn accept(listener: &TcpListener, map: &Map, stop: &std::sync::atomic::AtomicBool) {
    for conn in listener.incoming() {
        if stop.load(std::sync::atomic::Ordering::Acquire) {
            return;
        }
        let Ok(conn) = conn else { continue };
        let map = map.clone();
        let spawned = std::thread::Builder::new()
            .name("uep-store-conn".into())
            .spawn(move || {
                // A client that breaks the protocol or goes away ends its connection only.
                if let Err(e) = serve(conn, &map) {
                    tracing::debug!("store connection ended: {e}");
                }
            });
        if let Err(e) = spawned {
            tracing::warn!("store: cannot serve a connection: {e}");
        }
    }
}

fn serve(mut conn: TcpStream, map: &Map) -> std::io::Result<()> {
    let _ = conn.set_nodelay(true);
    loop {
        let mut op = [0u8];
        if conn.read(&mut op)? == 0 {
            return Ok(());
        }
        let key = read_key(&mut conn)?;
        let map_now = || map.lock().unwrap_or_else(PoisonError::into_inner);
        let reply = match op[0] {
            1 => {
                let value = read_value(&mut conn)?;
                map_now().insert(key, value);
                vec![0]
            }
            2 => match map_now().get(&key) {
                Some(v) => [&[1u8][..], &(v.len() as u32).to_le_bytes(), v].concat(),
                None => vec![0],
            },
            3 => {
                let delta = i64::from_le_bytes(read_n(&mut conn)?);
                let mut m = map_now();
                let old = m.get(&key).and_then(|v| v.as_slice().try_into().ok());
                let new = old.map_or(0, i64::from_le_bytes).wrapping_add(delta);
                m.insert(key, new.to_le_bytes().to_vec());
                new.to_le_bytes().to_vec()
            }
            4 => {
                map_now().remove(&key);
                vec![0]
            }
            other => return Err(invalid_data(format!("unknown store request {other}"))),
        };
        conn.write_all(&reply)?;
    }
}

fn invalid_data(what: String) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidData, what)
}

fn read_n<const N: usize>(r: &mut impl Read) -> std::io::Result<[u8; N]> {
    let mut b = [0u8; N];
    r.read_exact(&mut b)?;
    Ok(b)
}

fn read_bytes(r: &mut impl Read, n: usize, max: usize) -> std::io::Result<Vec<u8>> {
    if n > max {
        return Err(invalid_data(format!(
            "{n} bytes, more than the store's {max}"
        )));
    }
    let mut b = vec![0u8; n];
    r.read_exact(&mut b)?;
    Ok(b)
}

fn read_key(r: &mut impl Read) -> std::io::Result<String> {
    let n = u16::from_le_bytes(read_n(r)?) as usize;
    String::from_utf8(read_bytes(r, n, MAX_KEY)?)
        .map_err(|_| invalid_data("a key not UTF-8".into()))
}

fn read_value(r: &mut impl Read) -> std::io::Result<Vec<u8>> {
    let n = u32::from_le_bytes(read_n(r)?) as usize;
    read_bytes(r, n, MAX_VALUE)
}

/// A connection to a [`StoreServer`]. Every operation waits at most the timeout it was
/// made with; a set, get or delete whose connection broke is tried once more on a new
/// one (an add is not: it might count twice).
#[derive(Debug)]
pub struct TcpStore {
    addr: String,
    timeout: Duration,
    conn: Mutex<Option<TcpStream>>,
}

impl TcpStore {
    /// Connect to the store at `addr` (`HOST:PORT`), trying until `timeout` passes.
    pub fn connect(addr: &str, timeout: Duration) -> Result<TcpStore, BootstrapError> {
        let store = TcpStore {
            addr: addr.into(),
            timeout,
            conn: Mutex::new(None),
        };
        *store.conn.lock().unwrap_or_else(PoisonError::into_inner) = Some(store.open()?);
        Ok(store)
    }

    fn open(&self) -> Result<TcpStream, BootstrapError> {
        let deadline = Instant::now() + self.timeout;
        let mut last = String::new();
        let mut attempts = 0;
        while Instant::now() < deadline || attempts == 0 {
            attempts += 1;
            match connect_once(&self.addr, self.timeout) {
                Ok(s) => return Ok(s),
                Err(e) => last = e.to_string(),
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Err(BootstrapError::StoreUnreachable {
            addr: self.addr.clone(),
            timeout: self.timeout,
            attempts,
            last,
        })
    }

    /// Send `request` and read the reply with `read`, on the open connection (opening
    /// one if there is none); retried once on a new connection if `retry`.
    fn call<T>(
        &self,
        request: &[u8],
        retry: bool,
        read: impl Fn(&mut TcpStream) -> std::io::Result<T>,
    ) -> Result<T, BootstrapError> {
        let mut conn = self.conn.lock().unwrap_or_else(PoisonError::into_inner);
        for attempt in 0.. {
            let s = match conn.as_mut() {
                Some(s) => s,
                None => conn.insert(self.open()?),
            };
            match s.write_all(request).and_then(|()| read(s)) {
                Ok(v) => return Ok(v),
                Err(e) => {
                    *conn = None;
                    if !retry || attempt > 0 {
                        let what = format!("the store at {}", self.addr);
                        return Err(BootstrapError::io(what, e));
                    }
                }
            }
        }
        unreachable!("the loop returns")
    }
}

fn connect_once(addr: &str, timeout: Duration) -> std::io::Result<TcpStream> {
    let to = addr.to_socket_addrs()?.next();
    let to = to.ok_or_else(|| invalid_data(format!("{addr} names no address")))?;
    let s = TcpStream::connect_timeout(&to, timeout)?;
    s.set_nodelay(true)?;
    s.set_read_timeout(Some(timeout))?;
    s.set_write_timeout(Some(timeout))?;
    Ok(s)
}

fn request(op: u8, key: &str, payload: &[u8]) -> Result<Vec<u8>, BootstrapError> {
    if key.len() > MAX_KEY || payload.len() > MAX_VALUE {
        return Err(BootstrapError::Protocol {
            peer: "the store".into(),
            detail: format!(
                "a key of {} bytes or a value of {}: too long",
                key.len(),
                payload.len()
            ),
        });
    }
    let key_len = (key.len() as u16).to_le_bytes();
    Ok([&[op][..], &key_len, key.as_bytes(), payload].concat())
}

fn read_ack(s: &mut TcpStream) -> std::io::Result<()> {
    match read_n::<1>(s)? {
        [0] => Ok(()),
        [b] => Err(invalid_data(format!("the store answered {b}, not 0"))),
    }
}

impl Store for TcpStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<(), BootstrapError> {
        let len = (value.len() as u32).to_le_bytes();
        let req = request(1, key, &[&len[..], value].concat())?;
        self.call(&req, true, read_ack)
    }

    fn get(&self, key: &str) -> Result<Option<Vec<u8>>, BootstrapError> {
        self.call(&request(2, key, &[])?, true, |s| match read_n::<1>(s)? {
            [0] => Ok(None),
            _ => read_value(s).map(Some),
        })
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64, BootstrapError> {
        let req = request(3, key, &delta.to_le_bytes())?;
        self.call(&req, false, |s| read_n(s).map(i64::from_le_bytes))
    }

    fn delete(&self, key: &str) -> Result<(), BootstrapError> {
        self.call(&request(4, key, &[])?, true, read_ack)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair() -> (StoreServer, TcpStore) {
        let server = StoreServer::bind("127.0.0.1:0").unwrap();
        let store = TcpStore::connect(&server.addr().to_string(), Duration::from_secs(5)).unwrap();
        (server, store)
    }

    #[test]
    fn set_get_add_delete() {
        let (_server, s) = pair();
        assert_eq!(s.get("a").unwrap(), None);
        s.set("a", b"one").unwrap();
        s.set("a", b"two").unwrap();
        assert_eq!(s.get("a").unwrap().as_deref(), Some(&b"two"[..]));
        s.set("empty", b"").unwrap();
        assert_eq!(s.get("empty").unwrap().as_deref(), Some(&b""[..]));
        assert_eq!(s.add("n", 3).unwrap(), 3);
        assert_eq!(s.add("n", -1).unwrap(), 2);
        assert_eq!(s.add("n", 0).unwrap(), 2);
        s.delete("a").unwrap();
        s.delete("never").unwrap();
        assert_eq!(s.get("a").unwrap(), None);
    }

    #[test]
    fn many_clients_count_once_each() {
        let (server, _) = pair();
        let addr = server.addr().to_string();
        let threads: Vec<_> = (0..8)
            .map(|_| {
                let addr = addr.clone();
                std::thread::spawn(move || {
                    let s = TcpStore::connect(&addr, Duration::from_secs(5)).unwrap();
                    for _ in 0..50 {
                        s.add("count", 1).unwrap();
                    }
                })
            })
            .collect();
        threads.into_iter().for_each(|t| t.join().unwrap());
        let s = TcpStore::connect(&addr, Duration::from_secs(5)).unwrap();
        assert_eq!(s.add("count", 0).unwrap(), 400);
    }

    #[test]
    fn a_broken_request_ends_only_its_connection() {
        let (server, s) = pair();
        s.set("k", b"v").unwrap();
        let mut bad = TcpStream::connect(server.addr()).unwrap();
        bad.write_all(&[9, 1, 0, b'k']).unwrap();
        let mut buf = [0u8; 1];
        assert_eq!(bad.read(&mut buf).unwrap_or(0), 0, "closed without a reply");
        assert_eq!(s.get("k").unwrap().as_deref(), Some(&b"v"[..]));
    }

    #[test]
    fn no_server_fails_at_the_deadline() {
        let addr = {
            let l = TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().to_string()
        };
        let start = Instant::now();
        let err = TcpStore::connect(&addr, Duration::from_millis(300)).unwrap_err();
        assert!(
            matches!(err, BootstrapError::StoreUnreachable { .. }),
            "{err}"
        );
        assert!(start.elapsed() < Duration::from_secs(3));
    }
}
