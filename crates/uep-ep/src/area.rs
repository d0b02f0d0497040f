//! Typed areas of the symmetric region.
//!
//! Every rank's region has the same layout, so an offset names the same field in every
//! rank's memory. An [`Area<T>`] is such an offset together with its element type and
//! length: `len` values of `T` starting at byte `offset`. Rows, sub-ranges and packet
//! sections are derived from areas with checked arithmetic ([`Area::slice`],
//! [`Area::row`]), and memory is read and written through [`Mem`], which takes areas,
//! not byte offsets. No code outside this module scales an index by a size by hand.

use std::marker::PhantomData;
use std::ops::Range;
use std::sync::atomic::AtomicU64;

use bytemuck::Pod;
use uep_shm::Region;

use crate::error::{EpError, Result};

/// `len` values of `T` at byte `offset` of a region.
pub struct Area<T> {
    offset: usize,
    len: usize,
    _t: PhantomData<fn() -> T>,
}

impl<T> Clone for Area<T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for Area<T> {}

impl<T> PartialEq for Area<T> {
    fn eq(&self, other: &Self) -> bool {
        self.offset == other.offset && self.len == other.len
    }
}

impl<T> Eq for Area<T> {}

impl<T> std::fmt::Debug for Area<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let ty = std::any::type_name::<T>();
        let ty = ty.rsplit("::").next().unwrap_or(ty);
        write!(f, "Area<{ty}>[{}; {}]@{}", self.len, ty, self.offset)
    }
}

impl<T> Default for Area<T> {
    fn default() -> Self {
        Area::new(0, 0)
    }
}

impl<T> Area<T> {
    const SIZE: usize = std::mem::size_of::<T>();

    /// `len` values at byte `offset`.
    pub const fn new(offset: usize, len: usize) -> Self {
        Area {
            offset,
            len,
            _t: PhantomData,
        }
    }

    /// Byte offset of the first value.
    pub fn offset(self) -> usize {
        self.offset
    }

    /// Number of values.
    pub fn len(self) -> usize {
        self.len
    }

    /// Whether it holds no values.
    pub fn is_empty(self) -> bool {
        self.len == 0
    }

    /// Size in bytes.
    pub fn bytes(self) -> usize {
        self.len * Self::SIZE
    }

    /// Byte offset just past the last value.
    pub fn end(self) -> usize {
        self.offset + self.bytes()
    }

    /// Values `range` of this area.
    pub fn slice(self, range: Range<usize>) -> Result<Area<T>> {
        if range.start > range.end || range.end > self.len {
            return Err(EpError::internal(format!(
                "values {range:?} of {self:?}: outside the area"
            )));
        }
        Ok(Area::new(
            self.offset + range.start * Self::SIZE,
            range.end - range.start,
        ))
    }

    /// Row `i` of this area seen as rows of `cols` values.
    pub fn row(self, i: usize, cols: usize) -> Result<Area<T>> {
        self.rows(i..i + 1, cols)
    }

    /// Rows `rows` of this area seen as rows of `cols` values (one contiguous area).
    pub fn rows(self, rows: Range<usize>, cols: usize) -> Result<Area<T>> {
        let (Some(start), Some(end)) = (rows.start.checked_mul(cols), rows.end.checked_mul(cols))
        else {
            return Err(EpError::internal(format!(
                "rows {rows:?} of {cols} values of {self:?} overflow"
            )));
        };
        self.slice(start..end)
    }

    /// The first `len` values.
    pub fn prefix(self, len: usize) -> Result<Area<T>> {
        self.slice(0..len)
    }

    /// The byte range the area covers.
    #[cfg(test)]
    pub fn byte_range(self) -> Range<usize> {
        self.offset..self.end()
    }

    /// The same bytes as values of `U` (whole values only).
    pub fn cast<U>(self) -> Area<U> {
        Area::new(self.offset, self.bytes() / std::mem::size_of::<U>().max(1))
    }

    /// This area moved by `base` bytes: packet sections are laid out from 0 and placed
    /// at the packet's offset.
    pub fn at_base(self, base: usize) -> Area<T> {
        Area::new(base + self.offset, self.len)
    }
}

/// Alignment of every area a [`Layout`] hands out: a cache line, so counters of
/// different writers never share one and rows start where wide loads like them.
pub const ALIGN: usize = 128;

/// Hands out consecutive, aligned areas: how a region (or a packet) is laid out.
#[derive(Debug, Default)]
pub struct Layout {
    at: usize,
    align: usize,
}

impl Layout {
    /// A layout starting at 0 whose areas are aligned to `align` bytes.
    pub fn new(align: usize) -> Layout {
        Layout { at: 0, align }
    }

    /// The next area of `len` values of `T`.
    pub fn take<T>(&mut self, len: usize) -> Area<T> {
        let area = Area::new(self.at, len);
        self.at = (area.end()).div_ceil(self.align) * self.align;
        area
    }

    /// Skip to the next multiple of `align` bytes (a page, for areas that are mapped
    /// again on their own).
    pub fn align_to(&mut self, align: usize) {
        self.at = self.at.div_ceil(align) * align;
    }

    /// Bytes laid out so far.
    pub fn len(&self) -> usize {
        self.at
    }
}

/// Typed access to a region: every read and write names an [`Area`].
pub trait Mem {
    /// Copy `src` into the first `src.len()` values of `area`.
    fn put<T: Pod>(&self, area: Area<T>, src: &[T]) -> Result<()>;
    /// [`Mem::put`] with streaming stores (`uep_shm::copy_streaming`): for rows that
    /// are read much later than the cache would keep them (see [`STREAM_ABOVE`]).
    fn put_streaming<T: Pod>(&self, area: Area<T>, src: &[T]) -> Result<()>;
    /// Copy the first `dst.len()` values of `area` out.
    fn get<T: Pod>(&self, area: Area<T>, dst: &mut [T]) -> Result<()>;
    /// The whole of `area`, copied out.
    fn get_vec<T: Pod>(&self, area: Area<T>) -> Result<Vec<T>>;
    /// Copy `src` of region `from` into `dst` of this region (same length; memmove).
    fn copy<T: Pod>(&self, dst: Area<T>, from: &Region, src: Area<T>) -> Result<()>;
    /// The 64-bit word `i` of `area`, for atomic access.
    fn word(&self, area: Area<u64>, i: usize) -> Result<&AtomicU64>;
}

/// A call writes its rows into the node's ranks with streaming stores when it writes
/// more than this many bytes there: beyond a fraction of a server's last-level cache the
/// rows reach memory before anyone reads them anyway, and a plain store would first
/// read each destination line in. Below it, the rows stay in the cache for the expert
/// that reads them next. The gain above it is measured in docs/performance.md; the
/// value itself is a judgement (half of the CI machine's 32 MiB L3), not a measurement.
pub(crate) const STREAM_ABOVE: usize = 16 << 20;

fn too_long<T>(area: Area<T>, n: usize) -> EpError {
    EpError::internal(format!("{n} values do not fit {area:?}"))
}

impl Mem for Region {
    fn put<T: Pod>(&self, area: Area<T>, src: &[T]) -> Result<()> {
        if src.len() > area.len() {
            return Err(too_long(area, src.len()));
        }
        Ok(self.write(area.offset(), bytemuck::cast_slice(src))?)
    }

    fn put_streaming<T: Pod>(&self, area: Area<T>, src: &[T]) -> Result<()> {
        if src.len() > area.len() {
            return Err(too_long(area, src.len()));
        }
        Ok(self.write_streaming(area.offset(), bytemuck::cast_slice(src))?)
    }

    fn get<T: Pod>(&self, area: Area<T>, dst: &mut [T]) -> Result<()> {
        if dst.len() > area.len() {
            return Err(too_long(area, dst.len()));
        }
        Ok(self.read(area.offset(), bytemuck::cast_slice_mut(dst))?)
    }

    fn get_vec<T: Pod>(&self, area: Area<T>) -> Result<Vec<T>> {
        let mut v = vec![T::zeroed(); area.len()];
        self.get(area, &mut v)?;
        Ok(v)
    }

    fn copy<T: Pod>(&self, dst: Area<T>, from: &Region, src: Area<T>) -> Result<()> {
        if dst.len() != src.len() {
            return Err(EpError::internal(format!(
                "copy of {src:?} into {dst:?}: lengths differ"
            )));
        }
        Ok(self.copy_from(dst.offset(), from, src.offset(), src.bytes())?)
    }

    fn word(&self, area: Area<u64>, i: usize) -> Result<&AtomicU64> {
        Ok(self.atomic_u64(area.slice(i..i + 1)?.offset())?)
    }
}

/// Rows of a host slice: row `i` of `cols` values, the one place host code scales a row
/// index (as [`Area::row`] is for the registered region). Out of range panics, as
/// slicing does.
pub(crate) trait SliceRows<T> {
    /// Row `i` of rows of `cols` values.
    fn row(&self, i: usize, cols: usize) -> &[T];
    /// Row `i` of rows of `cols` values, mutably.
    fn row_mut(&mut self, i: usize, cols: usize) -> &mut [T];
}

impl<T> SliceRows<T> for [T] {
    fn row(&self, i: usize, cols: usize) -> &[T] {
        &self[i * cols..(i + 1) * cols]
    }

    fn row_mut(&mut self, i: usize, cols: usize) -> &mut [T] {
        &mut self[i * cols..(i + 1) * cols]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn rows_and_slices_are_checked() {
        let a: Area<u32> = Area::new(256, 12);
        assert_eq!(a.bytes(), 48);
        assert_eq!(a.row(2, 4).unwrap(), Area::new(256 + 32, 4));
        assert_eq!(a.rows(1..3, 4).unwrap(), Area::new(256 + 16, 8));
        assert!(a.row(3, 4).is_err());
        assert!(a.slice(5..13).is_err());
        assert!(a.rows(usize::MAX / 2..usize::MAX / 2 + 1, 4).is_err());
        assert_eq!(a.cast::<u8>(), Area::new(256, 48));
        assert_eq!(a.cast::<u64>(), Area::new(256, 6));
        assert_eq!(a.at_base(1000).offset(), 1256);
    }

    #[test]
    fn mem_reads_and_writes_by_area() {
        let r = Region::anonymous(4096).unwrap();
        let a: Area<i64> = Area::new(128, 4);
        r.put(a, &[1, -2, 3]).unwrap();
        assert_eq!(r.get_vec(a).unwrap(), vec![1, -2, 3, 0]);
        assert!(r.put(a, &[0; 5]).is_err());
        let b: Area<i64> = Area::new(1024, 4);
        r.copy(b, &r.clone(), a).unwrap();
        assert_eq!(r.get_vec(b).unwrap(), vec![1, -2, 3, 0]);
        let w: Area<u64> = Area::new(2048, 2);
        r.word(w, 1)
            .unwrap()
            .store(9, std::sync::atomic::Ordering::Relaxed);
        assert_eq!(r.get_vec(w).unwrap(), vec![0, 9]);
        assert!(r.word(w, 2).is_err());
    }

    proptest! {
        /// Areas a layout hands out are aligned, in order and disjoint.
        #[test]
        fn layouts_hand_out_disjoint_aligned_areas(lens in proptest::collection::vec(0usize..10_000, 1..40)) {
            let mut l = Layout::new(ALIGN);
            let areas: Vec<Area<u32>> = lens.iter().map(|&n| l.take(n)).collect();
            for (i, a) in areas.iter().enumerate() {
                prop_assert_eq!(a.offset() % ALIGN, 0);
                prop_assert!(a.end() <= l.len());
                if let Some(b) = areas.get(i + 1) {
                    prop_assert!(a.end() <= b.offset());
                }
            }
        }
    }
}
