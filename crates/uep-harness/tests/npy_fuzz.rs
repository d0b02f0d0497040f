//! Fuzz-style property tests for the `.npy` parser: arbitrary bytes, byte-level
//! mutations of valid files and token-level mutations of valid headers must
//! never panic, and whatever parses must be self-consistent and re-serialise
//! to a file that parses to the same array.

use proptest::prelude::*;
use proptest::sample::Index;
use uep_harness::npy::{NpyArray, NpyData};

/// A small valid array of any supported dtype.
fn array() -> impl Strategy<Value = NpyArray> {
    prop::collection::vec(0usize..4, 0..4).prop_flat_map(|shape| {
        let n = shape.iter().product::<usize>();
        let data = prop_oneof![
            prop::collection::vec(any::<bool>(), n).prop_map(NpyData::Bool),
            prop::collection::vec(any::<u8>(), n).prop_map(NpyData::U8),
            prop::collection::vec(any::<u16>(), n).prop_map(NpyData::U16),
            prop::collection::vec(any::<i32>(), n).prop_map(NpyData::I32),
            prop::collection::vec(any::<i64>(), n).prop_map(NpyData::I64),
            prop::collection::vec(any::<u32>().prop_map(f32::from_bits), n).prop_map(NpyData::F32),
        ];
        (Just(shape), data).prop_map(|(shape, data)| NpyArray::new(shape, data).unwrap())
    })
}

#[derive(Clone, Debug)]
enum ByteMutation {
    Set(Index, u8),
    FlipBit(Index, u8),
    Truncate(Index),
    Insert(Index, Vec<u8>),
    Remove(Index, usize),
}

fn byte_mutation() -> impl Strategy<Value = ByteMutation> {
    prop_oneof![
        (any::<Index>(), any::<u8>()).prop_map(|(i, b)| ByteMutation::Set(i, b)),
        (any::<Index>(), 0u8..8).prop_map(|(i, b)| ByteMutation::FlipBit(i, b)),
        any::<Index>().prop_map(ByteMutation::Truncate),
        (any::<Index>(), prop::collection::vec(any::<u8>(), 1..8))
            .prop_map(|(i, v)| ByteMutation::Insert(i, v)),
        (any::<Index>(), 1usize..8).prop_map(|(i, n)| ByteMutation::Remove(i, n)),
    ]
}

fn apply(bytes: &mut Vec<u8>, m: &ByteMutation) {
    if bytes.is_empty() {
        return;
    }
    match m {
        ByteMutation::Set(i, b) => {
            let i = i.index(bytes.len());
            bytes[i] = *b;
        }
        ByteMutation::FlipBit(i, bit) => {
            let i = i.index(bytes.len());
            bytes[i] ^= 1 << bit;
        }
        ByteMutation::Truncate(i) => bytes.truncate(i.index(bytes.len())),
        ByteMutation::Insert(i, v) => {
            let i = i.index(bytes.len() + 1);
            bytes.splice(i..i, v.iter().copied());
        }
        ByteMutation::Remove(i, n) => {
            let i = i.index(bytes.len());
            let end = (i + n).min(bytes.len());
            bytes.drain(i..end);
        }
    }
}

/// Fragments of header syntax, spliced into valid headers to reach deep into
/// the literal parser instead of stopping at the first byte.
const TOKENS: &[&str] = &[
    "(",
    ")",
    ",",
    "'",
    "\"",
    "{",
    "}",
    "[",
    "]",
    ":",
    " ",
    "\n",
    "\\",
    "True",
    "False",
    "None",
    "L",
    "-1",
    "0",
    "7",
    "99999999999999999999",
    "18446744073709551615",
    "1152921504606846976",
    "'<i8'",
    "'>f4'",
    "'|b1'",
    "'<u1'",
    "'<f8'",
    "'descr'",
    "'shape'",
    "'fortran_order'",
    "(1, 2)",
    "()",
    "(0,)",
    "(3)",
    "[3]",
    "[1, 2]",
    "((1,),)",
    "{'a': 1}",
    "\u{e9}",
];

/// Checks the invariants of a successful parse.
fn check_parsed(input: &[u8], a: &NpyArray) -> Result<(), TestCaseError> {
    let count = if a.shape.contains(&0) {
        0
    } else {
        a.shape.iter().product()
    };
    prop_assert_eq!(a.len(), count);
    prop_assert!(a.shape.len() <= uep_harness::npy::MAX_DIMS);
    prop_assert!(
        a.len() <= input.len(),
        "{} elements from {} bytes",
        a.len(),
        input.len()
    );
    let bytes = a.to_bytes();
    let again = NpyArray::parse(&bytes).map_err(|e| TestCaseError::fail(e.to_string()))?;
    prop_assert_eq!(again.to_bytes(), bytes);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1000, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..300)) {
        if let Ok(a) = NpyArray::parse(&bytes) {
            check_parsed(&bytes, &a)?;
        }
    }

    #[test]
    fn arbitrary_bytes_after_magic_never_panic(
        version in prop::sample::select(vec![[1u8, 0], [2, 0], [3, 0]]),
        tail in prop::collection::vec(any::<u8>(), 0..300),
    ) {
        let bytes = [&b"\x93NUMPY"[..], &version, &tail].concat();
        if let Ok(a) = NpyArray::parse(&bytes) {
            check_parsed(&bytes, &a)?;
        }
    }

    #[test]
    fn mutated_files_never_panic(
        a in array(),
        mutations in prop::collection::vec(byte_mutation(), 1..4),
    ) {
        let mut bytes = a.to_bytes();
        for m in &mutations {
            apply(&mut bytes, m);
        }
        if let Ok(parsed) = NpyArray::parse(&bytes) {
            check_parsed(&bytes, &parsed)?;
        }
    }

    #[test]
    fn mutated_headers_never_panic(
        a in array(),
        splices in prop::collection::vec((any::<Index>(), 0usize..3, prop::sample::select(TOKENS)), 1..4),
        version in prop::sample::select(vec![1u8, 2, 3]),
    ) {
        let bytes = a.to_bytes();
        // Split the file numpy-style: 10-byte prefix, header text, data.
        let header_len = usize::from(u16::from_le_bytes([bytes[8], bytes[9]]));
        let mut text = String::from_utf8(bytes[10..10 + header_len].to_vec()).unwrap();
        for (at, remove, token) in &splices {
            let mut i = at.index(text.len() + 1);
            while !text.is_char_boundary(i) {
                i -= 1;
            }
            let mut end = (i + remove).min(text.len());
            while !text.is_char_boundary(end) {
                end += 1;
            }
            text.replace_range(i..end, token);
        }
        let mut file = b"\x93NUMPY".to_vec();
        file.extend_from_slice(&[version, 0]);
        if version == 1 {
            file.extend_from_slice(&(text.len() as u16).to_le_bytes());
        } else {
            file.extend_from_slice(&(text.len() as u32).to_le_bytes());
        }
        file.extend_from_slice(text.as_bytes());
        file.extend_from_slice(&bytes[10 + header_len..]);
        if let Ok(parsed) = NpyArray::parse(&file) {
            check_parsed(&file, &parsed)?;
        }
    }
}
