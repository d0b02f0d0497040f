//! Raw declarations for the C shim in `csrc/shim.c` (which wraps libfabric).
//!
//! Only declarations and constants live here; every call site is in
//! [`crate::fabric`], each behind a `// SAFETY:` comment. Constant values are
//! the libfabric ABI (stable across 1.x); a unit test checks them against the
//! headers the shim was compiled with.

use std::ffi::{c_char, c_int, c_void};
use std::marker::{PhantomData, PhantomPinned};

macro_rules! opaque {
    ($($name:ident),*) => {$(
        /// Opaque libfabric object, only ever handled by pointer.
        #[repr(C)]
        pub struct $name {
            _data: [u8; 0],
            _marker: PhantomData<(*mut u8, PhantomPinned)>,
        }
    )*};
}
opaque!(FiInfo, FidFabric, FidDomain, FidEp, FidCq, FidAv, FidMr);

// Capability / operation flags (fabric.h).
pub const FI_MSG: u64 = 1 << 1;
pub const FI_RMA: u64 = 1 << 2;
pub const FI_ATOMIC: u64 = 1 << 4;
pub const FI_READ: u64 = 1 << 8;
pub const FI_WRITE: u64 = 1 << 9;
pub const FI_RECV: u64 = 1 << 10;
pub const FI_SEND: u64 = 1 << 11;
pub const FI_REMOTE_READ: u64 = 1 << 12;
pub const FI_REMOTE_WRITE: u64 = 1 << 13;
pub const FI_SOURCE: u64 = 1 << 57;
pub const FI_REMOTE_CQ_DATA: u64 = 1 << 17;
pub const FI_TRANSMIT: u64 = FI_SEND;
// Mode bits.
pub const FI_CONTEXT: u64 = 1 << 59;
pub const FI_CONTEXT2: u64 = 1 << 52;
pub const FI_RX_CQ_DATA: u64 = 1 << 56;
// mr_mode bits (an int in the C API).
pub const FI_MR_LOCAL: i32 = 1 << 2;
pub const FI_MR_RAW: i32 = 1 << 3;
pub const FI_MR_VIRT_ADDR: i32 = 1 << 4;
pub const FI_MR_ALLOCATED: i32 = 1 << 5;
pub const FI_MR_PROV_KEY: i32 = 1 << 6;
pub const FI_MR_MMU_NOTIFY: i32 = 1 << 7;
pub const FI_MR_RMA_EVENT: i32 = 1 << 8;
pub const FI_MR_ENDPOINT: i32 = 1 << 9;
pub const FI_MR_HMEM: i32 = 1 << 10;
// Ordering bits.
pub const FI_ORDER_STRICT: u64 = 0x1FF;
pub const FI_ORDER_DATA: u64 = 1 << 16;
pub const FI_ORDER_WAW: u64 = 1 << 4;
pub const FI_ORDER_RMA_WAW: u64 = 1 << 35;
// Enums.
pub const FI_EP_MSG: i32 = 1;
pub const FI_EP_DGRAM: i32 = 2;
pub const FI_EP_RDM: i32 = 3;
pub const FI_AV_MAP: i32 = 1;
pub const FI_AV_TABLE: i32 = 2;
pub const FI_THREAD_DOMAIN: i32 = 3;
// Errors (returned negated).
pub const FI_EAGAIN: i32 = 11;
pub const FI_EAVAIL: i32 = 259;
pub const FI_ENODATA: i32 = 61;
pub const FI_KEY_NOTAVAIL: u64 = u64::MAX;
pub const FI_ADDR_NOTAVAIL: u64 = u64::MAX;

/// Names of the constants, in the order `uep_const_table` writes them.
#[cfg(test)]
pub const CONST_TABLE: &[(&str, u64)] = &[
    ("FI_MSG", FI_MSG),
    ("FI_RMA", FI_RMA),
    ("FI_ATOMIC", FI_ATOMIC),
    ("FI_READ", FI_READ),
    ("FI_WRITE", FI_WRITE),
    ("FI_RECV", FI_RECV),
    ("FI_SEND", FI_SEND),
    ("FI_REMOTE_READ", FI_REMOTE_READ),
    ("FI_REMOTE_WRITE", FI_REMOTE_WRITE),
    ("FI_SOURCE", FI_SOURCE),
    ("FI_REMOTE_CQ_DATA", FI_REMOTE_CQ_DATA),
    ("FI_TRANSMIT", FI_TRANSMIT),
    ("FI_CONTEXT", FI_CONTEXT),
    ("FI_CONTEXT2", FI_CONTEXT2),
    ("FI_RX_CQ_DATA", FI_RX_CQ_DATA),
    ("FI_MR_LOCAL", FI_MR_LOCAL as u64),
    ("FI_MR_RAW", FI_MR_RAW as u64),
    ("FI_MR_VIRT_ADDR", FI_MR_VIRT_ADDR as u64),
    ("FI_MR_ALLOCATED", FI_MR_ALLOCATED as u64),
    ("FI_MR_PROV_KEY", FI_MR_PROV_KEY as u64),
    ("FI_MR_MMU_NOTIFY", FI_MR_MMU_NOTIFY as u64),
    ("FI_MR_RMA_EVENT", FI_MR_RMA_EVENT as u64),
    ("FI_MR_ENDPOINT", FI_MR_ENDPOINT as u64),
    ("FI_MR_HMEM", FI_MR_HMEM as u64),
    ("FI_ORDER_STRICT", FI_ORDER_STRICT),
    ("FI_ORDER_DATA", FI_ORDER_DATA),
    ("FI_ORDER_WAW", FI_ORDER_WAW),
    ("FI_ORDER_RMA_WAW", FI_ORDER_RMA_WAW),
    ("FI_EP_MSG", FI_EP_MSG as u64),
    ("FI_EP_DGRAM", FI_EP_DGRAM as u64),
    ("FI_EP_RDM", FI_EP_RDM as u64),
    ("FI_AV_MAP", FI_AV_MAP as u64),
    ("FI_AV_TABLE", FI_AV_TABLE as u64),
    ("FI_THREAD_DOMAIN", FI_THREAD_DOMAIN as u64),
    ("FI_EAGAIN", FI_EAGAIN as u64),
    ("FI_EAVAIL", FI_EAVAIL as u64),
    ("FI_ENODATA", FI_ENODATA as u64),
    ("FI_KEY_NOTAVAIL", FI_KEY_NOTAVAIL),
    ("FI_ADDR_NOTAVAIL", FI_ADDR_NOTAVAIL),
    (
        "sizeof(fi_cq_data_entry)",
        std::mem::size_of::<FiCqDataEntry>() as u64,
    ),
    ("sizeof(fi_context2)", CONTEXT_BYTES as u64),
];

/// Bytes of provider scratch space per operation context (`struct fi_context2`).
pub const CONTEXT_BYTES: usize = 64;

/// `struct fi_cq_data_entry` (FI_CQ_FORMAT_DATA).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct FiCqDataEntry {
    pub op_context: *mut c_void,
    pub flags: u64,
    pub len: usize,
    pub buf: *mut c_void,
    pub data: u64,
}

impl Default for FiCqDataEntry {
    fn default() -> Self {
        Self {
            op_context: std::ptr::null_mut(),
            flags: 0,
            len: 0,
            buf: std::ptr::null_mut(),
            data: 0,
        }
    }
}

/// `struct uep_info_view` from the shim: a flat copy of the fi_info fields uep reads.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct UepInfoView {
    pub prov_name: *const c_char,
    pub fabric_name: *const c_char,
    pub domain_name: *const c_char,
    pub caps: u64,
    pub mode: u64,
    pub tx_caps: u64,
    pub rx_caps: u64,
    pub tx_msg_order: u64,
    pub rx_msg_order: u64,
    pub tx_comp_order: u64,
    pub rx_comp_order: u64,
    pub max_msg_size: u64,
    pub tx_size: u64,
    pub rx_size: u64,
    pub cq_data_size: u64,
    pub mr_key_size: u64,
    pub inject_size: u64,
    pub ep_type: i32,
    pub mr_mode: i32,
    pub av_type: i32,
    pub threading: i32,
    pub addr_format: u32,
    pub _pad: u32,
}

impl Default for UepInfoView {
    fn default() -> Self {
        Self {
            prov_name: std::ptr::null(),
            fabric_name: std::ptr::null(),
            domain_name: std::ptr::null(),
            caps: 0,
            mode: 0,
            tx_caps: 0,
            rx_caps: 0,
            tx_msg_order: 0,
            rx_msg_order: 0,
            tx_comp_order: 0,
            rx_comp_order: 0,
            max_msg_size: 0,
            tx_size: 0,
            rx_size: 0,
            cq_data_size: 0,
            mr_key_size: 0,
            inject_size: 0,
            ep_type: 0,
            mr_mode: 0,
            av_type: 0,
            threading: 0,
            addr_format: 0,
            _pad: 0,
        }
    }
}

/// `struct uep_cq_err` from the shim: the parts of `fi_cq_err_entry` uep reports.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct UepCqErr {
    pub op_context: *mut c_void,
    pub flags: u64,
    pub data: u64,
    pub err: i32,
    pub prov_errno: i32,
}

impl Default for UepCqErr {
    fn default() -> Self {
        Self {
            op_context: std::ptr::null_mut(),
            flags: 0,
            data: 0,
            err: 0,
            prov_errno: 0,
        }
    }
}

extern "C" {
    pub fn uep_fi_allocinfo() -> *mut FiInfo;
    pub fn uep_fi_freeinfo(info: *mut FiInfo);
    #[allow(clippy::too_many_arguments)]
    pub fn uep_fi_hints_set(
        hints: *mut FiInfo,
        caps: u64,
        mode: u64,
        mr_mode: c_int,
        ep_type: c_int,
        threading: c_int,
        prov_name: *const c_char,
        domain_name: *const c_char,
    ) -> c_int;
    pub fn uep_fi_getinfo(
        node: *const c_char,
        flags: u64,
        hints: *const FiInfo,
        out: *mut *mut FiInfo,
    ) -> c_int;
    pub fn uep_fi_next(info: *const FiInfo) -> *mut FiInfo;
    pub fn uep_fi_view(info: *const FiInfo, view: *mut UepInfoView);

    pub fn uep_fabric_open(info: *const FiInfo, fabric: *mut *mut FidFabric) -> c_int;
    pub fn uep_domain_open(
        fabric: *mut FidFabric,
        info: *mut FiInfo,
        domain: *mut *mut FidDomain,
    ) -> c_int;
    pub fn uep_cq_open(domain: *mut FidDomain, size: usize, cq: *mut *mut FidCq) -> c_int;
    pub fn uep_av_open(
        domain: *mut FidDomain,
        av_type: c_int,
        count: usize,
        av: *mut *mut FidAv,
    ) -> c_int;
    pub fn uep_ep_open(domain: *mut FidDomain, info: *mut FiInfo, ep: *mut *mut FidEp) -> c_int;
    pub fn uep_ep_bind_cq(ep: *mut FidEp, cq: *mut FidCq, flags: u64) -> c_int;
    pub fn uep_ep_bind_av(ep: *mut FidEp, av: *mut FidAv) -> c_int;
    pub fn uep_ep_enable(ep: *mut FidEp) -> c_int;
    pub fn uep_mr_reg(
        domain: *mut FidDomain,
        buf: *mut c_void,
        len: usize,
        access: u64,
        requested_key: u64,
        mr: *mut *mut FidMr,
    ) -> c_int;
    pub fn uep_mr_key(mr: *mut FidMr) -> u64;
    pub fn uep_mr_desc(mr: *mut FidMr) -> *mut c_void;
    pub fn uep_mr_bind_ep(mr: *mut FidMr, ep: *mut FidEp) -> c_int;
    pub fn uep_mr_enable(mr: *mut FidMr) -> c_int;
    pub fn uep_getname(ep: *mut FidEp, buf: *mut c_void, len: *mut usize) -> c_int;
    pub fn uep_av_insert(av: *mut FidAv, addr: *const c_void, fi_addr: *mut u64) -> c_int;
    pub fn uep_close(obj: *mut c_void) -> c_int;

    #[allow(clippy::too_many_arguments)]
    pub fn uep_writedata(
        ep: *mut FidEp,
        buf: *const c_void,
        len: usize,
        desc: *mut c_void,
        data: u64,
        dest: u64,
        addr: u64,
        key: u64,
        ctx: *mut c_void,
    ) -> isize;
    pub fn uep_recv(
        ep: *mut FidEp,
        buf: *mut c_void,
        len: usize,
        desc: *mut c_void,
        ctx: *mut c_void,
    ) -> isize;
    pub fn uep_atomic_add_u64(
        ep: *mut FidEp,
        operand: *const u64,
        desc: *mut c_void,
        dest: u64,
        addr: u64,
        key: u64,
        ctx: *mut c_void,
    ) -> isize;
    pub fn uep_query_atomic_add_u64(domain: *mut FidDomain) -> c_int;
    pub fn uep_cq_read(cq: *mut FidCq, buf: *mut FiCqDataEntry, count: usize) -> isize;
    pub fn uep_cq_readerr(
        cq: *mut FidCq,
        out: *mut UepCqErr,
        msg: *mut c_char,
        msglen: usize,
    ) -> isize;
    pub fn uep_strerror(err: c_int) -> *const c_char;
    #[cfg(test)]
    pub fn uep_const_table(out: *mut u64, n: usize) -> usize;
}
