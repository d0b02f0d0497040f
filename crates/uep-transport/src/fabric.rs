//! [`LibfabricTransport`]: a libfabric RDM endpoint with remote CQ data, and
//! provider discovery ([`list_providers`]).
//!
//! This is the only module besides `ffi` that contains `unsafe`; every block
//! is a call into the C shim (or a write into memory the provider was handed)
//! and says why it is sound.

use std::cell::UnsafeCell;
use std::ffi::{c_char, c_void, CStr, CString};
use std::ptr;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::ffi::{self, FiInfo, UepInfoView};
use crate::WriteOp;
use crate::{
    check_range, Arrival, Caps, Completion, PeerAddr, RegionRef, Side, Transport, TransportError,
};

/// Provider used when neither the options nor `UEP_FI_PROVIDER` name one.
pub const DEFAULT_PROVIDER: &str = "tcp;ofi_rxm";

/// libfabric settings uep prefers, each applied by [`apply_env_defaults`] only where the
/// environment leaves it unset.
///
/// `FI_OFI_RXM_ENABLE_PASSTHRU=1`: `ofi_rxm` hands every call straight to the `tcp`
/// provider's own RDM endpoint instead of running its protocol over bounce buffers.
/// uep posts only RMA writes with immediate data, which rxm forwards either way, but
/// without passthru every endpoint allocates and zeroes rxm's buffer pools: a rank's
/// resident memory was 700 MB–1.4 GB instead of 30–60 MB, and its transports took
/// 0.7–1.2 s longer to open (docs/performance.md, "Opening the tcp transport").
pub const ENV_DEFAULTS: &[(&str, &str)] = &[("FI_OFI_RXM_ENABLE_PASSTHRU", "1")];

/// Sets each of [`ENV_DEFAULTS`] that the environment leaves unset; returns the ones it
/// set. libfabric reads them once, at the process's first `fi_getinfo`, so call this
/// at process start, before other threads run (the `uep` CLI does at the top of
/// `main`, the Python package at import, through `os.environ`).
pub fn apply_env_defaults() -> Vec<(&'static str, &'static str)> {
    ENV_DEFAULTS
        .iter()
        .filter(|(k, _)| std::env::var_os(k).is_none())
        .inspect(|(k, v)| std::env::set_var(k, v))
        .copied()
        .collect()
}

/// How to open a [`LibfabricTransport`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FabricOptions {
    /// libfabric provider name, e.g. `tcp;ofi_rxm`, `efa`, `verbs;ofi_rxm`.
    pub provider: String,
    /// Restrict to this domain (NIC), e.g. `lo`, `rdmap0s6-rdm`; `None` = first.
    pub domain: Option<String>,
    /// Source address hint passed as `node` with `FI_SOURCE`, e.g. `127.0.0.1`
    /// to bind a socket provider to loopback; `None` = provider default.
    pub node: Option<String>,
    /// Ask for `FI_ATOMIC`. Native atomics are enabled only if the provider
    /// also proves write-then-atomic ordering (see [`Caps::native_atomics`]).
    pub atomics: bool,
}

impl Default for FabricOptions {
    /// Same as [`FabricOptions::from_env`].
    fn default() -> Self {
        Self::from_env()
    }
}

impl FabricOptions {
    /// Options from the environment: `UEP_FI_PROVIDER` (default
    /// `tcp;ofi_rxm`), `UEP_FI_DOMAIN`, `UEP_FI_NODE`; atomics off.
    ///
    /// Without `UEP_FI_NODE`, a socket provider (`tcp`, `sockets`, `udp`) is bound to
    /// the address this host uses to reach `MASTER_ADDR`, if the launcher set it: on a
    /// host with several interfaces the provider's default may be one the other hosts
    /// cannot reach (loopback, a management network), while the route to rank 0 is the
    /// one the job's own control traffic already takes.
    pub fn from_env() -> Self {
        let provider = std::env::var("UEP_FI_PROVIDER")
            .ok()
            .filter(|v| !v.is_empty())
            .unwrap_or_else(|| DEFAULT_PROVIDER.to_string());
        Self::for_provider(&provider)
    }

    /// Options for `provider`, with the rest from the environment as in
    /// [`FabricOptions::from_env`] (the source address depends on the provider).
    pub fn for_provider(provider: &str) -> Self {
        let var = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
        let provider = provider.to_string();
        let node = var("UEP_FI_NODE").or_else(|| {
            let sockets = ["tcp", "sockets", "udp"]
                .iter()
                .any(|p| provider.starts_with(p));
            sockets
                .then(|| var("MASTER_ADDR"))
                .flatten()
                .and_then(|m| route_source(&m))
                .map(|ip| ip.to_string())
        });
        Self {
            provider,
            domain: var("UEP_FI_DOMAIN"),
            node,
            atomics: false,
        }
    }

    /// Loopback options for tests and single-host runs: `provider` bound to
    /// 127.0.0.1 (for socket-based providers this picks the `lo` domain).
    pub fn loopback(provider: &str) -> Self {
        Self {
            provider: provider.to_string(),
            domain: None,
            node: Some("127.0.0.1".to_string()),
            atomics: false,
        }
    }
}

/// The local address the kernel would use as the source of packets to `host`, found by
/// connecting a UDP socket (which sends nothing); `None` if `host` does not resolve or
/// has no route.
pub fn route_source(host: &str) -> Option<std::net::IpAddr> {
    use std::net::{Ipv4Addr, Ipv6Addr, ToSocketAddrs, UdpSocket};
    // The port is irrelevant: a UDP connect only picks the route.
    let target = (host, 9).to_socket_addrs().ok()?.next()?;
    let any: std::net::IpAddr = if target.is_ipv4() {
        Ipv4Addr::UNSPECIFIED.into()
    } else {
        Ipv6Addr::UNSPECIFIED.into()
    };
    let socket = UdpSocket::bind((any, 0)).ok()?;
    socket.connect(target).ok()?;
    Some(socket.local_addr().ok()?.ip())
}

/// One libfabric provider/domain as `fi_getinfo` describes it, for `uep info`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProviderInfo {
    /// Provider name (`fabric_attr->prov_name`), e.g. `tcp;ofi_rxm`.
    pub provider: String,
    /// Fabric name, e.g. `127.0.0.1/32`.
    pub fabric: String,
    /// Domain (NIC) name, e.g. `lo`.
    pub domain: String,
    /// Endpoint type: `rdm`, `msg`, `dgram` or `unspec`.
    pub ep_type: String,
    /// Has `FI_RMA` with local write (initiator) capability.
    pub rma_write: bool,
    /// Accepts remote writes (`FI_REMOTE_WRITE`).
    pub remote_write: bool,
    /// Bytes of remote CQ data a write can carry (uep needs >= 4).
    pub cq_data_size: usize,
    /// Has `FI_ATOMIC`.
    pub atomics: bool,
    /// Delivery order and in-order target completion are both proven
    /// (uep's rule for [`Caps::ordered`]).
    pub ordered: bool,
    /// `msg_order` bits common to tx and rx, as names.
    pub msg_order: Vec<String>,
    /// rx `comp_order` bits, as names.
    pub comp_order: Vec<String>,
    /// `mr_mode` bits, as names.
    pub mr_mode: Vec<String>,
    /// Mode bits the provider requires of the application, as names.
    pub mode: Vec<String>,
    /// Largest message / RMA size.
    pub max_msg_size: u64,
}

impl ProviderInfo {
    /// Whether uep can run over it: RDM endpoint, RMA write both ways and at
    /// least 4 bytes of remote CQ data for the immediate.
    pub fn fits(&self) -> bool {
        self.ep_type == "rdm" && self.rma_write && self.remote_write && self.cq_data_size >= 4
    }

    fn from_view(v: &UepInfoView) -> Self {
        let caps = v.caps;
        let has = |bit: u64| caps & bit != 0;
        // libfabric: when neither READ nor WRITE is given, both are implied.
        let rma_write = has(ffi::FI_RMA) && (has(ffi::FI_WRITE) || !has(ffi::FI_READ));
        let remote_write =
            has(ffi::FI_RMA) && (has(ffi::FI_REMOTE_WRITE) || !has(ffi::FI_REMOTE_READ));
        Self {
            provider: cstr(v.prov_name),
            fabric: cstr(v.fabric_name),
            domain: cstr(v.domain_name),
            ep_type: match v.ep_type {
                ffi::FI_EP_RDM => "rdm",
                ffi::FI_EP_MSG => "msg",
                ffi::FI_EP_DGRAM => "dgram",
                _ => "unspec",
            }
            .to_string(),
            rma_write,
            remote_write,
            cq_data_size: usize::try_from(v.cq_data_size).unwrap_or(usize::MAX),
            atomics: has(ffi::FI_ATOMIC),
            ordered: proves_order(v),
            msg_order: order_names(v.tx_msg_order & v.rx_msg_order),
            comp_order: comp_order_names(v.rx_comp_order),
            mr_mode: mr_mode_names(v.mr_mode),
            mode: mode_names(v.mode),
            max_msg_size: v.max_msg_size,
        }
    }
}

/// uep's rule for "delivery is ordered": writes are placed in order
/// (`FI_ORDER_RMA_WAW`, or the older all-writes `FI_ORDER_WAW`, on both tx
/// and rx) AND target completions are reported in order (rx `comp_order`
/// includes `FI_ORDER_STRICT`). Both are needed for "imm of write B observed
/// => data of earlier write A visible". tcp;ofi_rxm advertises RMA_WAW but
/// `comp_order = NONE`, so it counts as unordered.
fn proves_order(v: &UepInfoView) -> bool {
    v.tx_msg_order & v.rx_msg_order & (ffi::FI_ORDER_RMA_WAW | ffi::FI_ORDER_WAW) != 0
        && v.rx_comp_order & ffi::FI_ORDER_STRICT == ffi::FI_ORDER_STRICT
}

/// Native atomics are trusted only with proven write order and
/// `FI_ORDER_WAW`, the libfabric bit that orders RMA writes and atomic writes
/// relative to each other (write-then-atomic on one endpoint).
fn proves_atomic_order(v: &UepInfoView) -> bool {
    proves_order(v) && v.tx_msg_order & v.rx_msg_order & ffi::FI_ORDER_WAW != 0
}

/// Maps the legacy mr_mode values to their modern bit equivalents.
fn normalize_mr_mode(m: i32) -> i32 {
    match m {
        // FI_MR_BASIC
        1 => ffi::FI_MR_VIRT_ADDR | ffi::FI_MR_ALLOCATED | ffi::FI_MR_PROV_KEY,
        // FI_MR_SCALABLE
        2 => 0,
        m => m,
    }
}

fn names(bits: u64, table: &[(u64, &str)]) -> Vec<String> {
    table
        .iter()
        .filter(|(b, _)| bits & b == *b && *b != 0)
        .map(|(_, n)| (*n).to_string())
        .collect()
}

fn order_names(bits: u64) -> Vec<String> {
    const T: &[(u64, &str)] = &[
        (1 << 0, "RAR"),
        (1 << 1, "RAW"),
        (1 << 2, "RAS"),
        (1 << 3, "WAR"),
        (1 << 4, "WAW"),
        (1 << 5, "WAS"),
        (1 << 6, "SAR"),
        (1 << 7, "SAW"),
        (1 << 8, "SAS"),
        (1 << 32, "RMA_RAR"),
        (1 << 33, "RMA_RAW"),
        (1 << 34, "RMA_WAR"),
        (1 << 35, "RMA_WAW"),
        (1 << 36, "ATOMIC_RAR"),
        (1 << 37, "ATOMIC_RAW"),
        (1 << 38, "ATOMIC_WAR"),
        (1 << 39, "ATOMIC_WAW"),
    ];
    names(bits, T)
}

fn comp_order_names(bits: u64) -> Vec<String> {
    names(
        bits,
        &[
            (ffi::FI_ORDER_STRICT, "STRICT"),
            (ffi::FI_ORDER_DATA, "DATA"),
        ],
    )
}

fn mr_mode_names(bits: i32) -> Vec<String> {
    const T: &[(u64, &str)] = &[
        (1 << 0, "BASIC"),
        (1 << 1, "SCALABLE"),
        (ffi::FI_MR_LOCAL as u64, "LOCAL"),
        (ffi::FI_MR_RAW as u64, "RAW"),
        (ffi::FI_MR_VIRT_ADDR as u64, "VIRT_ADDR"),
        (ffi::FI_MR_ALLOCATED as u64, "ALLOCATED"),
        (ffi::FI_MR_PROV_KEY as u64, "PROV_KEY"),
        (ffi::FI_MR_MMU_NOTIFY as u64, "MMU_NOTIFY"),
        (ffi::FI_MR_RMA_EVENT as u64, "RMA_EVENT"),
        (ffi::FI_MR_ENDPOINT as u64, "ENDPOINT"),
        (ffi::FI_MR_HMEM as u64, "HMEM"),
    ];
    names(bits as u32 as u64, T)
}

fn mode_names(bits: u64) -> Vec<String> {
    const T: &[(u64, &str)] = &[
        (ffi::FI_CONTEXT, "CONTEXT"),
        (ffi::FI_CONTEXT2, "CONTEXT2"),
        (ffi::FI_RX_CQ_DATA, "RX_CQ_DATA"),
        (1 << 51, "BUFFERED_RECV"),
        (1 << 58, "MSG_PREFIX"),
        (1 << 57, "ASYNC_IOV"),
        (1 << 55, "LOCAL_MR"),
        (1 << 54, "NOTIFY_FLAGS_ONLY"),
        (1 << 53, "RESTRICTED_COMP"),
    ];
    names(bits, T)
}

/// Copies a C string the shim handed out (NULL -> empty).
fn cstr(p: *const c_char) -> String {
    if p.is_null() {
        return String::new();
    }
    // SAFETY: non-null pointers come from the shim and point at NUL-terminated
    // strings owned by a live fi_info (or libfabric's static error table); we
    // copy before the owner can be freed.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

fn strerror(code: i32) -> String {
    // SAFETY: fi_strerror accepts any int and returns a static string.
    cstr(unsafe { ffi::uep_strerror(code) })
}

fn fab_err(call: &'static str, rc: i64) -> TransportError {
    let code = i32::try_from(rc.unsigned_abs()).unwrap_or(i32::MAX);
    TransportError::Fabric {
        call,
        code,
        msg: strerror(code),
    }
}

/// Mode bits uep can honour (see the module docs of each handling site).
const SUPPORTED_MODE: u64 = ffi::FI_CONTEXT | ffi::FI_CONTEXT2 | ffi::FI_RX_CQ_DATA;
/// mr_mode bits uep can honour. Not RAW (keys wider than 64 bits), not HMEM.
const SUPPORTED_MR_MODE: i32 = ffi::FI_MR_LOCAL
    | ffi::FI_MR_VIRT_ADDR
    | ffi::FI_MR_ALLOCATED
    | ffi::FI_MR_PROV_KEY
    | ffi::FI_MR_ENDPOINT;

/// An owned `fi_info` list, freed on drop.
struct InfoList(*mut FiInfo);

impl InfoList {
    fn views(&self) -> Vec<(*mut FiInfo, UepInfoView)> {
        let mut out = Vec::new();
        let mut cur = self.0;
        while !cur.is_null() {
            let mut v = UepInfoView::default();
            // SAFETY: `cur` is a node of the live list owned by `self`; the shim
            // only reads it and fills `v`, a properly sized repr(C) struct.
            unsafe { ffi::uep_fi_view(cur, &mut v) };
            out.push((cur, v));
            // SAFETY: as above; `next` is NULL or another node of the same list.
            cur = unsafe { ffi::uep_fi_next(cur) };
        }
        out
    }
}

impl Drop for InfoList {
    fn drop(&mut self) {
        if !self.0.is_null() {
            // SAFETY: we own this list (from fi_getinfo/fi_allocinfo), nothing
            // else frees it, and no pointer into it outlives `self` (views'
            // strings are copied by `cstr` before we return).
            unsafe { ffi::uep_fi_freeinfo(self.0) };
        }
    }
}

struct Hints<'a> {
    caps: u64,
    ep_type: i32,
    threading: i32,
    provider: Option<&'a str>,
    domain: Option<&'a str>,
    node: Option<&'a str>,
}

fn c_string(what: &str, s: &str) -> Result<CString, TransportError> {
    CString::new(s).map_err(|_| {
        TransportError::Invalid(format!("{what} {s:?} contains a NUL byte; names must not"))
    })
}

fn getinfo(h: &Hints<'_>) -> Result<InfoList, TransportError> {
    let prov = h.provider.map(|p| c_string("provider", p)).transpose()?;
    let dom = h.domain.map(|d| c_string("domain", d)).transpose()?;
    let node = h.node.map(|n| c_string("node", n)).transpose()?;
    // SAFETY: allocates a fresh, zeroed fi_info; ownership goes to `hints`.
    let hints = InfoList(unsafe { ffi::uep_fi_allocinfo() });
    if hints.0.is_null() {
        return Err(TransportError::Fabric {
            call: "fi_allocinfo",
            code: 12,
            msg: "out of memory".into(),
        });
    }
    // SAFETY: `hints.0` is a live fi_info with all sub-attrs allocated by
    // fi_allocinfo; string arguments are NUL-terminated and only duplicated.
    let rc = unsafe {
        ffi::uep_fi_hints_set(
            hints.0,
            h.caps,
            SUPPORTED_MODE,
            SUPPORTED_MR_MODE,
            h.ep_type,
            h.threading,
            prov.as_ref().map_or(ptr::null(), |s| s.as_ptr()),
            dom.as_ref().map_or(ptr::null(), |s| s.as_ptr()),
        )
    };
    if rc != 0 {
        return Err(fab_err("fi_allocinfo (hints)", rc.into()));
    }
    let mut out: *mut FiInfo = ptr::null_mut();
    let flags = if node.is_some() { ffi::FI_SOURCE } else { 0 };
    // SAFETY: hints is valid; `node` is NUL-terminated or NULL; `out` receives
    // a list we then own.
    let rc = unsafe {
        ffi::uep_fi_getinfo(
            node.as_ref().map_or(ptr::null(), |s| s.as_ptr()),
            flags,
            hints.0,
            &mut out,
        )
    };
    let list = InfoList(out);
    if rc != 0 {
        return Err(fab_err("fi_getinfo", rc.into()));
    }
    Ok(list)
}

/// Lists every provider/domain libfabric offers (no capability filter), with
/// what uep needs to know about each; use [`ProviderInfo::fits`] to see which
/// can carry uep. An empty list means libfabric found nothing.
pub fn list_providers() -> Result<Vec<ProviderInfo>, TransportError> {
    let list = match getinfo(&Hints {
        caps: 0,
        ep_type: 0,
        threading: 0,
        provider: None,
        domain: None,
        node: None,
    }) {
        Ok(l) => l,
        Err(TransportError::Fabric { code, .. }) if code == ffi::FI_ENODATA => {
            return Ok(Vec::new())
        }
        Err(e) => return Err(e),
    };
    // Providers often return several identical-looking entries (variants
    // that differ only in fields uep does not report); show each once.
    let mut out: Vec<ProviderInfo> = Vec::new();
    for (_, v) in list.views() {
        let p = ProviderInfo::from_view(&v);
        if !out.contains(&p) {
            out.push(p);
        }
    }
    Ok(out)
}

/// Raw libfabric objects, closed in dependency order on drop (also on a
/// half-finished construction).
struct Fids {
    /// Owned fi_info list; freed after the objects close.
    _info: InfoList,
    fabric: *mut ffi::FidFabric,
    domain: *mut ffi::FidDomain,
    tx_cq: *mut ffi::FidCq,
    rx_cq: *mut ffi::FidCq,
    av: *mut ffi::FidAv,
    ep: *mut ffi::FidEp,
    mr: *mut ffi::FidMr,
    op_mr: *mut ffi::FidMr,
}

// SAFETY: the objects are owned exclusively by this value and only used
// through `&mut LibfabricTransport` (which is not `Sync`), so at most one
// thread touches them at a time. The domain is opened with FI_THREAD_DOMAIN,
// which requires serialised access, not thread affinity, so moving the whole
// set to another thread is allowed.
unsafe impl Send for Fids {}

impl Drop for Fids {
    fn drop(&mut self) {
        // Endpoint first (it references CQs, AV and MRs), then MRs, AV, CQs,
        // domain, fabric: the order fabtests uses.
        let objs: [(&str, *mut c_void); 8] = [
            ("endpoint", self.ep.cast()),
            ("memory region", self.mr.cast()),
            ("operand memory region", self.op_mr.cast()),
            ("address vector", self.av.cast()),
            ("recv completion queue", self.rx_cq.cast()),
            ("send completion queue", self.tx_cq.cast()),
            ("domain", self.domain.cast()),
            ("fabric", self.fabric.cast()),
        ];
        for (name, obj) in objs {
            if obj.is_null() {
                continue;
            }
            // SAFETY: `obj` was opened by us, is closed exactly once here, and
            // everything bound to it has already been closed above.
            let rc = unsafe { ffi::uep_close(obj) };
            if rc != 0 {
                tracing::warn!("libfabric: closing {name} failed: {}", strerror(-rc));
            }
        }
        // `info` is freed by its own Drop after this.
    }
}

/// Provider scratch space for one in-flight operation (`struct fi_context2`
/// when FI_CONTEXT/FI_CONTEXT2 mode is on) plus an atomic's operand. The
/// address of a slot is the operation's libfabric context.
#[repr(C, align(64))]
struct CtxSlot {
    scratch: [u64; ffi::CONTEXT_BYTES / 8],
    operand: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum SlotKind {
    Free,
    Write,
    Atomic,
    Recv,
    /// A write or atomic to a peer given up on ([`Transport::abandon_peer`]): the
    /// provider still owns the slot until its completion, which is then dropped.
    Abandoned,
}

/// Fixed table of operation contexts. Its memory never moves (boxed slice,
/// never resized) because the provider holds slot pointers until completion.
struct Slots {
    mem: Box<[UnsafeCell<CtxSlot>]>,
    kind: Vec<SlotKind>,
    user: Vec<u64>,
    /// The peer of each write or atomic.
    peer: Vec<u32>,
    free: Vec<u32>,
}

impl Slots {
    fn new(n: usize) -> Self {
        Self {
            mem: (0..n)
                .map(|_| {
                    UnsafeCell::new(CtxSlot {
                        scratch: [0; ffi::CONTEXT_BYTES / 8],
                        operand: 0,
                    })
                })
                .collect(),
            kind: vec![SlotKind::Free; n],
            user: vec![0; n],
            peer: vec![0; n],
            // Pop from the end: hand out low indices first (nicer in dumps).
            free: (0..n as u32).rev().collect(),
        }
    }

    fn alloc(&mut self, kind: SlotKind, user: u64, peer: usize) -> Option<u32> {
        let i = self.free.pop()?;
        self.kind[i as usize] = kind;
        self.user[i as usize] = user;
        self.peer[i as usize] = peer as u32;
        Some(i)
    }

    fn release(&mut self, i: u32) {
        if self.kind[i as usize] != SlotKind::Free {
            self.kind[i as usize] = SlotKind::Free;
            self.free.push(i);
        }
    }

    fn ptr(&self, i: u32) -> *mut CtxSlot {
        self.mem[i as usize].get()
    }

    /// Maps a context pointer from a completion back to its slot index.
    fn index_of(&self, p: *mut c_void) -> Option<u32> {
        let base = self.mem.as_ptr() as usize;
        let size = std::mem::size_of::<CtxSlot>();
        let off = (p as usize).checked_sub(base)?;
        let i = off / size;
        (off % size == 0 && i < self.mem.len()).then_some(i as u32)
    }
}

#[derive(Clone, Debug)]
struct Peer {
    fi_addr: u64,
    /// Added to a remote offset to form the RMA address (the peer's virtual
    /// base under FI_MR_VIRT_ADDR, else 0).
    base: u64,
    len: u64,
    key: u64,
}

const ADDR_MAGIC: &[u8; 4] = b"UEPF";
const ADDR_VERSION: u8 = 1;

fn encode_addr(provider: &str, name: &[u8], base: u64, len: u64, key: u64) -> PeerAddr {
    let mut v = Vec::with_capacity(4 + 1 + 2 + provider.len() + 2 + name.len() + 24);
    v.extend_from_slice(ADDR_MAGIC);
    v.push(ADDR_VERSION);
    // Lengths fit u16: provider names are short and endpoint names are
    // sockaddr-sized; `local_addr` checked both at construction.
    v.extend_from_slice(&(provider.len() as u16).to_le_bytes());
    v.extend_from_slice(provider.as_bytes());
    v.extend_from_slice(&(name.len() as u16).to_le_bytes());
    v.extend_from_slice(name);
    v.extend_from_slice(&base.to_le_bytes());
    v.extend_from_slice(&len.to_le_bytes());
    v.extend_from_slice(&key.to_le_bytes());
    PeerAddr(v)
}

struct DecodedAddr {
    provider: String,
    name: Vec<u8>,
    base: u64,
    len: u64,
    key: u64,
}

fn decode_addr(peer: usize, a: &PeerAddr) -> Result<DecodedAddr, TransportError> {
    let bad = |reason: String| TransportError::BadPeerAddr { peer, reason };
    let mut b: &[u8] = &a.0;
    let mut take = |n: usize, what: &str| -> Result<Vec<u8>, TransportError> {
        if b.len() < n {
            return Err(bad(format!(
                "truncated at {what}: needs {n} more bytes, {} left (address is {} bytes)",
                b.len(),
                a.0.len()
            )));
        }
        let (h, t) = b.split_at(n);
        b = t;
        Ok(h.to_vec())
    };
    if take(4, "magic")? != ADDR_MAGIC {
        return Err(bad("not a uep libfabric address (bad magic)".into()));
    }
    let ver = take(1, "version")?[0];
    if ver != ADDR_VERSION {
        return Err(bad(format!(
            "address format version {ver}, this build understands {ADDR_VERSION}"
        )));
    }
    let u16le = |v: Vec<u8>| u16::from_le_bytes([v[0], v[1]]) as usize;
    let u64le = |v: Vec<u8>| {
        let mut w = [0u8; 8];
        w.copy_from_slice(&v);
        u64::from_le_bytes(w)
    };
    let plen = u16le(take(2, "provider length")?);
    let provider = String::from_utf8(take(plen, "provider")?)
        .map_err(|_| bad("provider name is not UTF-8".into()))?;
    let nlen = u16le(take(2, "name length")?);
    let name = take(nlen, "endpoint name")?;
    let base = u64le(take(8, "region base")?);
    let len = u64le(take(8, "region length")?);
    let key = u64le(take(8, "region key")?);
    if !b.is_empty() {
        return Err(bad(format!("{} trailing bytes", b.len())));
    }
    Ok(DecodedAddr {
        provider,
        name,
        base,
        len,
        key,
    })
}

/// The provider `fi_getinfo` chose for the options, and what uep reads of it.
struct Chosen {
    list: InfoList,
    /// The first node of `list`.
    info: *mut FiInfo,
    view: UepInfoView,
    pinfo: ProviderInfo,
    mr_mode: i32,
}

/// The first provider that matches `opts` with what uep needs (RDM, RMA write, remote
/// CQ data; atomics if asked and offered), or why there is none.
fn choose_provider(opts: &FabricOptions) -> Result<Chosen, TransportError> {
    let base_caps = ffi::FI_MSG
        | ffi::FI_RMA
        | ffi::FI_WRITE
        | ffi::FI_REMOTE_WRITE
        // FI_RECV only matters for FI_RX_CQ_DATA providers, where remote
        // CQ data consumes posted receives.
        | ffi::FI_RECV;
    let mut hints = Hints {
        caps: base_caps | if opts.atomics { ffi::FI_ATOMIC } else { 0 },
        ep_type: ffi::FI_EP_RDM,
        threading: ffi::FI_THREAD_DOMAIN,
        provider: Some(&opts.provider),
        domain: opts.domain.as_deref(),
        node: opts.node.as_deref(),
    };
    let list = match getinfo(&hints) {
        Err(TransportError::Fabric { code, .. }) if code == ffi::FI_ENODATA && opts.atomics => {
            // Atomics are optional: fall back to emulation.
            hints.caps = base_caps;
            getinfo(&hints)
        }
        r => r,
    }
    .map_err(|e| match e {
        TransportError::Fabric { code, .. } if code == ffi::FI_ENODATA => {
            TransportError::Invalid(format!(
                "no libfabric provider matches {:?} (domain {:?}, node {:?}) with an RDM \
                 endpoint, RMA write and remote CQ data; run `fi_info -l` / `uep info` to \
                 see what is available and set UEP_FI_PROVIDER",
                opts.provider, opts.domain, opts.node
            ))
        }
        e => e,
    })?;
    let (info, view) = list
        .views()
        .into_iter()
        .next()
        .ok_or_else(|| TransportError::Invalid("fi_getinfo returned an empty list".into()))?;
    let pinfo = ProviderInfo::from_view(&view);
    let unsupported = |why: String| TransportError::Unsupported {
        op: "open",
        provider: pinfo.provider.clone(),
        why,
    };
    if !pinfo.fits() {
        return Err(unsupported(format!(
            "uep needs an RDM endpoint with RMA write and >= 4 bytes of remote CQ data; \
             got ep {} rma_write {} remote_write {} cq_data_size {}",
            pinfo.ep_type, pinfo.rma_write, pinfo.remote_write, pinfo.cq_data_size
        )));
    }
    let mr_mode = normalize_mr_mode(view.mr_mode);
    if mr_mode & !SUPPORTED_MR_MODE != 0 {
        return Err(unsupported(format!(
            "provider requires mr_mode {:?}; uep handles LOCAL, VIRT_ADDR, ALLOCATED, \
             PROV_KEY and ENDPOINT",
            pinfo.mr_mode
        )));
    }
    Ok(Chosen {
        list,
        info,
        view,
        pinfo,
        mr_mode,
    })
}

impl Fids {
    /// Opens the fabric, domain, both CQs, the AV and the endpoint of `info` (a node
    /// of `list`, which the result keeps), binds them and enables the endpoint.
    fn open(
        list: InfoList,
        info: *mut FiInfo,
        view: &UepInfoView,
        tx_size: usize,
        rx_size: usize,
    ) -> Result<Fids, TransportError> {
        let mut fids = Fids {
            _info: list,
            fabric: ptr::null_mut(),
            domain: ptr::null_mut(),
            tx_cq: ptr::null_mut(),
            rx_cq: ptr::null_mut(),
            av: ptr::null_mut(),
            ep: ptr::null_mut(),
            mr: ptr::null_mut(),
            op_mr: ptr::null_mut(),
        };
        // SAFETY: `info` is a node of `fids._info` (alive); out-pointer valid.
        let rc = unsafe { ffi::uep_fabric_open(info, &mut fids.fabric) };
        check("fi_fabric", rc)?;
        // SAFETY: fabric just opened; info alive; out-pointer valid.
        let rc = unsafe { ffi::uep_domain_open(fids.fabric, info, &mut fids.domain) };
        check("fi_domain", rc)?;
        // SAFETY: domain open; CQ attrs built by the shim; out-pointer valid.
        let rc = unsafe { ffi::uep_cq_open(fids.domain, tx_size, &mut fids.tx_cq) };
        check("fi_cq_open (send)", rc)?;
        // Room for every arrival between two polls at full rate.
        // SAFETY: as above.
        let rc = unsafe { ffi::uep_cq_open(fids.domain, rx_size.max(4096), &mut fids.rx_cq) };
        check("fi_cq_open (recv)", rc)?;
        let av_type = if view.av_type == ffi::FI_AV_MAP {
            ffi::FI_AV_MAP
        } else {
            ffi::FI_AV_TABLE
        };
        // SAFETY: domain open; out-pointer valid.
        let rc = unsafe { ffi::uep_av_open(fids.domain, av_type, 64, &mut fids.av) };
        check("fi_av_open", rc)?;
        // SAFETY: domain open; info alive; out-pointer valid.
        let rc = unsafe { ffi::uep_ep_open(fids.domain, info, &mut fids.ep) };
        check("fi_endpoint", rc)?;
        // SAFETY: ep and CQs open; FI_TRANSMIT/FI_RECV select the queue.
        let rc = unsafe { ffi::uep_ep_bind_cq(fids.ep, fids.tx_cq, ffi::FI_TRANSMIT) };
        check("fi_ep_bind (send cq)", rc)?;
        // SAFETY: as above.
        let rc = unsafe { ffi::uep_ep_bind_cq(fids.ep, fids.rx_cq, ffi::FI_RECV) };
        check("fi_ep_bind (recv cq)", rc)?;
        // SAFETY: ep and AV open.
        let rc = unsafe { ffi::uep_ep_bind_av(fids.ep, fids.av) };
        check("fi_ep_bind (av)", rc)?;
        // SAFETY: ep fully bound.
        let rc = unsafe { ffi::uep_ep_enable(fids.ep) };
        check("fi_enable", rc)?;
        Ok(fids)
    }

    /// Under FI_MR_ENDPOINT, binds `mr` to the endpoint and enables it.
    fn bind_mr(&self, mr: *mut ffi::FidMr, mr_mode: i32) -> Result<(), TransportError> {
        if mr_mode & ffi::FI_MR_ENDPOINT != 0 {
            // SAFETY: MR and ep open; FI_MR_ENDPOINT requires bind + enable.
            check("fi_mr_bind", unsafe { ffi::uep_mr_bind_ep(mr, self.ep) })?;
            // SAFETY: MR bound.
            check("fi_mr_enable", unsafe { ffi::uep_mr_enable(mr) })?;
        }
        Ok(())
    }

    /// Registers `region` as the source of this rank's writes and the target of its
    /// peers': its remote key and local descriptor.
    fn register_region(
        &mut self,
        region: &RegionRef,
        mr_mode: i32,
        pinfo: &ProviderInfo,
    ) -> Result<(u64, *mut c_void), TransportError> {
        let requested = NEXT_KEY.fetch_add(1, Ordering::Relaxed);
        // SAFETY: the region's contract (RegionRef::from_raw / from_heap)
        // guarantees `addr..addr+len` stays valid and writable for as long as
        // `region` lives, and the transport holds `region` in a field that drops
        // after its `Fids` close the MR.
        let rc = unsafe {
            ffi::uep_mr_reg(
                self.domain,
                region.addr() as *mut c_void,
                region.len(),
                // Source of our writes, target of theirs (atomics included).
                ffi::FI_WRITE | ffi::FI_REMOTE_WRITE,
                requested,
                &mut self.mr,
            )
        };
        check("fi_mr_reg (region)", rc)?;
        self.bind_mr(self.mr, mr_mode)?;
        let key = if mr_mode & ffi::FI_MR_PROV_KEY != 0 {
            // SAFETY: MR open (and enabled under FI_MR_ENDPOINT).
            unsafe { ffi::uep_mr_key(self.mr) }
        } else {
            requested
        };
        if key == ffi::FI_KEY_NOTAVAIL {
            return Err(TransportError::Unsupported {
                op: "open",
                provider: pinfo.provider.clone(),
                why: "memory key is not available as 64 bits (raw keys are not supported)".into(),
            });
        }
        // SAFETY: MR open; the descriptor stays valid until the MR closes.
        Ok((key, unsafe { ffi::uep_mr_desc(self.mr) }))
    }

    /// Registers the slot table, where native atomics' operands live (FI_MR_LOCAL):
    /// its local descriptor.
    fn register_operands(
        &mut self,
        slots: &Slots,
        mr_mode: i32,
    ) -> Result<*mut c_void, TransportError> {
        let bytes = std::mem::size_of_val(&*slots.mem);
        // SAFETY: the slot table is a boxed slice that never moves or shrinks and
        // drops after the transport's `Fids` (field order), so it outlives the MR;
        // the provider only reads operands from it.
        let rc = unsafe {
            ffi::uep_mr_reg(
                self.domain,
                slots.mem.as_ptr() as *mut c_void,
                bytes,
                ffi::FI_WRITE,
                NEXT_KEY.fetch_add(1, Ordering::Relaxed),
                &mut self.op_mr,
            )
        };
        check("fi_mr_reg (atomic operands)", rc)?;
        self.bind_mr(self.op_mr, mr_mode)?;
        // SAFETY: op MR open.
        Ok(unsafe { ffi::uep_mr_desc(self.op_mr) })
    }

    /// The endpoint's address as the provider names it (at most 256 bytes).
    fn endpoint_name(&self) -> Result<Vec<u8>, TransportError> {
        let mut name = vec![0u8; 256];
        let mut nlen = name.len();
        // SAFETY: ep enabled; buffer of `nlen` writable bytes; nlen updated.
        let rc = unsafe { ffi::uep_getname(self.ep, name.as_mut_ptr().cast(), &mut nlen) };
        check("fi_getname", rc)?;
        if nlen > name.len() {
            return Err(TransportError::Invalid(format!(
                "endpoint name of {nlen} bytes exceeds the {} bytes uep supports",
                name.len()
            )));
        }
        name.truncate(nlen);
        Ok(name)
    }
}

/// Keys we request when the provider does not choose them (no FI_MR_PROV_KEY).
/// Process-wide so several transports in one process never collide.
static NEXT_KEY: AtomicU64 = AtomicU64::new(0x7565_7000);

/// A libfabric RDM endpoint over the rank's symmetric region.
///
/// Writes are `fi_writedata` with the 32-bit immediate as remote CQ data; the
/// target sees them in its receive CQ ([`Transport::poll_recv`]). Treated as
/// unordered and without atomics unless the provider proves otherwise (see
/// [`Caps`]). Providers with manual progress move data only while the owner
/// polls, so poll both queues regularly, on both sides. With `ofi_rxm`
/// connections are set up lazily: the first posts to a peer answer
/// [`TransportError::WouldBlock`] until the handshake completes, which needs
/// both sides to poll.
pub struct LibfabricTransport {
    // Field order matters: `fids` drops (closing the endpoint) before the
    // context slots and the region it may still reference are released.
    fids: Fids,
    slots: Slots,
    /// Zero-length receives currently posted, and how many we want posted
    /// (non-zero only under FI_RX_CQ_DATA).
    rx_posted: usize,
    rx_target: usize,
    region: RegionRef,
    desc: *mut c_void,
    op_desc: *mut c_void,
    key: u64,
    virt_addr: bool,
    name: Vec<u8>,
    peers: Option<Vec<Option<Peer>>>,
    caps: Caps,
    cq_buf: Vec<ffi::FiCqDataEntry>,
    info: ProviderInfo,
}

// SAFETY: `desc`/`op_desc` are opaque provider handles for MRs owned by
// `fids` (see the Send impl of `Fids`); the slot table is only touched via
// `&mut self`. Nothing here is tied to the creating thread.
unsafe impl Send for LibfabricTransport {}

impl std::fmt::Debug for LibfabricTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LibfabricTransport")
            .field("caps", &self.caps)
            .field("domain", &self.info.domain)
            .field("region", &self.region)
            .field("mr_mode", &self.info.mr_mode)
            .finish_non_exhaustive()
    }
}

const CQ_BATCH: usize = 64;

impl LibfabricTransport {
    /// Rank `r`'s address `a` inserted into the address vector (`None` for an empty
    /// address: this rank's own, or none).
    fn insert_peer(&self, r: usize, a: &PeerAddr) -> Result<Option<Peer>, TransportError> {
        if a.0.is_empty() {
            return Ok(None);
        }
        let d = decode_addr(r, a)?;
        if d.provider != self.caps.provider {
            return Err(TransportError::BadPeerAddr {
                peer: r,
                reason: format!(
                    "it uses provider {:?}, this endpoint uses {:?}; all ranks must use the same",
                    d.provider, self.caps.provider
                ),
            });
        }
        let mut fi_addr = ffi::FI_ADDR_NOTAVAIL;
        // SAFETY: AV open; `d.name` is a provider endpoint name of the same
        // provider (checked above) and the shim inserts exactly one.
        let n = unsafe { ffi::uep_av_insert(self.fids.av, d.name.as_ptr().cast(), &mut fi_addr) };
        if n != 1 {
            return Err(if n < 0 {
                fab_err("fi_av_insert", n.into())
            } else {
                TransportError::BadPeerAddr {
                    peer: r,
                    reason: "fi_av_insert rejected the endpoint name".into(),
                }
            });
        }
        Ok(Some(Peer {
            fi_addr,
            base: d.base,
            len: d.len,
            key: d.key,
        }))
    }

    /// Opens an endpoint on `opts.provider`, registers `region` for local
    /// reads and remote writes, and prepares the completion queues.
    ///
    /// Safe because [`RegionRef`]'s constructor carries the memory contract
    /// (the region outlives this transport and may be written by peers).
    pub fn new(opts: &FabricOptions, region: RegionRef) -> Result<Self, TransportError> {
        if region.is_empty() {
            return Err(TransportError::Invalid(
                "region is empty; register at least one byte".into(),
            ));
        }
        let chosen = choose_provider(opts)?;
        let view = chosen.view;
        let tx_size = usize::try_from(view.tx_size)
            .unwrap_or(0)
            .clamp(16, 1 << 16);
        let rx_size = usize::try_from(view.rx_size)
            .unwrap_or(0)
            .clamp(16, 1 << 16);
        // Receive-side posted buffers exist only for FI_RX_CQ_DATA providers.
        let rx_posts = if view.mode & ffi::FI_RX_CQ_DATA != 0 {
            rx_size.min(1024)
        } else {
            0
        };
        let mut fids = Fids::open(chosen.list, chosen.info, &view, tx_size, rx_size)?;
        let (key, desc) = fids.register_region(&region, chosen.mr_mode, &chosen.pinfo)?;
        let slots = Slots::new(tx_size + rx_posts);
        // Native atomics need FI_ATOMIC, proven ordering (writes before the
        // atomic must land first) and a u64 SUM the domain actually supports.
        let mut native_atomics =
            opts.atomics && view.caps & ffi::FI_ATOMIC != 0 && proves_atomic_order(&view);
        // SAFETY: domain open; the shim's attr struct is local to the call.
        if native_atomics && unsafe { ffi::uep_query_atomic_add_u64(fids.domain) } != 0 {
            native_atomics = false;
        }
        let op_desc = match native_atomics && chosen.mr_mode & ffi::FI_MR_LOCAL != 0 {
            true => fids.register_operands(&slots, chosen.mr_mode)?,
            false => ptr::null_mut(),
        };
        let name = fids.endpoint_name()?;
        let pinfo = chosen.pinfo;
        let caps = Caps {
            ordered: proves_order(&view),
            native_atomics,
            max_write_bytes: usize::try_from(view.max_msg_size).unwrap_or(usize::MAX),
            provider: pinfo.provider.clone(),
        };
        tracing::debug!(
            provider = %caps.provider,
            domain = %pinfo.domain,
            mr_mode = ?pinfo.mr_mode,
            mode = ?pinfo.mode,
            ordered = caps.ordered,
            native_atomics,
            "libfabric transport opened"
        );
        let mut t = Self {
            fids,
            slots,
            rx_posted: 0,
            rx_target: rx_posts,
            region,
            desc,
            op_desc,
            key,
            virt_addr: chosen.mr_mode & ffi::FI_MR_VIRT_ADDR != 0,
            name,
            peers: None,
            caps,
            cq_buf: vec![ffi::FiCqDataEntry::default(); CQ_BATCH],
            info: pinfo,
        };
        t.top_up_rx()?;
        Ok(t)
    }

    /// The provider/domain this endpoint was opened on (mr_mode, mode bits...).
    pub fn provider_info(&self) -> &ProviderInfo {
        &self.info
    }

    /// Re-posts consumed zero-length receives (FI_RX_CQ_DATA providers
    /// consume one per remote CQ data arrival). A full receive queue is not an
    /// error: the rest are posted on a later poll.
    fn top_up_rx(&mut self) -> Result<(), TransportError> {
        while self.rx_posted < self.rx_target {
            match self.post_rx_buffer() {
                Ok(()) => {}
                Err(TransportError::WouldBlock) => break,
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Posts one zero-length receive to absorb remote CQ data.
    fn post_rx_buffer(&mut self) -> Result<(), TransportError> {
        let Some(i) = self.slots.alloc(SlotKind::Recv, 0, 0) else {
            return Err(TransportError::WouldBlock);
        };
        // SAFETY: ep enabled; zero-length receive needs no buffer; the slot's
        // memory stays valid and untouched by us until its completion.
        let rc = unsafe {
            ffi::uep_recv(
                self.fids.ep,
                ptr::null_mut(),
                0,
                ptr::null_mut(),
                self.slots.ptr(i).cast(),
            )
        };
        if rc != 0 {
            self.slots.release(i);
            return Err(if rc == -(ffi::FI_EAGAIN as isize) {
                TransportError::WouldBlock
            } else {
                fab_err("fi_recv", rc as i64)
            });
        }
        self.rx_posted += 1;
        Ok(())
    }

    fn peer(&self, peer: usize) -> Result<&Peer, TransportError> {
        let peers = self.peers.as_ref().ok_or_else(|| TransportError::BadPeer {
            peer,
            reason: "connect() has not been called yet".into(),
        })?;
        match peers.get(peer) {
            Some(Some(p)) => Ok(p),
            Some(None) => Err(TransportError::BadPeer {
                peer,
                reason: "its address was empty at connect()".into(),
            }),
            None => Err(TransportError::BadPeer {
                peer,
                reason: format!("only {} peers are connected", peers.len()),
            }),
        }
    }

    fn post_op(
        &mut self,
        kind: SlotKind,
        ctx: u64,
        peer: usize,
        f: impl FnOnce(&Self, *mut CtxSlot) -> isize,
    ) -> Result<(), TransportError> {
        let i = self
            .slots
            .alloc(kind, ctx, peer)
            .ok_or(TransportError::WouldBlock)?;
        let rc = f(self, self.slots.ptr(i));
        if rc == 0 {
            return Ok(());
        }
        self.slots.release(i);
        if rc == -(ffi::FI_EAGAIN as isize) {
            Err(TransportError::WouldBlock)
        } else {
            Err(fab_err(
                match kind {
                    SlotKind::Atomic => "fi_atomic",
                    _ => "fi_writedata",
                },
                rc as i64,
            ))
        }
    }

    fn read_err(
        &mut self,
        cq: *mut ffi::FidCq,
        queue: &'static str,
    ) -> Result<Option<TransportError>, TransportError> {
        let mut e = ffi::UepCqErr::default();
        let mut msg = [0 as c_char; 256];
        // SAFETY: CQ open; `e` and `msg` are writable for their sizes.
        let rc = unsafe { ffi::uep_cq_readerr(cq, &mut e, msg.as_mut_ptr(), msg.len()) };
        if rc < 0 {
            return Err(fab_err("fi_cq_readerr", rc as i64));
        }
        let (mut ctx, mut peer) = (None, None);
        if let Some(i) = self.slots.index_of(e.op_context) {
            match self.slots.kind[i as usize] {
                SlotKind::Write | SlotKind::Atomic => {
                    ctx = Some(self.slots.user[i as usize]);
                    peer = Some(self.slots.peer[i as usize] as usize);
                }
                SlotKind::Recv => self.rx_posted -= 1,
                // Given up on already: its error is no news.
                SlotKind::Abandoned => {
                    self.slots.release(i);
                    return Ok(None);
                }
                SlotKind::Free => {}
            }
            self.slots.release(i);
        }
        Ok(Some(TransportError::Completion {
            queue,
            ctx,
            peer,
            err: e.err,
            prov_errno: e.prov_errno,
            msg: cstr(msg.as_ptr()),
        }))
    }

    /// Reads up to one batch from `cq`; `Ok(0)` when empty.
    fn read_cq(
        &mut self,
        cq: *mut ffi::FidCq,
        queue: &'static str,
    ) -> Result<usize, TransportError> {
        // SAFETY: CQ open; `cq_buf` holds CQ_BATCH entries of the
        // FI_CQ_FORMAT_DATA layout the CQ was opened with.
        let rc = unsafe { ffi::uep_cq_read(cq, self.cq_buf.as_mut_ptr(), self.cq_buf.len()) };
        if rc >= 0 {
            return Ok(rc as usize);
        }
        if rc == -(ffi::FI_EAGAIN as isize) {
            return Ok(0);
        }
        if rc == -(ffi::FI_EAVAIL as isize) {
            return match self.read_err(cq, queue)? {
                Some(e) => Err(e),
                None => Ok(0),
            };
        }
        Err(fab_err("fi_cq_read", rc as i64))
    }
}

fn check(call: &'static str, rc: i32) -> Result<(), TransportError> {
    if rc == 0 {
        Ok(())
    } else {
        Err(fab_err(call, rc.into()))
    }
}

impl Transport for LibfabricTransport {
    fn caps(&self) -> &Caps {
        &self.caps
    }

    fn local_addr(&self) -> PeerAddr {
        let base = if self.virt_addr {
            self.region.addr() as u64
        } else {
            0
        };
        encode_addr(
            &self.caps.provider,
            &self.name,
            base,
            self.region.len() as u64,
            self.key,
        )
    }

    fn connect(&mut self, peers: &[PeerAddr]) -> Result<(), TransportError> {
        if self.peers.is_some() {
            return Err(TransportError::Invalid(
                "connect() was already called on this transport; it takes the full peer list once"
                    .into(),
            ));
        }
        let out = (peers.iter().enumerate())
            .map(|(r, a)| self.insert_peer(r, a))
            .collect::<Result<Vec<_>, _>>()?;
        self.peers = Some(out);
        Ok(())
    }

    fn replace_peer(&mut self, peer: usize, addr: &PeerAddr) -> Result<(), TransportError> {
        let known = self.peers.as_ref().map_or(0, Vec::len);
        if peer >= known || addr.0.is_empty() {
            return Err(TransportError::Invalid(format!(
                "replace_peer({peer}) needs a connected transport ({known} peers) and an address"
            )));
        }
        // The old address stays in the address vector, unused: its process is gone.
        let fresh = self.insert_peer(peer, addr)?;
        if let Some(peers) = self.peers.as_mut() {
            peers[peer] = fresh;
        }
        Ok(())
    }

    fn validate_write(
        &self,
        peer: usize,
        local_off: u64,
        remote_off: u64,
        len: usize,
    ) -> Result<(), TransportError> {
        let p = self.peer(peer)?;
        if len > self.caps.max_write_bytes {
            return Err(TransportError::TooLarge {
                len,
                max: self.caps.max_write_bytes,
            });
        }
        let l = len as u64;
        check_range(
            Side::Local,
            peer,
            local_off,
            remote_off,
            l,
            self.region.len() as u64,
        )?;
        check_range(Side::Remote, peer, local_off, remote_off, l, p.len)?;
        if p.base.checked_add(remote_off + l).is_none() {
            return Err(TransportError::BadPeerAddr {
                peer,
                reason: format!("region base {:#x} + offset overflows", p.base),
            });
        }
        Ok(())
    }

    fn post_write(&mut self, op: WriteOp) -> Result<(), TransportError> {
        let WriteOp {
            peer,
            local_off,
            remote_off,
            len,
            imm,
            ctx,
        } = op;
        self.validate_write(peer, local_off, remote_off, len)?;
        let p = self.peer(peer)?.clone();
        // In range (validated), so this is inside the registered region.
        let buf = (self.region.addr() + local_off as usize) as *const c_void;
        self.post_op(SlotKind::Write, ctx, peer, |t, slot| {
            // SAFETY: `buf..buf+len` lies in the registered region (checked);
            // `desc` belongs to its MR; the remote range was bounds-checked
            // against the peer's advertised region; `slot` stays valid and
            // reserved until this operation's completion is read.
            unsafe {
                ffi::uep_writedata(
                    t.fids.ep,
                    buf,
                    len,
                    t.desc,
                    u64::from(imm),
                    p.fi_addr,
                    p.base + remote_off,
                    p.key,
                    slot.cast(),
                )
            }
        })
    }

    fn post_imm(&mut self, peer: usize, imm: u32, ctx: u64) -> Result<(), TransportError> {
        self.validate_write(peer, 0, 0, 0)?;
        let p = self.peer(peer)?.clone();
        let buf = self.region.addr() as *const c_void;
        self.post_op(SlotKind::Write, ctx, peer, |t, slot| {
            // SAFETY: zero-length write: no bytes are read or written; the
            // addresses are the (valid) bases of both regions so providers that
            // look at them see registered memory. Slot as in post_write.
            unsafe {
                ffi::uep_writedata(
                    t.fids.ep,
                    buf,
                    0,
                    t.desc,
                    u64::from(imm),
                    p.fi_addr,
                    p.base,
                    p.key,
                    slot.cast(),
                )
            }
        })
    }

    fn post_atomic_add(
        &mut self,
        peer: usize,
        remote_off: u64,
        value: u64,
        ctx: u64,
    ) -> Result<(), TransportError> {
        if !self.caps.native_atomics {
            return Err(TransportError::Unsupported {
                op: "post_atomic_add",
                provider: self.caps.provider.clone(),
                why: "the provider does not prove ordered native atomics (caps.native_atomics \
                      is false); emulate the add with an immediate"
                    .into(),
            });
        }
        let p = self.peer(peer)?.clone();
        check_range(Side::Remote, peer, 0, remote_off, 8, p.len)?;
        if remote_off % 8 != 0 {
            return Err(TransportError::Misaligned {
                peer,
                remote_off,
                align: 8,
            });
        }
        self.post_op(SlotKind::Atomic, ctx, peer, |t, slot| {
            // Operand lives in the slot so it stays valid until completion.
            let operand = slot
                .cast::<u8>()
                .wrapping_add(std::mem::offset_of!(CtxSlot, operand))
                .cast::<u64>();
            // SAFETY: `slot` points into our slot table, reserved for this op
            // and not referenced elsewhere; `operand` is its aligned u64 field.
            unsafe { operand.write(value) };
            // SAFETY: remote range checked and aligned; `op_desc` is the MR of
            // the slot table (or NULL when FI_MR_LOCAL is off); slot reserved
            // until completion.
            unsafe {
                ffi::uep_atomic_add_u64(
                    t.fids.ep,
                    operand,
                    t.op_desc,
                    p.fi_addr,
                    p.base + remote_off,
                    p.key,
                    slot.cast(),
                )
            }
        })
    }

    fn poll_send(&mut self, out: &mut Vec<Completion>) -> Result<usize, TransportError> {
        let mut total = 0;
        loop {
            let n = self.read_cq(self.fids.tx_cq, "send")?;
            for k in 0..n {
                let e = self.cq_buf[k];
                let Some(i) = self.slots.index_of(e.op_context) else {
                    return Err(TransportError::Invalid(format!(
                        "send completion with unknown context {:p} (flags {:#x})",
                        e.op_context, e.flags
                    )));
                };
                let ctx = self.slots.user[i as usize];
                let c = match self.slots.kind[i as usize] {
                    SlotKind::Write => Completion::Write { ctx },
                    SlotKind::Atomic => Completion::Atomic { ctx },
                    SlotKind::Abandoned => {
                        self.slots.release(i);
                        continue;
                    }
                    k => {
                        return Err(TransportError::Invalid(format!(
                            "send completion for a slot in state {k:?}"
                        )))
                    }
                };
                self.slots.release(i);
                out.push(c);
                total += 1;
            }
            if n < CQ_BATCH {
                return Ok(total);
            }
        }
    }

    fn poll_recv(&mut self, out: &mut Vec<Arrival>) -> Result<usize, TransportError> {
        let mut total = 0;
        loop {
            let n = self.read_cq(self.fids.rx_cq, "recv")?;
            for k in 0..n {
                let e = self.cq_buf[k];
                if let Some(i) = self.slots.index_of(e.op_context) {
                    if self.slots.kind[i as usize] == SlotKind::Recv {
                        self.slots.release(i);
                        self.rx_posted -= 1;
                    }
                }
                if e.flags & ffi::FI_REMOTE_CQ_DATA != 0 {
                    // The imm travels in the low 32 bits of the 64-bit CQ data.
                    out.push(Arrival { imm: e.data as u32 });
                    total += 1;
                }
            }
            self.top_up_rx()?;
            if n < CQ_BATCH {
                return Ok(total);
            }
        }
    }

    fn abandon_peer(&mut self, peer: usize) -> Vec<u64> {
        let mut gone = Vec::new();
        for i in 0..self.slots.kind.len() {
            let live = matches!(self.slots.kind[i], SlotKind::Write | SlotKind::Atomic);
            if live && self.slots.peer[i] as usize == peer {
                // The provider still owns the slot's memory: it is released when its
                // completion (or error) arrives.
                self.slots.kind[i] = SlotKind::Abandoned;
                gone.push(self.slots.user[i]);
            }
        }
        gone
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn route_source_of_loopback_is_loopback() {
        assert_eq!(
            route_source("127.0.0.1"),
            Some(std::net::Ipv4Addr::LOCALHOST.into())
        );
        assert_eq!(route_source("no-such-host.invalid"), None);
    }

    #[test]
    fn constants_match_headers() {
        let mut vals = vec![0u64; ffi::CONST_TABLE.len() + 8];
        // SAFETY: the shim writes at most `vals.len()` entries.
        let total = unsafe { ffi::uep_const_table(vals.as_mut_ptr(), vals.len()) };
        assert_eq!(total, ffi::CONST_TABLE.len(), "table length mismatch");
        for (i, (name, v)) in ffi::CONST_TABLE.iter().enumerate() {
            assert_eq!(
                vals[i], *v,
                "{name}: header says {:#x}, Rust says {v:#x}",
                vals[i]
            );
        }
    }

    #[test]
    fn addr_roundtrip_and_rejects_garbage() {
        let a = encode_addr("tcp;ofi_rxm", &[1, 2, 3], 0x1000, 4096, 77);
        let d = decode_addr(0, &a).unwrap();
        assert_eq!(
            (d.provider.as_str(), d.name.as_slice(), d.base, d.len, d.key),
            ("tcp;ofi_rxm", &[1u8, 2, 3][..], 0x1000, 4096, 77)
        );
        for cut in 0..a.0.len() {
            let e = decode_addr(5, &PeerAddr(a.0[..cut].to_vec())).err();
            assert!(e.is_some(), "truncated at {cut} accepted");
        }
        let mut long = a.0.clone();
        long.push(0);
        assert!(decode_addr(0, &PeerAddr(long)).is_err());
        let mut bad = a.0.clone();
        bad[0] = b'X';
        let msg = decode_addr(2, &PeerAddr(bad)).err().unwrap().to_string();
        assert!(msg.contains("peer 2") && msg.contains("magic"), "{msg}");
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(256))]

        #[test]
        fn addr_decode_never_panics(bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..96)) {
            let _ = decode_addr(0, &PeerAddr(bytes));
        }

        #[test]
        fn addr_roundtrips(
            name in proptest::collection::vec(proptest::num::u8::ANY, 0..64),
            base in proptest::num::u64::ANY,
            len in proptest::num::u64::ANY,
            key in proptest::num::u64::ANY,
        ) {
            let d = decode_addr(0, &encode_addr("p", &name, base, len, key)).unwrap();
            proptest::prop_assert_eq!((d.name, d.base, d.len, d.key), (name, base, len, key));
        }
    }

    #[test]
    fn slot_index_roundtrip() {
        let mut s = Slots::new(4);
        let a = s.alloc(SlotKind::Write, 11, 0).unwrap();
        let b = s.alloc(SlotKind::Write, 12, 0).unwrap();
        assert_ne!(a, b);
        assert_eq!(s.index_of(s.ptr(b).cast()), Some(b));
        assert_eq!(s.index_of(ptr::null_mut()), None);
        assert_eq!(
            s.index_of(s.ptr(b).cast::<u8>().wrapping_add(1).cast()),
            None
        );
        s.alloc(SlotKind::Write, 0, 0).unwrap();
        s.alloc(SlotKind::Write, 0, 0).unwrap();
        assert!(s.alloc(SlotKind::Write, 0, 0).is_none());
        s.release(a);
        s.release(a); // double release must not duplicate the free entry
        assert!(s.alloc(SlotKind::Write, 0, 0).is_some());
        assert!(s.alloc(SlotKind::Write, 0, 0).is_none());
    }

    #[test]
    fn order_rule() {
        let mut v = UepInfoView {
            tx_msg_order: ffi::FI_ORDER_RMA_WAW,
            rx_msg_order: ffi::FI_ORDER_RMA_WAW,
            ..Default::default()
        };
        assert!(
            !proves_order(&v),
            "comp_order NONE must not count as ordered"
        );
        v.rx_comp_order = ffi::FI_ORDER_STRICT;
        assert!(proves_order(&v));
        assert!(
            !proves_atomic_order(&v),
            "RMA_WAW alone does not order atomics"
        );
        v.tx_msg_order |= ffi::FI_ORDER_WAW;
        v.rx_msg_order |= ffi::FI_ORDER_WAW;
        assert!(proves_atomic_order(&v));
        v.tx_msg_order = 0;
        assert!(!proves_order(&v));
        assert_eq!(
            normalize_mr_mode(1) & ffi::FI_MR_PROV_KEY,
            ffi::FI_MR_PROV_KEY
        );
        assert_eq!(normalize_mr_mode(2), 0);
    }
}
