//! Pinned host memory mapped into the device: where the proxies' FIFOs live, so a
//! kernel's stores reach a CPU thread without GPUDirect.

use std::ptr::NonNull;
use std::sync::Arc;

use cudarc::driver::{result, sys, CudaContext};
use uep_fifo::{Fifo, FifoAlloc, FifoError, FifoMemory};

use crate::gpu::driver;
use crate::{CudaError, Gpu};

/// Page-locked host memory that the device reads and writes through its own address.
#[derive(Debug)]
pub struct Pinned {
    host: NonNull<u8>,
    device: u64,
    len: usize,
    ctx: Arc<CudaContext>,
}

// SAFETY: the allocation is plain host memory owned by this value; the raw pointer is
// only an address, and every access through it is the caller's (atomics for FIFOs).
#[allow(unsafe_code)]
unsafe impl Send for Pinned {}
// SAFETY: as above: `&Pinned` hands out only addresses.
#[allow(unsafe_code)]
unsafe impl Sync for Pinned {}

impl Pinned {
    /// `len` zeroed bytes (at least one page), mapped into `gpu`'s address space.
    pub fn new(gpu: &Gpu, len: usize) -> Result<Pinned, CudaError> {
        let ctx = gpu.context().clone();
        ctx.bind_to_thread()
            .map_err(driver("binding the context"))?;
        let flags = sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE;
        let len = len.max(4096);
        // SAFETY: a fresh allocation of `len` bytes; zeroed below before any use.
        #[allow(unsafe_code)]
        let raw =
            unsafe { result::malloc_host(len, flags) }.map_err(driver("pinning host memory"))?;
        let host = NonNull::new(raw.cast::<u8>()).ok_or(CudaError::Driver {
            what: "pinning host memory",
            detail: "the driver returned a null pointer".into(),
        })?;
        // SAFETY: `host` is `len` writable bytes just allocated and not yet shared.
        #[allow(unsafe_code)]
        unsafe {
            host.as_ptr().write_bytes(0, len)
        };
        let mut pinned = Pinned {
            host,
            device: 0,
            len,
            ctx,
        };
        pinned.device = device_addr(host.as_ptr() as usize)?;
        Ok(pinned)
    }

    /// Sets every byte to `byte` (poison before a check). Call it only while no kernel
    /// writes this memory.
    pub fn fill(&self, byte: u8) {
        // SAFETY: `len` bytes at `host` are ours while `self` lives; no kernel runs on
        // them now (the caller's promise), and bytes have no invalid values.
        #[allow(unsafe_code)]
        unsafe {
            self.host.as_ptr().write_bytes(byte, self.len)
        };
    }

    /// A copy of the first `n` bytes (at most `len`). Call it only once the kernels
    /// that wrote them have finished.
    pub fn read(&self, n: usize) -> Vec<u8> {
        // SAFETY: as for `fill`; the bytes are initialised (zeroed at allocation).
        #[allow(unsafe_code)]
        let bytes = unsafe { std::slice::from_raw_parts(self.host.as_ptr(), n.min(self.len)) };
        bytes.to_vec()
    }

    /// The first byte, in this process.
    pub fn host_ptr(&self) -> *mut u8 {
        self.host.as_ptr()
    }

    /// The first byte, as the device addresses it.
    pub fn device_addr(&self) -> u64 {
        self.device
    }
}

/// The device's address of a byte of pinned, mapped host memory (an error if the
/// address is not in such memory).
pub(crate) fn device_addr(host: usize) -> Result<u64, CudaError> {
    let mut dev: sys::CUdeviceptr = 0;
    // SAFETY: the driver only reads `host` as an address and writes `dev`.
    #[allow(unsafe_code)]
    let rc = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut dev, host as *mut _, 0) };
    rc.result().map_err(driver(
        "mapping host memory into the device (is it pinned by uep-cuda?)",
    ))?;
    Ok(dev)
}

impl Drop for Pinned {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: `host` came from `malloc_host` and is freed once, here.
        #[allow(unsafe_code)]
        let _ = unsafe { result::free_host(self.host.as_ptr().cast()) };
    }
}

// SAFETY: `Pinned` keeps `len` bytes at `host` alive until dropped; the allocation is
// page-aligned (so REGION_ALIGN-aligned) and a FIFO made over it is its only user.
#[allow(unsafe_code)]
unsafe impl FifoMemory for Pinned {
    fn base(&self) -> *mut u8 {
        self.host.as_ptr()
    }

    fn len(&self) -> usize {
        self.len
    }
}

/// The CUDA device's FIFOs: each in pinned host memory mapped into the device, so a
/// kernel pushes into it and a proxy thread drains it.
#[derive(Clone, Debug)]
pub struct CudaFifos {
    gpu: Gpu,
}

impl CudaFifos {
    /// FIFOs for `gpu`'s kernels.
    pub fn new(gpu: &Gpu) -> Self {
        CudaFifos { gpu: gpu.clone() }
    }
}

impl FifoAlloc for CudaFifos {
    fn alloc_fifo(&self, capacity: usize) -> Result<Fifo, FifoError> {
        let bytes = uep_fifo::region_bytes(capacity);
        let mem = Pinned::new(&self.gpu, bytes).map_err(|_| FifoError::AllocFailed { bytes })?;
        Fifo::in_memory(Arc::new(mem), capacity)
    }
}
