//! Tensors in and out through DLPack, without copies.
//!
//! In: the Python layer passes `tensor.detach().__dlpack__()`, a capsule holding a
//! `DLManagedTensor`. [`In`] borrows it for one call (the capsule, and with it the
//! tensor, stays alive as long as the `In`), checks device, dtype, shape and
//! contiguity, and gives a slice of the data.
//!
//! Out: [`export`] wraps memory that Rust owns (a `Vec`, or a lease on a bank of
//! received rows) in a `DLManagedTensor` whose deleter drops the owner, in a capsule
//! named `dltensor` that `torch.from_dlpack` takes over.
//!
//! This is the binding's one module with `unsafe`: reading the C structs of the DLPack
//! ABI and handing memory across it.
#![allow(unsafe_code)]

use std::ffi::{c_void, CStr};
use std::ptr::NonNull;
use std::sync::Arc;

use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::PyCapsule;

/// `kDLCPU`.
const CPU: i32 = 1;
/// The name of a live DLPack capsule.
const DLTENSOR: &CStr = c"dltensor";

/// DLPack's `DLDevice`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct DlDevice {
    device_type: i32,
    device_id: i32,
}

/// DLPack's `DLDataType`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DType {
    code: u8,
    bits: u8,
    lanes: u16,
}

impl DType {
    /// `int8` .. `int64`.
    pub const fn int(bits: u8) -> DType {
        DType {
            code: 0,
            bits,
            lanes: 1,
        }
    }
    /// `uint8` .. `uint64`.
    pub const fn uint(bits: u8) -> DType {
        DType {
            code: 1,
            bits,
            lanes: 1,
        }
    }
    /// `float32`.
    pub const F32: DType = DType {
        code: 2,
        bits: 32,
        lanes: 1,
    };
    /// `bfloat16`.
    pub const BF16: DType = DType {
        code: 4,
        bits: 16,
        lanes: 1,
    };
    /// `bool` (one byte).
    pub const BOOL: DType = DType {
        code: 6,
        bits: 8,
        lanes: 1,
    };
    /// `int32`.
    pub const I32: DType = DType::int(32);
    /// `int64`.
    pub const I64: DType = DType::int(64);
    /// `uint8`.
    pub const U8: DType = DType::uint(8);

    fn name(self) -> String {
        let kind = match self.code {
            0 => "int",
            1 => "uint",
            2 => "float",
            4 => "bfloat",
            6 => "bool",
            _ => "type-code-",
        };
        format!("{kind}{}", self.bits)
    }
}

/// DLPack's `DLTensor`.
#[repr(C)]
struct DlTensor {
    data: *mut c_void,
    device: DlDevice,
    ndim: i32,
    dtype: DType,
    shape: *mut i64,
    strides: *mut i64,
    byte_offset: u64,
}

/// DLPack's `DLManagedTensor`.
#[repr(C)]
struct DlManagedTensor {
    dl_tensor: DlTensor,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DlManagedTensor)>,
}

/// The shape of the DLPack capsule `obj`, unchecked otherwise (to learn what a call was
/// meant to be even when its tensors are unusable); `None` if it is no live capsule.
pub fn peek_shape(obj: &Bound<'_, PyAny>) -> Option<Vec<usize>> {
    let capsule = obj.cast::<PyCapsule>().ok()?;
    let ptr = capsule.pointer_checked(Some(DLTENSOR)).ok()?;
    // SAFETY: as in `In::new`: a live "dltensor" capsule holds a `DLManagedTensor`, and
    // `capsule` keeps it alive while we read its shape.
    let t = unsafe { &ptr.cast::<DlManagedTensor>().as_ref().dl_tensor };
    let ndim = usize::try_from(t.ndim).ok()?;
    if ndim == 0 {
        return Some(Vec::new());
    }
    // SAFETY: `shape` has `ndim` entries (DLPack ABI).
    let shape = unsafe { std::slice::from_raw_parts(t.shape, ndim) };
    Some(
        shape
            .iter()
            .map(|&d| usize::try_from(d).unwrap_or(0))
            .collect(),
    )
}

/// A tensor borrowed from Python for one call.
pub struct In<'py> {
    /// Keeps the tensor alive (its destructor runs the producer's deleter).
    _capsule: Bound<'py, PyCapsule>,
    what: &'static str,
    data: *const u8,
    dtype: DType,
    shape: Vec<usize>,
    len: usize,
}

impl<'py> In<'py> {
    /// Borrow the DLPack capsule `obj` (named `what` in errors), which must be a CPU
    /// tensor of `dtype` laid out contiguously (C order).
    pub fn new(obj: &Bound<'py, PyAny>, what: &'static str, dtype: DType) -> PyResult<In<'py>> {
        let capsule = obj.cast::<PyCapsule>().map_err(|_| {
            PyTypeError::new_err(format!(
                "{what}: expected a DLPack capsule (tensor.__dlpack__())"
            ))
        })?;
        let ptr = capsule.pointer_checked(Some(DLTENSOR)).map_err(|_| {
            PyTypeError::new_err(format!(
                "{what}: the capsule is not a live DLPack tensor (was it used already?)"
            ))
        })?;
        // SAFETY: a capsule named "dltensor" holds a `DLManagedTensor` (the DLPack
        // ABI), valid while the capsule is alive, which `_capsule` ensures.
        let t = unsafe { &ptr.cast::<DlManagedTensor>().as_ref().dl_tensor };
        if t.device.device_type != CPU {
            return Err(PyTypeError::new_err(format!(
                "{what}: the tensor is on device type {}, uep takes CPU tensors",
                t.device.device_type
            )));
        }
        if t.dtype != dtype {
            return Err(PyTypeError::new_err(format!(
                "{what}: dtype {}, expected {}",
                t.dtype.name(),
                dtype.name()
            )));
        }
        let ndim = usize::try_from(t.ndim).unwrap_or(0);
        let shape: Vec<usize> = if ndim == 0 {
            Vec::new()
        } else {
            // SAFETY: `shape` has `ndim` entries (DLPack ABI), alive with the capsule.
            unsafe { std::slice::from_raw_parts(t.shape, ndim) }
                .iter()
                .map(|&d| usize::try_from(d).unwrap_or(0))
                .collect()
        };
        let len = shape.iter().product::<usize>();
        if !t.strides.is_null() && len > 1 {
            // SAFETY: as `shape`.
            let strides = unsafe { std::slice::from_raw_parts(t.strides, ndim) };
            let mut want = 1i64;
            for (&d, &s) in shape.iter().zip(strides).rev() {
                if d != 1 && s != want {
                    return Err(PyTypeError::new_err(format!(
                        "{what}: the tensor is not contiguous (shape {shape:?}, strides {strides:?}); pass .contiguous()"
                    )));
                }
                want *= d as i64;
            }
        }
        let size = usize::from(t.dtype.bits / 8);
        let data = (t.data as *const u8).wrapping_add(t.byte_offset as usize);
        if len > 0 && (data.is_null() || (data as usize) % size != 0) {
            return Err(PyTypeError::new_err(format!(
                "{what}: the tensor's data is not aligned to its element size"
            )));
        }
        Ok(In {
            _capsule: capsule.clone(),
            what,
            data,
            dtype,
            shape,
            len,
        })
    }

    /// Like [`In::new`], for an optional argument.
    pub fn opt(
        obj: Option<&Bound<'py, PyAny>>,
        what: &'static str,
        dtype: DType,
    ) -> PyResult<Option<In<'py>>> {
        obj.map(|o| In::new(o, what, dtype)).transpose()
    }

    /// The shape.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// Dimension `i`, or an error naming the argument if it has fewer.
    pub fn dim(&self, i: usize) -> PyResult<usize> {
        self.shape.get(i).copied().ok_or_else(|| {
            PyTypeError::new_err(format!(
                "{}: expected at least {} dimensions, got shape {:?}",
                self.what,
                i + 1,
                self.shape
            ))
        })
    }

    /// Check the number of dimensions.
    pub fn expect_ndim(&self, n: usize) -> PyResult<&Self> {
        if self.shape.len() != n {
            return Err(PyTypeError::new_err(format!(
                "{}: expected {n} dimensions, got shape {:?}",
                self.what, self.shape
            )));
        }
        Ok(self)
    }

    /// The elements, as `T` (whose size must be the dtype's).
    pub fn slice<T: bytemuck::Pod>(&self) -> &[T] {
        assert_eq!(
            std::mem::size_of::<T>(),
            usize::from(self.dtype.bits / 8),
            "{}: element type does not match the dtype",
            self.what
        );
        if self.len == 0 {
            return &[];
        }
        // SAFETY: the data is `len` contiguous, aligned elements of the checked dtype
        // (`new`), kept alive by the capsule for the lifetime of `self`; `T` is any-bits
        // plain data of the same size. The Python layer passes tensors it does not
        // write during the call (a concurrent writer would be a data race of the
        // caller's making, as with any C extension).
        unsafe { std::slice::from_raw_parts(self.data.cast::<T>(), self.len) }
    }

    /// The byte range the data covers (to check that an output does not overlap it).
    pub fn span(&self) -> std::ops::Range<usize> {
        let start = self.data as usize;
        start..start + self.len * usize::from(self.dtype.bits / 8)
    }

    /// The elements as `T`, writable: for outputs the caller allocated. `inputs` are the
    /// call's other tensors, which must not overlap this one.
    #[allow(clippy::mut_from_ref)]
    pub fn slice_mut<T: bytemuck::Pod>(&self, inputs: &[&In<'_>]) -> PyResult<&mut [T]> {
        let mine = self.span();
        if let Some(other) = inputs.iter().find(|i| {
            i.len > 0 && self.len > 0 && i.span().start < mine.end && mine.start < i.span().end
        }) {
            return Err(PyTypeError::new_err(format!(
                "{}: the output overlaps the input {}",
                self.what, other.what
            )));
        }
        assert_eq!(std::mem::size_of::<T>(), usize::from(self.dtype.bits / 8));
        if self.len == 0 {
            return Ok(&mut []);
        }
        // SAFETY: as `slice`; the caller allocated this tensor as the call's output and
        // it overlaps none of the call's inputs (checked), so no other reference to
        // these bytes exists during the call.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.data as *mut T, self.len) })
    }
}

/// What keeps exported memory alive until the consumer's deleter runs.
pub type Owner = Box<dyn std::any::Any + Send>;

struct Exported {
    managed: DlManagedTensor,
    shape: Vec<i64>,
    strides: Vec<i64>,
    _owner: Owner,
}

unsafe extern "C" fn delete_exported(managed: *mut DlManagedTensor) {
    if managed.is_null() {
        return;
    }
    // SAFETY: `manager_ctx` is the `Box<Exported>` made by `export`, freed only here,
    // once (the consumer calls the deleter once; the capsule destructor only if no
    // consumer took the tensor).
    unsafe { drop(Box::from_raw((*managed).manager_ctx.cast::<Exported>())) };
}

unsafe extern "C" fn capsule_destructor(capsule: *mut pyo3::ffi::PyObject) {
    // SAFETY: called by Python with the capsule being destroyed. A capsule still named
    // "dltensor" was never consumed: its tensor is ours to delete. A consumed one was
    // renamed "used_dltensor" and its consumer calls the deleter.
    unsafe {
        if pyo3::ffi::PyCapsule_IsValid(capsule, DLTENSOR.as_ptr()) == 1 {
            let managed = pyo3::ffi::PyCapsule_GetPointer(capsule, DLTENSOR.as_ptr());
            delete_exported(managed.cast());
        }
    }
}

/// Hand `len` elements of `dtype` at `data` to Python as a DLPack capsule of `shape`
/// (and `strides` in elements; C order when `None`). `owner` owns the memory and is
/// dropped when the consumer lets go.
///
/// # Safety
/// `data` must point to memory that `owner` keeps valid, readable and writable, and
/// large enough for `shape`/`strides` of `dtype`.
pub unsafe fn export<'py>(
    py: Python<'py>,
    data: *mut u8,
    shape: &[usize],
    strides: Option<&[usize]>,
    dtype: DType,
    owner: Owner,
) -> PyResult<Bound<'py, PyCapsule>> {
    let shape: Vec<i64> = shape.iter().map(|&d| d as i64).collect();
    let strides: Vec<i64> = match strides {
        Some(s) => s.iter().map(|&d| d as i64).collect(),
        None => {
            let mut acc = 1i64;
            let mut s: Vec<i64> = shape
                .iter()
                .rev()
                .map(|&d| {
                    let here = acc;
                    acc *= d.max(1);
                    here
                })
                .collect();
            s.reverse();
            s
        }
    };
    let mut boxed = Box::new(Exported {
        managed: DlManagedTensor {
            dl_tensor: DlTensor {
                data: data.cast(),
                device: DlDevice {
                    device_type: CPU,
                    device_id: 0,
                },
                ndim: shape.len() as i32,
                dtype,
                shape: std::ptr::null_mut(),
                strides: std::ptr::null_mut(),
                byte_offset: 0,
            },
            manager_ctx: std::ptr::null_mut(),
            deleter: Some(delete_exported),
        },
        shape,
        strides,
        _owner: owner,
    });
    // The vectors' buffers do not move with the box.
    boxed.managed.dl_tensor.shape = boxed.shape.as_mut_ptr();
    boxed.managed.dl_tensor.strides = boxed.strides.as_mut_ptr();
    let raw = Box::into_raw(boxed);
    // SAFETY: `raw` is a fresh, leaked box; its `managed` field is the first field's
    // address, which the deleter maps back to the box through `manager_ctx`.
    unsafe {
        (*raw).managed.manager_ctx = raw.cast();
        let managed = NonNull::new_unchecked(std::ptr::addr_of_mut!((*raw).managed)).cast();
        PyCapsule::new_with_pointer_and_destructor(py, managed, DLTENSOR, Some(capsule_destructor))
            .inspect_err(|_| delete_exported(managed.as_ptr().cast()))
    }
}

/// Hand an owned `Vec` to Python as a tensor of `shape`.
pub fn export_vec<'py, T: bytemuck::Pod + Send>(
    py: Python<'py>,
    mut v: Vec<T>,
    shape: &[usize],
    dtype: DType,
) -> PyResult<Bound<'py, PyCapsule>> {
    assert_eq!(shape.iter().product::<usize>(), v.len());
    assert_eq!(std::mem::size_of::<T>(), usize::from(dtype.bits / 8));
    let data = v.as_mut_ptr().cast::<u8>();
    // SAFETY: the Vec's buffer does not move when the Vec does; the owner keeps it,
    // and it holds exactly `shape` elements of `dtype`'s size.
    unsafe { export(py, data, shape, None, dtype, Box::new(v)) }
}

/// Hand output `part` of `lease` to Python as a tensor of `shape` (and `strides` in
/// elements; C order when `None`) of `dtype`; the tensor holds the lease's view.
pub fn export_lease<'py>(
    py: Python<'py>,
    lease: &uep_ep::Lease,
    part: usize,
    shape: &[usize],
    strides: Option<&[usize]>,
    dtype: DType,
) -> PyResult<Bound<'py, PyCapsule>> {
    let range = lease.parts.get(part).cloned().unwrap_or(0..0);
    let size = usize::from(dtype.bits / 8);
    // The furthest element the shape and strides reach must lie inside the part.
    let span = match strides {
        _ if shape.contains(&0) => 0,
        None => shape.iter().product::<usize>() * size,
        Some(st) => {
            (shape
                .iter()
                .zip(st)
                .map(|(&d, &s)| (d - 1) * s)
                .sum::<usize>()
                + 1)
                * size
        }
    };
    if span > range.len() || range.end > lease.view.len() {
        return Err(crate::errors::internal(format!(
            "a tensor of shape {shape:?} needs {span} bytes, its part of the lease has {}",
            range.len()
        )));
    }
    // SAFETY: the tensor's bytes lie inside `range`, inside the view (checked), and the
    // owner (a handle on the view) keeps the view mapped until the consumer lets go.
    unsafe {
        export(
            py,
            lease.view.as_ptr().add(range.start) as *mut u8,
            shape,
            strides,
            dtype,
            Box::new(lease.view.clone()),
        )
    }
}

/// Hand `buffer`'s next low-latency combine buffer (`[E/R, R*M, H]` bf16) to Python:
/// the expert outputs written there are sent by a zero-copy combine without a staging
/// copy. The tensor keeps the Buffer's memory mapped; as with DeepEP's
/// `get_next_low_latency_combine_buffer`, Python writes it only before the combine.
pub fn export_combine_buffer<'py>(
    py: Python<'py>,
    buffer: &mut uep_ep::Buffer,
) -> PyResult<Bound<'py, PyCapsule>> {
    let shape = buffer
        .config()
        .ll
        .map(|s| {
            let r = buffer.num_ranks();
            [s.experts_per_rank(r), r * s.max_tokens, s.hidden]
        })
        .ok_or_else(|| {
            crate::errors::raise(
                uep_ep::ErrorKind::InvalidArgument,
                "this Buffer has no low-latency buffers".into(),
            )
        })?;
    let keep = buffer.memory_keepalive();
    let rows = buffer
        .low_latency_combine_buffer()
        .map_err(crate::errors::ep_err)?;
    if rows.len() != shape.iter().product::<usize>() {
        return Err(crate::errors::internal(format!(
            "the combine buffer has {} values, not {shape:?}",
            rows.len()
        )));
    }
    // SAFETY: the rows lie in the Buffer's registered memory, which `keep` keeps mapped
    // for as long as the tensor lives, and hold exactly `shape` bf16 values.
    unsafe {
        export(
            py,
            rows.as_mut_ptr().cast(),
            &shape,
            None,
            DType::BF16,
            Box::new(keep),
        )
    }
}

/// Memory for outputs that Rust writes and Python keeps: reused once Python lets go.
///
/// A large output allocated afresh every call is faulted in afresh every call (the
/// allocator hands large blocks back to the kernel); a pool of a few blocks, each handed
/// to one tensor at a time, keeps the pages. A block is written only while nobody else
/// holds it (`Arc::get_mut`).
#[derive(Debug, Default)]
pub struct Pool {
    blocks: Vec<Arc<Block>>,
}

/// A 16-byte aligned block of memory (zeroed when allocated).
#[derive(Debug)]
pub struct Block {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the block owns its allocation; its bytes are only reached through `&mut Block`
// (unique) or by the tensor it was exported to.
unsafe impl Send for Block {}
// SAFETY: as above; `&Block` gives access to nothing but the address.
unsafe impl Sync for Block {}

impl Block {
    fn layout(len: usize) -> std::alloc::Layout {
        std::alloc::Layout::from_size_align(len.max(16), 16).expect("a block size fits a layout")
    }

    fn new(len: usize) -> Block {
        let layout = Block::layout(len);
        // SAFETY: a non-zero size (at least 16).
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(ptr).unwrap_or_else(|| std::alloc::handle_alloc_error(layout));
        Block { ptr, len }
    }

    /// The block's bytes as `T`s, writable: only for a block nobody else holds.
    pub fn as_mut_slice<T: bytemuck::Pod>(&mut self, count: usize) -> &mut [T] {
        assert!(count * std::mem::size_of::<T>() <= self.len && std::mem::align_of::<T>() <= 16);
        // SAFETY: `&mut self` is unique (nobody else, no tensor, holds the block), the
        // allocation is 16-byte aligned and large enough (checked), and any bytes are a
        // valid `T: Pod`.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr().cast::<T>(), count) }
    }
}

impl Drop for Block {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), Block::layout(self.len)) };
    }
}

/// Blocks a pool keeps for reuse.
const POOL_BLOCKS: usize = 4;

impl Pool {
    /// Run `fill` on a block of at least `len` bytes that nobody holds (one the pool kept,
    /// or a new one), and return the block for export with `fill`'s result.
    pub fn fill<R>(&mut self, len: usize, fill: impl FnOnce(&mut Block) -> R) -> (Arc<Block>, R) {
        let free = self
            .blocks
            .iter()
            .position(|b| Arc::strong_count(b) == 1 && b.len >= len);
        let i = match free {
            Some(i) => i,
            None => {
                // Keep the newest few: a dropped block goes back to the allocator.
                if self.blocks.len() >= POOL_BLOCKS {
                    match self.blocks.iter().position(|b| Arc::strong_count(b) == 1) {
                        Some(old) => drop(self.blocks.remove(old)),
                        None => {
                            let mut block = Arc::new(Block::new(len));
                            let r = fill(Arc::get_mut(&mut block).expect("a new block is unique"));
                            return (block, r);
                        }
                    }
                }
                self.blocks.push(Arc::new(Block::new(len)));
                self.blocks.len() - 1
            }
        };
        let block = &mut self.blocks[i];
        let r = fill(Arc::get_mut(block).expect("a free block is unique"));
        (block.clone(), r)
    }
}

/// Hand the first `shape` elements of `dtype` of `block` to Python; the tensor holds
/// the block until it is freed.
pub fn export_block<'py>(
    py: Python<'py>,
    block: Arc<Block>,
    shape: &[usize],
    dtype: DType,
) -> PyResult<Bound<'py, PyCapsule>> {
    let bytes = shape.iter().product::<usize>() * usize::from(dtype.bits / 8);
    assert!(bytes <= block.len, "a block too small for its tensor");
    let data = block.ptr.as_ptr();
    // SAFETY: the tensor's bytes lie inside the block (checked), which the owner keeps
    // allocated until the consumer lets go.
    unsafe { export(py, data, shape, None, dtype, Box::new(block)) }
}
