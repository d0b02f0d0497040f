//! NumPy `.npy` files, read and written with the `npyz` crate.
//!
//! Users prepare inputs for `uep bench --inputs` and check its outputs with numpy, so
//! this module reads what `np.save` writes and writes what `np.load` reads. It adds to
//! `npyz` only what uep needs on top:
//!
//! * a narrow set of dtypes, with errors that say what was found and what is allowed:
//!   `'|b1'` (bool), `'|u1'` (uint8), `'<u2'` (uint16, also raw bf16 bits), `'<i4'`,
//!   `'<i8'` and `'<f4'` (either byte order; one-byte types with any byte-order mark);
//! * C order (a Fortran-order file of at most one dimension is the same bytes);
//! * hostile input: [`NpyArray::parse`] never panics, and it allocates nothing larger
//!   than its input before checking that the input really holds that much data (a
//!   header claiming shape `(2**60,)` is an error, not an out-of-memory abort). It is
//!   the target of fuzz tests.

use std::io;
use std::path::{Path, PathBuf};

use npyz::{DType, NpyFile, NpyHeader, Order, TypeChar, WriterBuilder};

/// Most dimensions accepted (numpy's `NPY_MAXDIMS`).
pub const MAX_DIMS: usize = 64;
/// The dtypes this module reads, for error messages.
const ALLOWED_DTYPES: &str = "'|b1' (bool), '|u1' (uint8), '<u2' (uint16 or raw bf16 bits), \
                              '<i4' (int32), '<i8' (int64), '<f4' (float32)";

/// The elements of an array, one variant per supported dtype.
#[derive(Clone, Debug, PartialEq)]
pub enum NpyData {
    /// `'|b1'`: numpy bool.
    Bool(Vec<bool>),
    /// `'|u1'`: uint8.
    U8(Vec<u8>),
    /// `'<u2'`: uint16; also how bf16 tensors are stored (raw bits).
    U16(Vec<u16>),
    /// `'<i4'`: int32.
    I32(Vec<i32>),
    /// `'<i8'`: int64.
    I64(Vec<i64>),
    /// `'<f4'`: float32 (compared bit for bit: NaN payloads survive a round trip).
    F32(Vec<f32>),
}

impl NpyData {
    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            NpyData::Bool(v) => v.len(),
            NpyData::U8(v) => v.len(),
            NpyData::U16(v) => v.len(),
            NpyData::I32(v) => v.len(),
            NpyData::I64(v) => v.len(),
            NpyData::F32(v) => v.len(),
        }
    }

    /// True when there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The numpy dtype descriptor this data is written with, e.g. `"<f4"`.
    pub fn dtype_descr(&self) -> &'static str {
        match self {
            NpyData::Bool(_) => "|b1",
            NpyData::U8(_) => "|u1",
            NpyData::U16(_) => "<u2",
            NpyData::I32(_) => "<i4",
            NpyData::I64(_) => "<i8",
            NpyData::F32(_) => "<f4",
        }
    }
}

/// An n-dimensional array in C (row-major) order, as stored in a `.npy` file.
#[derive(Clone, Debug, PartialEq)]
pub struct NpyArray {
    /// Dimensions, outermost first; empty for a scalar.
    pub shape: Vec<usize>,
    /// The elements, `product(shape)` of them.
    pub data: NpyData,
}

/// Everything that can go wrong reading or writing a `.npy` file.
#[derive(Debug, thiserror::Error)]
pub enum NpyError {
    /// Reading or writing the file failed.
    #[error("{path}: {error}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying error (in the message, so not a `source` too).
        error: io::Error,
    },
    /// The contents of a file were rejected; `error` says why.
    #[error("{path}: {error}")]
    InFile {
        /// The file.
        path: PathBuf,
        /// What was wrong with its contents.
        error: Box<NpyError>,
    },
    /// The header could not be parsed (`npyz`'s message).
    #[error("not a valid .npy header: {0}")]
    Header(String),
    /// A dtype this module does not read.
    #[error("unsupported dtype {found}; expected one of {ALLOWED_DTYPES}")]
    UnsupportedDtype {
        /// The descriptor found.
        found: String,
    },
    /// Fortran order with more than one dimension.
    #[error("fortran_order arrays of more than one dimension are not supported (shape {shape:?}); save a C-order array (np.ascontiguousarray)")]
    FortranOrder {
        /// The shape found.
        shape: Vec<u64>,
    },
    /// More dimensions than numpy allows.
    #[error("{0} dimensions; at most {MAX_DIMS} are supported")]
    TooManyDims(usize),
    /// Multiplying the dimensions overflows 64 bits, even if one of them is 0.
    #[error("shape {0:?}: multiplying its dimensions overflows 64 bits")]
    ShapeOverflow(Vec<u64>),
    /// The data after the header is not what the header describes.
    #[error("the header describes {expected} bytes of data (shape {shape:?}, {item} bytes each), but {found} follow it")]
    DataLength {
        /// Shape in the header.
        shape: Vec<u64>,
        /// Bytes per element.
        item: usize,
        /// Bytes the header implies (`None`: more than fit in memory).
        expected: String,
        /// Bytes present.
        found: usize,
    },
    /// The shape does not match the number of elements.
    #[error("shape {shape:?} has {expected} elements but the data has {found}")]
    ShapeMismatch {
        /// The shape.
        shape: Vec<usize>,
        /// Elements the shape implies.
        expected: usize,
        /// Elements present.
        found: usize,
    },
    /// The array has another dtype than the caller needs.
    #[error("dtype {found}; expected {expected}")]
    WrongDtype {
        /// What the caller accepts.
        expected: &'static str,
        /// The dtype found.
        found: &'static str,
    },
}

/// What a supported element type looks like in a header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Dtype {
    Bool,
    U8,
    U16,
    I32,
    I64,
    F32,
}

impl Dtype {
    fn of(dtype: &DType) -> Result<Dtype, NpyError> {
        let unsupported = || NpyError::UnsupportedDtype {
            found: dtype.descr(),
        };
        let DType::Plain(ts) = dtype else {
            return Err(unsupported());
        };
        Ok(match (ts.type_char(), ts.size_field()) {
            (TypeChar::Bool, 1) => Dtype::Bool,
            (TypeChar::Uint, 1) => Dtype::U8,
            (TypeChar::Uint, 2) => Dtype::U16,
            (TypeChar::Int, 4) => Dtype::I32,
            (TypeChar::Int, 8) => Dtype::I64,
            (TypeChar::Float, 4) => Dtype::F32,
            _ => return Err(unsupported()),
        })
    }

    fn size(self) -> usize {
        match self {
            Dtype::Bool | Dtype::U8 => 1,
            Dtype::U16 => 2,
            Dtype::I32 | Dtype::F32 => 4,
            Dtype::I64 => 8,
        }
    }
}

fn read_err(e: io::Error) -> NpyError {
    NpyError::Header(e.to_string())
}

/// `npyz` multiplies a shape's dimensions unchecked, in both orders (element count and
/// strides), which panics in a debug build when a partial product overflows, as in
/// `(0, 2**64 - 1, 2)`. Such a shape is refused before `npyz` sees it; anything else
/// wrong with the header is left for `npyz` to report.
fn refuse_overflowing_shape(bytes: &[u8]) -> Result<(), NpyError> {
    let Some(shape) = header_shape(bytes) else {
        return Ok(());
    };
    fn fits<'a>(mut dims: impl Iterator<Item = &'a u64>) -> bool {
        dims.try_fold(1u64, |acc, &d| acc.checked_mul(d)).is_some()
    }
    if fits(shape.iter()) && fits(shape.iter().rev()) {
        Ok(())
    } else {
        Err(NpyError::ShapeOverflow(shape))
    }
}

/// The `shape` entry of a header, if the header is well formed enough to have one.
fn header_shape(bytes: &[u8]) -> Option<Vec<u64>> {
    let [major, _minor, rest @ ..] = bytes.strip_prefix(b"\x93NUMPY")? else {
        return None;
    };
    let (len, text) = if *major == 1 {
        let (len, text) = rest.split_at_checked(2)?;
        (usize::from(u16::from_le_bytes(len.try_into().ok()?)), text)
    } else {
        let (len, text) = rest.split_at_checked(4)?;
        (u32::from_le_bytes(len.try_into().ok()?) as usize, text)
    };
    let text = std::str::from_utf8(text.get(..len)?).ok()?;
    let py_literal::Value::Dict(entries) = text.trim_end().parse().ok()? else {
        return None;
    };
    let (_, shape) = entries
        .iter()
        .find(|(k, _)| k.as_string().map(String::as_str) == Some("shape"))?;
    let (py_literal::Value::Tuple(dims) | py_literal::Value::List(dims)) = shape else {
        return None;
    };
    dims.iter()
        .map(|d| u64::try_from(d.as_integer()?).ok())
        .collect()
}

impl NpyArray {
    /// An array, checking that `shape` matches the number of elements.
    pub fn new(shape: Vec<usize>, data: NpyData) -> Result<Self, NpyError> {
        let a = NpyArray { shape, data };
        a.validate()?;
        Ok(a)
    }

    fn validate(&self) -> Result<(), NpyError> {
        if self.shape.len() > MAX_DIMS {
            return Err(NpyError::TooManyDims(self.shape.len()));
        }
        let expected = self
            .shape
            .iter()
            .try_fold(1usize, |acc, &d| acc.checked_mul(d));
        if expected != Some(self.data.len()) {
            return Err(NpyError::ShapeMismatch {
                shape: self.shape.clone(),
                expected: expected.unwrap_or(usize::MAX),
                found: self.data.len(),
            });
        }
        Ok(())
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.data.len()
    }

    /// True when there are no elements.
    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }

    /// The numpy dtype descriptor of the data.
    pub fn dtype_descr(&self) -> &'static str {
        self.data.dtype_descr()
    }

    /// Parse a whole `.npy` file held in memory (see the module docs for what is
    /// accepted and how hostile input is handled).
    pub fn parse(bytes: &[u8]) -> Result<NpyArray, NpyError> {
        refuse_overflowing_shape(bytes)?;
        let mut data = bytes;
        let header = NpyHeader::from_reader(&mut data).map_err(read_err)?;
        let dtype = Dtype::of(&header.dtype())?;
        let shape = header.shape().to_vec();
        if shape.len() > MAX_DIMS {
            return Err(NpyError::TooManyDims(shape.len()));
        }
        if header.order() == Order::Fortran && shape.len() > 1 {
            return Err(NpyError::FortranOrder { shape });
        }
        // Nothing is allocated before the input is known to hold every element.
        let expected = shape
            .iter()
            .try_fold(dtype.size() as u64, |acc, &d| acc.checked_mul(d))
            .and_then(|n| usize::try_from(n).ok());
        if expected != Some(data.len()) {
            return Err(NpyError::DataLength {
                shape,
                item: dtype.size(),
                expected: expected.map_or("more than fit in memory".into(), |n| n.to_string()),
                found: data.len(),
            });
        }
        let file = NpyFile::with_header(header, data);
        let data = match dtype {
            Dtype::Bool => NpyData::Bool(
                file.into_vec::<u8>()
                    .map_err(read_err)?
                    .into_iter()
                    .map(|b| b != 0)
                    .collect(),
            ),
            Dtype::U8 => NpyData::U8(file.into_vec().map_err(read_err)?),
            Dtype::U16 => NpyData::U16(file.into_vec().map_err(read_err)?),
            Dtype::I32 => NpyData::I32(file.into_vec().map_err(read_err)?),
            Dtype::I64 => NpyData::I64(file.into_vec().map_err(read_err)?),
            Dtype::F32 => NpyData::F32(file.into_vec().map_err(read_err)?),
        };
        NpyArray::new(shape.iter().map(|&d| d as usize).collect(), data)
    }

    /// Read and parse the file at `path`.
    pub fn read(path: &Path) -> Result<NpyArray, NpyError> {
        let bytes = std::fs::read(path).map_err(|error| NpyError::Io {
            path: path.to_path_buf(),
            error,
        })?;
        NpyArray::parse(&bytes).map_err(|e| NpyError::InFile {
            path: path.to_path_buf(),
            error: Box::new(e),
        })
    }

    /// The array in numpy's file format (version 1.0 unless the header needs more).
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::new();
        let shape: Vec<u64> = self.shape.iter().map(|&d| d as u64).collect();
        // Writing into memory cannot fail: the dtype and shape are ours.
        let written = match &self.data {
            NpyData::Bool(v) => write(&mut out, &shape, v.iter().copied()),
            NpyData::U8(v) => write(&mut out, &shape, v.iter().copied()),
            NpyData::U16(v) => write(&mut out, &shape, v.iter().copied()),
            NpyData::I32(v) => write(&mut out, &shape, v.iter().copied()),
            NpyData::I64(v) => write(&mut out, &shape, v.iter().copied()),
            NpyData::F32(v) => write(&mut out, &shape, v.iter().copied()),
        };
        debug_assert!(written.is_ok(), "{written:?}");
        out
    }

    /// Write the array to `path` in numpy's format, after checking that the shape
    /// matches the data.
    pub fn write(&self, path: &Path) -> Result<(), NpyError> {
        self.validate().map_err(|e| NpyError::InFile {
            path: path.to_path_buf(),
            error: Box::new(e),
        })?;
        std::fs::write(path, self.to_bytes()).map_err(|error| NpyError::Io {
            path: path.to_path_buf(),
            error,
        })
    }

    /// The elements as bf16. Accepts `'<u2'` (raw bf16 bits, how torch bf16 tensors are
    /// exported: `t.view(torch.uint16).numpy()`) or `'<f4'` (rounded to the nearest bf16,
    /// ties to even).
    pub fn into_bf16(self) -> Result<Vec<half::bf16>, NpyError> {
        match self.data {
            NpyData::U16(v) => Ok(v.into_iter().map(half::bf16::from_bits).collect()),
            NpyData::F32(v) => Ok(v.into_iter().map(half::bf16::from_f32).collect()),
            other => Err(NpyError::WrongDtype {
                expected: "'<u2' (raw bf16 bits) or '<f4' (float32, rounded to bf16)",
                found: other.dtype_descr(),
            }),
        }
    }

    /// The elements as i64. Accepts `'<i8'` or `'<i4'` (widened).
    pub fn into_i64(self) -> Result<Vec<i64>, NpyError> {
        match self.data {
            NpyData::I64(v) => Ok(v),
            NpyData::I32(v) => Ok(v.into_iter().map(i64::from).collect()),
            other => Err(NpyError::WrongDtype {
                expected: "'<i8' (int64) or '<i4' (int32)",
                found: other.dtype_descr(),
            }),
        }
    }

    /// The elements as f32. Accepts `'<f4'` only.
    pub fn into_f32(self) -> Result<Vec<f32>, NpyError> {
        match self.data {
            NpyData::F32(v) => Ok(v),
            other => Err(NpyError::WrongDtype {
                expected: "'<f4' (float32)",
                found: other.dtype_descr(),
            }),
        }
    }
}

fn write<T: npyz::Serialize + npyz::AutoSerialize>(
    out: &mut Vec<u8>,
    shape: &[u64],
    data: impl Iterator<Item = T>,
) -> io::Result<()> {
    let mut w = npyz::WriteOptions::new()
        .default_dtype()
        .shape(shape)
        .writer(out)
        .begin_nd()?;
    w.extend(data)?;
    w.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_rejects_what_it_should() {
        let a = NpyArray::new(vec![2, 3], NpyData::U16(vec![1, 2, 3, 4, 5, 0xffff])).unwrap();
        let bytes = a.to_bytes();
        assert_eq!(&bytes[..6], b"\x93NUMPY");
        assert_eq!(NpyArray::parse(&bytes).unwrap(), a);
        // An empty array keeps its trailing dimension.
        let empty = NpyArray::new(vec![0, 7], NpyData::F32(vec![])).unwrap();
        assert_eq!(
            NpyArray::parse(&empty.to_bytes()).unwrap().shape,
            vec![0, 7]
        );
        // A header that claims more data than follows allocates nothing.
        let mut huge = NpyArray::new(vec![1], NpyData::I64(vec![7]))
            .unwrap()
            .to_bytes();
        let text = String::from_utf8_lossy(&huge).replace("(1,)", "(1152921504606846976,)");
        huge = text.into_bytes();
        assert!(matches!(
            NpyArray::parse(&huge),
            Err(NpyError::DataLength { .. }) | Err(NpyError::Header(_))
        ));
        assert!(NpyArray::new(vec![2, 2], NpyData::U8(vec![1])).is_err());
        let err = NpyArray::parse(b"\x93NUMPY\x01\x00\x10\x00{'descr': '<f8',}").unwrap_err();
        assert!(!err.to_string().is_empty());
    }

    #[test]
    fn a_shape_whose_partial_products_overflow_is_refused() {
        // Found by the header fuzz: 0 elements in all, but 2**64 - 1 times 2 on the way.
        for shape in [
            "(18446744073709551615, 2, 0)",
            "(0, 18446744073709551615, 2)",
        ] {
            let text = format!("{{'descr': '|b1', 'fortran_order': False, 'shape': {shape}, }}\n");
            let mut file = b"\x93NUMPY\x01\x00".to_vec();
            file.extend_from_slice(&(text.len() as u16).to_le_bytes());
            file.extend_from_slice(text.as_bytes());
            let err = NpyArray::parse(&file).unwrap_err();
            assert!(matches!(err, NpyError::ShapeOverflow(_)), "{shape}: {err}");
        }
    }
}
