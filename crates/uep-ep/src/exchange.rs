//! Typed records over the control plane: every rank sends one value of a [`Record`]
//! type and gets every rank's, decoded and checked, instead of text that each caller
//! formats and splits on its own. A record that does not decode is a protocol error
//! naming the rank that sent it.
//!
//! The encoding is little-endian and length-prefixed: `u64`s as 8 bytes, `bool`s as one,
//! strings as a `u32` length and UTF-8, options and tuples field by field.
//!
//! ```
//! use uep_ep::exchange::Record;
//! let mut bytes = Vec::new();
//! (7u64, String::from("node-a")).put(&mut bytes);
//! let mut rest = bytes.as_slice();
//! assert_eq!(<(u64, String)>::take(&mut rest), Some((7, "node-a".to_string())));
//! assert!(rest.is_empty());
//! ```

use uep_bootstrap::ControlPlane;

use crate::error::Result;
use crate::protocol;

/// A value that travels over the control plane.
pub trait Record: Sized {
    /// Append this value's bytes to `out`.
    fn put(&self, out: &mut Vec<u8>);
    /// Take one value from the front of `bytes`, or `None` if they do not hold one.
    fn take(bytes: &mut &[u8]) -> Option<Self>;
}

/// Every rank's `mine`, in rank order; `what` names the exchange in errors.
pub fn all_gather<R: Record>(cp: &dyn ControlPlane, what: &str, mine: &R) -> Result<Vec<R>> {
    let mut out = Vec::new();
    mine.put(&mut out);
    let all = cp.all_gather(&out)?;
    (all.iter().enumerate())
        .map(|(rank, bytes)| {
            let mut rest = bytes.as_slice();
            match R::take(&mut rest) {
                Some(r) if rest.is_empty() => Ok(r),
                _ => Err(protocol!(
                    "rank {rank}'s {what} record of {} bytes does not decode",
                    bytes.len()
                )),
            }
        })
        .collect()
}

impl Record for u64 {
    fn put(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.to_le_bytes());
    }
    fn take(bytes: &mut &[u8]) -> Option<u64> {
        let (head, rest) = bytes.split_first_chunk::<8>()?;
        *bytes = rest;
        Some(u64::from_le_bytes(*head))
    }
}

impl Record for bool {
    fn put(&self, out: &mut Vec<u8>) {
        out.push(*self as u8);
    }
    fn take(bytes: &mut &[u8]) -> Option<bool> {
        let (&b, rest) = bytes.split_first()?;
        *bytes = rest;
        (b <= 1).then_some(b == 1)
    }
}

impl Record for String {
    fn put(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&(self.len() as u32).to_le_bytes());
        out.extend_from_slice(self.as_bytes());
    }
    fn take(bytes: &mut &[u8]) -> Option<String> {
        let (len, rest) = bytes.split_first_chunk::<4>()?;
        let len = u32::from_le_bytes(*len) as usize;
        let text = std::str::from_utf8(rest.get(..len)?).ok()?.to_owned();
        *bytes = &rest[len..];
        Some(text)
    }
}

impl<T: Record> Record for Option<T> {
    fn put(&self, out: &mut Vec<u8>) {
        self.is_some().put(out);
        if let Some(v) = self {
            v.put(out);
        }
    }
    fn take(bytes: &mut &[u8]) -> Option<Option<T>> {
        match bool::take(bytes)? {
            true => Some(Some(T::take(bytes)?)),
            false => Some(None),
        }
    }
}

impl<A: Record, B: Record> Record for (A, B) {
    fn put(&self, out: &mut Vec<u8>) {
        self.0.put(out);
        self.1.put(out);
    }
    fn take(bytes: &mut &[u8]) -> Option<(A, B)> {
        Some((A::take(bytes)?, B::take(bytes)?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn round_trip<R: Record + PartialEq + std::fmt::Debug>(r: R) {
        let mut out = Vec::new();
        r.put(&mut out);
        let mut rest = out.as_slice();
        assert_eq!(R::take(&mut rest), Some(r));
        assert!(rest.is_empty());
    }

    proptest! {
        #[test]
        fn records_round_trip(a: u64, s: String, o: Option<String>, b: bool) {
            round_trip(a);
            round_trip((a, s.clone()));
            round_trip(o);
            round_trip((b, Some((a, s))));
        }

        #[test]
        fn decoding_garbage_never_panics(bytes: Vec<u8>) {
            let mut rest = bytes.as_slice();
            let _ = <(u64, Option<String>)>::take(&mut rest);
        }
    }

    #[test]
    fn truncated_and_invalid_records_do_not_decode() {
        let mut out = Vec::new();
        (7u64, String::from("host")).put(&mut out);
        for cut in 0..out.len() {
            let mut rest = &out[..cut];
            assert_eq!(<(u64, String)>::take(&mut rest), None, "cut at {cut}");
        }
        assert_eq!(bool::take(&mut &[2u8][..]), None);
    }
}
