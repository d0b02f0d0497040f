//! Copies with non-temporal (streaming) stores, for large outputs that nobody reads
//! soon: the bytes go to memory without first reading the destination's cache lines
//! in (a plain store's read-for-ownership), which is a third of a copy's memory
//! traffic. Normal dispatch and combine use it for large calls' rows into the node's
//! other ranks, which those ranks read only after the whole call.

/// Below this many bytes a plain copy is as fast (and the fence costs more).
const MIN_STREAM: usize = 1024;

/// `dst.copy_from_slice(src)` with streaming stores where the machine has them (x86-64),
/// then a store fence, so that the bytes are ordered before any later store (a release
/// publication included). Panics if the lengths differ, as `copy_from_slice` does.
pub fn copy_streaming(dst: &mut [u8], src: &[u8]) {
    assert_eq!(dst.len(), src.len(), "copy_streaming: lengths differ");
    // SAFETY: `dst` is an exclusive slice and `src` a shared one of the same length, so
    // both ranges are valid and cannot overlap.
    unsafe { copy_streaming_raw(dst.as_mut_ptr(), src.as_ptr(), src.len()) }
}

/// [`copy_streaming`] on raw pointers.
///
/// # Safety
/// `src` must be valid for `len` bytes of reads and `dst` for `len` bytes of writes,
/// and the two ranges must not overlap.
pub(crate) unsafe fn copy_streaming_raw(dst: *mut u8, src: *const u8, len: usize) {
    #[cfg(target_arch = "x86_64")]
    if len >= MIN_STREAM {
        use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};
        // Plain copy up to the first 16-byte boundary of the destination.
        let head = dst.align_offset(16).min(len);
        // SAFETY: the caller's ranges, which do not overlap; head <= len.
        unsafe { std::ptr::copy_nonoverlapping(src, dst, head) };
        let body = (len - head) / 16;
        for i in 0..body {
            let at = head + 16 * i;
            // SAFETY: at + 16 <= len; `dst + at` is 16-byte aligned (after the head);
            // the load is unaligned. SSE2 is part of x86-64.
            unsafe {
                let v = _mm_loadu_si128(src.add(at) as *const __m128i);
                _mm_stream_si128(dst.add(at) as *mut __m128i, v);
            }
        }
        let done = head + 16 * body;
        // SAFETY: the remaining bytes of the caller's ranges.
        unsafe { std::ptr::copy_nonoverlapping(src.add(done), dst.add(done), len - done) };
        // Streaming stores are weakly ordered: fence them before whatever publishes them.
        // SAFETY: SSE is part of x86-64.
        unsafe { _mm_sfence() };
        return;
    }
    // SAFETY: the caller's ranges, which do not overlap.
    unsafe { std::ptr::copy_nonoverlapping(src, dst, len) };
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Any length at any alignment of either side copies exactly and touches
        /// nothing outside the destination.
        #[test]
        fn copies_exactly(len in 0usize..5000, src_off in 0usize..32, dst_off in 0usize..32) {
            let src: Vec<u8> = (0..len + src_off).map(|i| (i * 7 + 3) as u8).collect();
            let mut dst = vec![0xAAu8; len + dst_off + 32];
            copy_streaming(&mut dst[dst_off..dst_off + len], &src[src_off..src_off + len]);
            prop_assert_eq!(&dst[dst_off..dst_off + len], &src[src_off..]);
            prop_assert!(dst[..dst_off].iter().chain(&dst[dst_off + len..]).all(|&b| b == 0xAA));
        }
    }
}
