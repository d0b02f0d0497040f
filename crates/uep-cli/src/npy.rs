//! NumPy `.npy` reader and writer.
//!
//! Users prepare inputs for `uep bench --inputs` and check its outputs with
//! numpy, so this module reads what `np.save` writes and writes what `np.load`
//! reads, byte for byte the way numpy >= 1.24 (and 2.x) writes it.
//!
//! Scope, on purpose narrow (every other file fails with an error that says
//! what was found and what is allowed):
//! * format versions 1.0, 2.0 and 3.0;
//! * dtypes `'|b1'` (bool), `'|u1'` (uint8), `'<u2'` (uint16, also raw bf16
//!   bits), `'<i4'`, `'<i8'` and `'<f4'`; for the one-byte types the byte-order
//!   mark is meaningless, so `'<u1'`, `'>u1'`, `'<b1'`, `'>b1'` (which writers
//!   such as cnpy emit) are read too;
//! * C order only, little-endian only, any number of dimensions up to numpy's
//!   limit of 64, including `()` scalars and zero-length dimensions.
//!
//! [`NpyArray::parse`] treats its input as hostile: it never panics, and it
//! allocates nothing larger than the input before checking that the input
//! really holds that much data (a header claiming shape `(2**60,)` is an
//! error, not an out-of-memory abort). It is the target of fuzz tests.

use std::fmt;
use std::path::{Path, PathBuf};

/// The six bytes every `.npy` file starts with.
const MAGIC: &[u8; 6] = b"\x93NUMPY";
/// numpy aligns the start of the data to this many bytes (`ARRAY_ALIGN`).
const ARRAY_ALIGN: usize = 64;
/// numpy leaves room in the header for the first axis to grow to this many
/// digits, so that appending rows can rewrite the header in place
/// (`GROWTH_AXIS_MAX_DIGITS`, numpy >= 1.24).
const GROWTH_AXIS_MAX_DIGITS: usize = 21;
/// numpy's `NPY_MAXDIMS` (2.x); a header with more dimensions is rejected.
pub const MAX_DIMS: usize = 64;
/// Nesting limit for Python literals in the header, so hostile input cannot
/// overflow the parser's stack.
const MAX_NESTING: usize = 32;
/// The dtypes this module reads, for error messages.
const ALLOWED_DTYPES: &str = "'|b1' (bool), '|u1' (uint8), '<u2' (uint16 or raw bf16 bits), \
                              '<i4' (int32), '<i8' (int64), '<f4' (float32)";

/// The elements of an array, one variant per supported dtype.
#[derive(Clone, Debug, PartialEq)]
pub enum NpyData {
    /// `'|b1'`: numpy bool, one byte per element, 0 or 1.
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
        self.dtype().descr()
    }

    fn dtype(&self) -> Dtype {
        match self {
            NpyData::Bool(_) => Dtype::Bool,
            NpyData::U8(_) => Dtype::U8,
            NpyData::U16(_) => Dtype::U16,
            NpyData::I32(_) => Dtype::I32,
            NpyData::I64(_) => Dtype::I64,
            NpyData::F32(_) => Dtype::F32,
        }
    }
}

/// An n-dimensional array in C (row-major) order, as stored in a `.npy` file.
///
/// The fields are public for convenience; [`NpyArray::new`] is the checked
/// constructor. [`NpyArray::to_bytes`] writes whatever the fields hold, while
/// [`NpyArray::write`] refuses an array whose shape does not match its data.
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
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// The contents of a file were rejected; `error` says why.
    #[error("{path}: {error}")]
    InFile {
        /// The file.
        path: PathBuf,
        /// What was wrong with its contents.
        error: Box<NpyError>,
    },
    /// The input does not start with the `.npy` magic string.
    #[error("not a .npy file: expected the magic bytes \\x93NUMPY at the start, found {}", EscapedBytes(.found))]
    BadMagic {
        /// The first (up to six) bytes of the input.
        found: Vec<u8>,
    },
    /// The format version is not one this reader knows.
    #[error("unsupported .npy format version {major}.{minor}: supported are 1.0, 2.0 and 3.0")]
    UnsupportedVersion {
        /// Major version byte.
        major: u8,
        /// Minor version byte.
        minor: u8,
    },
    /// The header dictionary is malformed.
    #[error("malformed .npy header: {0}")]
    BadHeader(String),
    /// The dtype is valid numpy but not one this reader supports.
    #[error("unsupported dtype {descr}: supported are {allowed}")]
    UnsupportedDtype {
        /// The `descr` value, as written in the header.
        descr: String,
        /// The dtypes that are supported.
        allowed: &'static str,
    },
    /// A supported dtype, but stored big-endian.
    #[error(
        "dtype '{descr}' is big-endian: only little-endian is supported \
         (convert in numpy with a.astype(a.dtype.newbyteorder('<')))"
    )]
    BigEndian {
        /// The `descr` value, e.g. `">i4"`.
        descr: String,
    },
    /// The array is stored in Fortran (column-major) order.
    #[error(
        "array is stored in Fortran order (fortran_order: True): only C order is supported \
         (save np.ascontiguousarray(a) instead)"
    )]
    FortranOrder,
    /// The number of elements does not match the shape.
    #[error("shape {shape:?} holds {expected} elements but the data has {got}")]
    ShapeMismatch {
        /// The shape.
        shape: Vec<usize>,
        /// Elements the shape implies.
        expected: usize,
        /// Elements present.
        got: usize,
    },
    /// The shape has more dimensions than numpy allows.
    #[error("shape has {ndim} dimensions: at most {max} are supported", max = MAX_DIMS)]
    TooManyDims {
        /// Number of dimensions.
        ndim: usize,
    },
    /// The shape's element count (or byte count) does not fit in memory.
    #[error("shape {shape:?} of {descr} elements is too large to address")]
    TooLarge {
        /// The shape.
        shape: Vec<usize>,
        /// The dtype descriptor.
        descr: &'static str,
    },
    /// The input ends before the part named by `what` is complete.
    #[error("truncated .npy file: the {what} needs {expected} bytes but only {got} are present")]
    Truncated {
        /// Which part is cut short ("header", "array data", ...).
        what: &'static str,
        /// Bytes needed.
        expected: u64,
        /// Bytes present.
        got: u64,
    },
    /// There are bytes after the array data.
    #[error(
        "{extra} unexpected bytes after the array data \
         (the header's shape and dtype account for {expected} data bytes)"
    )]
    TrailingData {
        /// Data bytes the header accounts for.
        expected: u64,
        /// Bytes beyond those.
        extra: u64,
    },
    /// A `'|b1'` element is neither 0 nor 1.
    #[error("bool element {index} has byte value {value}: numpy bools are stored as 0 or 1")]
    InvalidBool {
        /// Flat (C-order) index of the element.
        index: usize,
        /// The byte found.
        value: u8,
    },
    /// A typed accessor was called on an array of another dtype.
    #[error("expected dtype {expected}, found '{found}'")]
    WrongDtype {
        /// The dtype(s) the accessor accepts.
        expected: &'static str,
        /// The array's dtype.
        found: &'static str,
    },
}

/// Formats bytes like a Python bytes literal, for error messages.
struct EscapedBytes<'a>(&'a [u8]);

impl fmt::Display for EscapedBytes<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("b'")?;
        for &b in self.0 {
            write!(f, "{}", std::ascii::escape_default(b))?;
        }
        f.write_str("'")
    }
}

/// The supported element types.
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
    /// The descriptor numpy writes for this dtype (`np.dtype(..).str`).
    fn descr(self) -> &'static str {
        match self {
            Dtype::Bool => "|b1",
            Dtype::U8 => "|u1",
            Dtype::U16 => "<u2",
            Dtype::I32 => "<i4",
            Dtype::I64 => "<i8",
            Dtype::F32 => "<f4",
        }
    }

    fn item_size(self) -> usize {
        match self {
            Dtype::Bool | Dtype::U8 => 1,
            Dtype::U16 => 2,
            Dtype::I32 | Dtype::F32 => 4,
            Dtype::I64 => 8,
        }
    }

    /// Maps a header `descr` to a dtype, or explains why it is not supported.
    fn from_descr(descr: &str) -> Result<Dtype, NpyError> {
        let (order, kind) = match descr.as_bytes().first() {
            Some(b'<' | b'>' | b'|' | b'=') => descr.split_at(1),
            _ => ("", descr),
        };
        // One-byte types have no byte order; numpy writes '|', other writers
        // (cnpy) write '<' or '>', and all mean the same bytes.
        match (order, kind) {
            ("|" | "<" | ">", "b1") => return Ok(Dtype::Bool),
            ("|" | "<" | ">", "u1") => return Ok(Dtype::U8),
            _ => {}
        }
        let dtype = match kind {
            "u2" => Dtype::U16,
            "i4" => Dtype::I32,
            "i8" => Dtype::I64,
            "f4" => Dtype::F32,
            _ => return Err(unsupported_dtype(descr)),
        };
        match order {
            "<" => Ok(dtype),
            ">" => Err(NpyError::BigEndian {
                descr: descr.to_string(),
            }),
            // '=' / '|' / no mark: native order of whatever machine wrote the
            // file, which numpy never writes for multi-byte types.
            _ => Err(unsupported_dtype(descr)),
        }
    }
}

fn unsupported_dtype(descr: &str) -> NpyError {
    NpyError::UnsupportedDtype {
        descr: format!("'{descr}'"),
        allowed: ALLOWED_DTYPES,
    }
}

/// Number of elements of `shape`, or `None` if it overflows `usize`. A zero
/// dimension makes the array empty whatever the other dimensions are.
fn element_count(shape: &[usize]) -> Option<usize> {
    if shape.contains(&0) {
        return Some(0);
    }
    shape.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d))
}

impl NpyArray {
    /// Builds an array, checking that `shape` holds exactly `data.len()`
    /// elements and has at most [`MAX_DIMS`] dimensions.
    pub fn new(shape: Vec<usize>, data: NpyData) -> Result<Self, NpyError> {
        let array = NpyArray { shape, data };
        array.validate()?;
        Ok(array)
    }

    fn validate(&self) -> Result<(), NpyError> {
        if self.shape.len() > MAX_DIMS {
            return Err(NpyError::TooManyDims {
                ndim: self.shape.len(),
            });
        }
        let got = self.data.len();
        match element_count(&self.shape) {
            Some(expected) if expected == got => Ok(()),
            Some(expected) => Err(NpyError::ShapeMismatch {
                shape: self.shape.clone(),
                expected,
                got,
            }),
            None => Err(NpyError::TooLarge {
                shape: self.shape.clone(),
                descr: self.data.dtype_descr(),
            }),
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.data.len()
    }

    /// True when the array has no elements.
    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }

    /// The numpy dtype descriptor, e.g. `"<i8"`.
    pub fn dtype_descr(&self) -> &'static str {
        self.data.dtype_descr()
    }

    /// Parses the contents of a `.npy` file.
    pub fn parse(bytes: &[u8]) -> Result<NpyArray, NpyError> {
        let (major, header_start) = parse_prefix(bytes)?;
        // A little-endian u16 (1.0) or u32 (2.0, 3.0); zero-extending the
        // former reads both the same way.
        let mut len_field = [0u8; 4];
        len_field[..header_start - 8].copy_from_slice(&bytes[8..header_start]);
        let header_len = u64::from(u32::from_le_bytes(len_field));
        let available = (bytes.len() - header_start) as u64;
        if header_len > available {
            return Err(NpyError::Truncated {
                what: "header",
                expected: header_len,
                got: available,
            });
        }
        // Fits in usize: it is at most the remaining input length.
        let data_start = header_start + header_len as usize;
        let raw = &bytes[header_start..data_start];
        let header_text: String = if major == 3 {
            std::str::from_utf8(raw)
                .map_err(|e| NpyError::BadHeader(format!("version 3.0 header is not UTF-8: {e}")))?
                .to_string()
        } else {
            // Versions 1.0 and 2.0 are latin-1: every byte is one char.
            raw.iter().map(|&b| char::from(b)).collect()
        };
        let header = parse_header(&header_text)?;
        let data = &bytes[data_start..];
        decode_data(header, data)
    }

    /// Reads a `.npy` file; errors name the file.
    pub fn read(path: &Path) -> Result<NpyArray, NpyError> {
        let bytes = std::fs::read(path).map_err(|source| NpyError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        NpyArray::parse(&bytes).map_err(|e| NpyError::InFile {
            path: path.to_path_buf(),
            error: Box::new(e),
        })
    }

    /// Serialises the array exactly as numpy (>= 1.24, 2.x) `np.save` does:
    /// format 1.0 (2.0 if the header exceeds 65535 bytes), the header dict
    /// with numpy's key order and spacing, space-padded so the data starts on
    /// a 64-byte boundary, terminated by `'\n'`, then the elements
    /// little-endian. Writes the fields as they are; see [`NpyArray::write`]
    /// for the checked version.
    pub fn to_bytes(&self) -> Vec<u8> {
        let header = header_text(self.dtype_descr(), &self.shape);
        let mut out = wrap_header(&header);
        let dtype = self.data.dtype();
        out.reserve(self.data.len().saturating_mul(dtype.item_size()));
        match &self.data {
            NpyData::Bool(v) => out.extend(v.iter().map(|&b| u8::from(b))),
            NpyData::U8(v) => out.extend_from_slice(v),
            NpyData::U16(v) => v
                .iter()
                .for_each(|x| out.extend_from_slice(&x.to_le_bytes())),
            NpyData::I32(v) => v
                .iter()
                .for_each(|x| out.extend_from_slice(&x.to_le_bytes())),
            NpyData::I64(v) => v
                .iter()
                .for_each(|x| out.extend_from_slice(&x.to_le_bytes())),
            NpyData::F32(v) => v
                .iter()
                .for_each(|x| out.extend_from_slice(&x.to_le_bytes())),
        }
        out
    }

    /// Writes the array to `path` in numpy's format (see
    /// [`NpyArray::to_bytes`]), after checking that the shape matches the data.
    pub fn write(&self, path: &Path) -> Result<(), NpyError> {
        self.validate().map_err(|e| NpyError::InFile {
            path: path.to_path_buf(),
            error: Box::new(e),
        })?;
        std::fs::write(path, self.to_bytes()).map_err(|source| NpyError::Io {
            path: path.to_path_buf(),
            source,
        })
    }

    /// The elements as bf16. Accepts `'<u2'` (raw bf16 bits, how torch bf16
    /// tensors are exported: `t.view(torch.uint16).numpy()`) or `'<f4'`
    /// (rounded to the nearest bf16, ties to even).
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

/// Checks the magic string and version; returns the offset of the header
/// text (after the header-length field) and the major version.
fn parse_prefix(bytes: &[u8]) -> Result<(u8, usize), NpyError> {
    let magic_len = MAGIC.len().min(bytes.len());
    if bytes[..magic_len] != MAGIC[..magic_len] {
        return Err(NpyError::BadMagic {
            found: bytes[..magic_len].to_vec(),
        });
    }
    if bytes.len() < 8 {
        return Err(NpyError::Truncated {
            what: "magic string and version",
            expected: 8,
            got: bytes.len() as u64,
        });
    }
    let len_size = match (bytes[6], bytes[7]) {
        (1, 0) => 2,
        (2, 0) | (3, 0) => 4,
        (major, minor) => return Err(NpyError::UnsupportedVersion { major, minor }),
    };
    let header_start = 8 + len_size;
    if bytes.len() < header_start {
        return Err(NpyError::Truncated {
            what: "header length field",
            expected: len_size as u64,
            got: (bytes.len() - 8) as u64,
        });
    }
    Ok((bytes[6], header_start))
}

/// The three facts a header carries.
#[derive(Debug)]
struct Header {
    dtype: Dtype,
    shape: Vec<usize>,
}

/// Parses the header dict `{'descr': ..., 'fortran_order': ..., 'shape': ...}`.
fn parse_header(text: &str) -> Result<Header, NpyError> {
    let mut parser = LiteralParser::new(text);
    let entries = match parser.parse_document()? {
        Literal::Dict(entries) => entries,
        other => {
            return Err(NpyError::BadHeader(format!(
                "expected a dict, found {}",
                other.kind()
            )))
        }
    };
    let (mut descr, mut fortran, mut shape) = (None, None, None);
    for (key, value) in entries {
        let slot = match key.as_str() {
            "descr" => &mut descr,
            "fortran_order" => &mut fortran,
            "shape" => &mut shape,
            _ => {
                return Err(NpyError::BadHeader(format!(
                    "unexpected key '{key}': the header has exactly 'descr', 'fortran_order' and 'shape'"
                )))
            }
        };
        if slot.replace(value).is_some() {
            return Err(NpyError::BadHeader(format!("duplicate key '{key}'")));
        }
    }
    let missing = |key: &str| NpyError::BadHeader(format!("missing key '{key}'"));
    let dtype = match descr.ok_or_else(|| missing("descr"))? {
        Literal::Str(s) => Dtype::from_descr(&s)?,
        // Structured dtypes are lists of fields; say so rather than "bad header".
        other => {
            return Err(NpyError::UnsupportedDtype {
                descr: format!("a {} (structured or sub-array dtype)", other.kind()),
                allowed: ALLOWED_DTYPES,
            })
        }
    };
    match fortran.ok_or_else(|| missing("fortran_order"))? {
        Literal::Bool(false) => {}
        Literal::Bool(true) => return Err(NpyError::FortranOrder),
        other => {
            return Err(NpyError::BadHeader(format!(
                "'fortran_order' must be True or False, found {}",
                other.kind()
            )))
        }
    }
    let dims = match shape.ok_or_else(|| missing("shape"))? {
        Literal::Tuple(dims) => dims,
        other => {
            return Err(NpyError::BadHeader(format!(
                "'shape' must be a tuple of non-negative integers, found {}",
                other.kind()
            )))
        }
    };
    if dims.len() > MAX_DIMS {
        return Err(NpyError::TooManyDims { ndim: dims.len() });
    }
    let shape = dims
        .into_iter()
        .map(|d| match d {
            Literal::Int(n) => usize::try_from(n).map_err(|_| {
                NpyError::BadHeader(format!(
                    "shape dimension {n} is out of range (0..={})",
                    usize::MAX
                ))
            }),
            other => Err(NpyError::BadHeader(format!(
                "'shape' must be a tuple of non-negative integers, found an element that is {}",
                other.kind()
            ))),
        })
        .collect::<Result<Vec<usize>, _>>()?;
    Ok(Header { dtype, shape })
}

/// Decodes the data section, checking its size before allocating anything.
fn decode_data(header: Header, data: &[u8]) -> Result<NpyArray, NpyError> {
    let Header { dtype, shape } = header;
    let too_large = || NpyError::TooLarge {
        shape: shape.clone(),
        descr: dtype.descr(),
    };
    let count = element_count(&shape).ok_or_else(too_large)?;
    let needed = count.checked_mul(dtype.item_size()).ok_or_else(too_large)?;
    if data.len() < needed {
        return Err(NpyError::Truncated {
            what: "array data",
            expected: needed as u64,
            got: data.len() as u64,
        });
    }
    if data.len() > needed {
        return Err(NpyError::TrailingData {
            expected: needed as u64,
            extra: (data.len() - needed) as u64,
        });
    }
    let data = match dtype {
        Dtype::Bool => NpyData::Bool(
            data.iter()
                .enumerate()
                .map(|(index, &value)| match value {
                    0 => Ok(false),
                    1 => Ok(true),
                    _ => Err(NpyError::InvalidBool { index, value }),
                })
                .collect::<Result<_, _>>()?,
        ),
        Dtype::U8 => NpyData::U8(data.to_vec()),
        Dtype::U16 => NpyData::U16(le_chunks(data, u16::from_le_bytes)),
        Dtype::I32 => NpyData::I32(le_chunks(data, i32::from_le_bytes)),
        Dtype::I64 => NpyData::I64(le_chunks(data, i64::from_le_bytes)),
        Dtype::F32 => NpyData::F32(le_chunks(data, f32::from_le_bytes)),
    };
    Ok(NpyArray { shape, data })
}

/// Decodes consecutive `N`-byte little-endian elements (`data.len()` is a
/// multiple of `N`, checked by the caller).
fn le_chunks<const N: usize, T>(data: &[u8], from_le: fn([u8; N]) -> T) -> Vec<T> {
    data.chunks_exact(N)
        .map(|chunk| {
            let mut bytes = [0u8; N];
            bytes.copy_from_slice(chunk);
            from_le(bytes)
        })
        .collect()
}

/// The header dict text exactly as numpy's `_write_array_header` builds it:
/// keys sorted, `repr` values, a `", "` after every item, then spare spaces so
/// the first axis can grow to [`GROWTH_AXIS_MAX_DIGITS`] digits in place.
fn header_text(descr: &str, shape: &[usize]) -> String {
    let shape_repr = match shape {
        [] => "()".to_string(),
        [d] => format!("({d},)"),
        dims => {
            let parts: Vec<String> = dims.iter().map(usize::to_string).collect();
            format!("({})", parts.join(", "))
        }
    };
    let mut header =
        format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape_repr}, }}");
    if let Some(first) = shape.first() {
        let digits = first.to_string().len();
        header.push_str(&" ".repeat(GROWTH_AXIS_MAX_DIGITS.saturating_sub(digits)));
    }
    header
}

/// Prepends the magic, version and length, and pads the header with spaces
/// and a final `'\n'` so the data starts on a 64-byte boundary, as numpy's
/// `_wrap_header` does (a header that is already aligned still gets a full 64
/// bytes of padding, like numpy). Uses version 1.0 unless the header needs
/// more than a `u16` length, then 2.0. (Our headers are ASCII, so 3.0, which
/// only changes the text encoding to UTF-8, is never needed.)
fn wrap_header(header: &str) -> Vec<u8> {
    let text_len = header.len() + 1; // + '\n'
    let pad = |prefix_len: usize| ARRAY_ALIGN - (prefix_len + text_len) % ARRAY_ALIGN;
    let v1_total = text_len + pad(10);
    let (version, length_field): (u8, Vec<u8>) = match u16::try_from(v1_total) {
        Ok(len) => (1, len.to_le_bytes().to_vec()),
        Err(_) => {
            // Saturating only for headers over 4 GiB, which need over a
            // hundred million dimensions: far beyond any readable array.
            let len = u32::try_from(text_len + pad(12)).unwrap_or(u32::MAX);
            (2, len.to_le_bytes().to_vec())
        }
    };
    let prefix_len = 8 + length_field.len();
    let mut out = Vec::with_capacity(prefix_len + text_len + pad(prefix_len));
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&[version, 0]);
    out.extend_from_slice(&length_field);
    out.extend_from_slice(header.as_bytes());
    out.resize(out.len() + pad(prefix_len), b' ');
    out.push(b'\n');
    out
}

/// A Python literal, the subset `ast.literal_eval` would return for a `.npy`
/// header (strings, integers, booleans, None, tuples, lists, dicts).
#[derive(Debug, PartialEq)]
enum Literal {
    Str(String),
    Int(i128),
    Bool(bool),
    None,
    Tuple(Vec<Literal>),
    List(Vec<Literal>),
    Dict(Vec<(String, Literal)>),
}

impl Literal {
    /// What kind of value this is, for error messages.
    fn kind(&self) -> String {
        match self {
            Literal::Str(s) => format!("the string {s:?}"),
            Literal::Int(n) => format!("the integer {n}"),
            Literal::Bool(b) => format!("the bool {}", if *b { "True" } else { "False" }),
            Literal::None => "None".to_string(),
            Literal::Tuple(_) => "tuple".to_string(),
            Literal::List(_) => "list".to_string(),
            Literal::Dict(_) => "dict".to_string(),
        }
    }
}

/// Recursive-descent parser for the Python literal syntax numpy headers use.
struct LiteralParser<'a> {
    text: &'a str,
    pos: usize,
}

impl<'a> LiteralParser<'a> {
    fn new(text: &'a str) -> Self {
        LiteralParser { text, pos: 0 }
    }

    fn error(&self, what: impl fmt::Display) -> NpyError {
        NpyError::BadHeader(format!(
            "{what} at character {} of the header",
            self.char_index()
        ))
    }

    fn char_index(&self) -> usize {
        self.text[..self.pos].chars().count()
    }

    fn peek(&self) -> Option<char> {
        self.text[self.pos..].chars().next()
    }

    fn bump(&mut self) -> Option<char> {
        let c = self.peek()?;
        self.pos += c.len_utf8();
        Some(c)
    }

    fn skip_ws(&mut self) {
        while let Some(' ' | '\t' | '\n' | '\r' | '\x0c') = self.peek() {
            self.pos += 1;
        }
    }

    fn expect(&mut self, want: char) -> Result<(), NpyError> {
        self.skip_ws();
        match self.bump() {
            Some(c) if c == want => Ok(()),
            Some(c) => Err(self.error(format_args!(
                "expected '{want}', found '{}'",
                c.escape_debug()
            ))),
            None => Err(self.error(format_args!("expected '{want}', found the end"))),
        }
    }

    /// The whole header: one literal, then only whitespace (numpy pads with
    /// spaces and ends with '\n').
    fn parse_document(&mut self) -> Result<Literal, NpyError> {
        let value = self.parse_value(0)?;
        self.skip_ws();
        match self.peek() {
            None => Ok(value),
            Some(c) => Err(self.error(format_args!(
                "unexpected '{}' after the header dict",
                c.escape_debug()
            ))),
        }
    }

    fn parse_value(&mut self, depth: usize) -> Result<Literal, NpyError> {
        if depth > MAX_NESTING {
            return Err(self.error(format_args!("nesting deeper than {MAX_NESTING}")));
        }
        self.skip_ws();
        match self.peek() {
            Some('\'' | '"') => self.parse_string().map(Literal::Str),
            Some('{') => self.parse_dict(depth),
            Some('(') => self.parse_sequence(depth, ')'),
            Some('[') => self.parse_sequence(depth, ']'),
            Some(c) if c.is_ascii_digit() || c == '-' || c == '+' => self.parse_int(),
            Some(c) if c.is_ascii_alphabetic() || c == '_' => {
                let start = self.pos;
                while let Some(c) = self.peek() {
                    if !(c.is_ascii_alphanumeric() || c == '_') {
                        break;
                    }
                    self.pos += 1;
                }
                match &self.text[start..self.pos] {
                    "True" => Ok(Literal::Bool(true)),
                    "False" => Ok(Literal::Bool(false)),
                    "None" => Ok(Literal::None),
                    word => Err(NpyError::BadHeader(format!(
                        "unknown name '{word}' in the header (only literals are allowed)"
                    ))),
                }
            }
            Some(c) => Err(self.error(format_args!("unexpected '{}'", c.escape_debug()))),
            None => Err(self.error("unexpected end of header")),
        }
    }

    fn parse_string(&mut self) -> Result<String, NpyError> {
        let quote = self.bump().ok_or_else(|| self.error("expected a string"))?;
        let mut out = String::new();
        loop {
            match self.bump() {
                None | Some('\n') => return Err(self.error("unterminated string")),
                Some('\\') => match self.bump() {
                    Some(c @ ('\\' | '\'' | '"')) => out.push(c),
                    _ => {
                        return Err(
                            self.error("unsupported escape in string (only \\\\, \\' and \\\")")
                        )
                    }
                },
                Some(c) if c == quote => return Ok(out),
                Some(c) => out.push(c),
            }
        }
    }

    fn parse_int(&mut self) -> Result<Literal, NpyError> {
        let negative = match self.peek() {
            Some('-') => {
                self.pos += 1;
                true
            }
            Some('+') => {
                self.pos += 1;
                false
            }
            _ => false,
        };
        self.skip_ws();
        let start = self.pos;
        let mut value: i128 = 0;
        while let Some(c) = self.peek() {
            let Some(digit) = c.to_digit(10) else { break };
            self.pos += 1;
            value = value
                .checked_mul(10)
                .and_then(|v| v.checked_add(i128::from(digit)))
                .ok_or_else(|| self.error("integer too large"))?;
        }
        if self.pos == start {
            return Err(self.error("expected digits"));
        }
        // Python 2 wrote longs as `3L`; numpy still reads such headers.
        if self.peek() == Some('L') {
            self.pos += 1;
        }
        Ok(Literal::Int(if negative { -value } else { value }))
    }

    /// A tuple `(..)` or list `[..]`. Python rules: `()` is the empty tuple,
    /// `(x)` is just `x`, `(x,)` and `(x, y)` are tuples; a trailing comma is
    /// allowed.
    fn parse_sequence(&mut self, depth: usize, close: char) -> Result<Literal, NpyError> {
        self.bump(); // the opening bracket
        let mut items = Vec::new();
        let mut saw_comma = false;
        loop {
            self.skip_ws();
            if self.peek() == Some(close) {
                self.bump();
                break;
            }
            items.push(self.parse_value(depth + 1)?);
            self.skip_ws();
            match self.bump() {
                Some(',') => saw_comma = true,
                Some(c) if c == close => break,
                Some(c) => {
                    return Err(self.error(format_args!(
                        "expected ',' or '{close}', found '{}'",
                        c.escape_debug()
                    )))
                }
                None => return Err(self.error(format_args!("expected '{close}', found the end"))),
            }
        }
        if close == ']' {
            return Ok(Literal::List(items));
        }
        if items.len() == 1 && !saw_comma {
            // `(x)` is a parenthesised expression, not a tuple.
            return Ok(items.pop().unwrap_or(Literal::None));
        }
        Ok(Literal::Tuple(items))
    }

    fn parse_dict(&mut self, depth: usize) -> Result<Literal, NpyError> {
        self.bump(); // '{'
        let mut entries = Vec::new();
        loop {
            self.skip_ws();
            match self.peek() {
                Some('}') => {
                    self.bump();
                    return Ok(Literal::Dict(entries));
                }
                Some('\'' | '"') => {}
                _ => return Err(self.error("expected a string key or '}'")),
            }
            let key = self.parse_string()?;
            self.expect(':')?;
            let value = self.parse_value(depth + 1)?;
            entries.push((key, value));
            self.skip_ws();
            match self.bump() {
                Some(',') => {}
                Some('}') => return Ok(Literal::Dict(entries)),
                Some(c) => {
                    return Err(self.error(format_args!(
                        "expected ',' or '}}', found '{}'",
                        c.escape_debug()
                    )))
                }
                None => return Err(self.error("expected '}', found the end")),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    // ---- fixtures: the exact bytes numpy 2.4 `np.save` wrote (checked by hand) ----

    /// np.save(f, np.arange(6, dtype='<i4').reshape(2, 3))
    const I4_2X3: &[u8] = b"\x93NUMPY\x01\x00v\x00{'descr': '<i4', 'fortran_order': False, 'shape': (2, 3), }                                                          \n\x00\x00\x00\x00\x01\x00\x00\x00\x02\x00\x00\x00\x03\x00\x00\x00\x04\x00\x00\x00\x05\x00\x00\x00";
    /// np.save(f, np.array(-7, dtype='<i8'))
    const I8_SCALAR: &[u8] = b"\x93NUMPY\x01\x00v\x00{'descr': '<i8', 'fortran_order': False, 'shape': (), }                                                              \n\xf9\xff\xff\xff\xff\xff\xff\xff";
    /// np.save(f, np.zeros((0,), dtype='<f4'))
    const F4_EMPTY: &[u8] = b"\x93NUMPY\x01\x00v\x00{'descr': '<f4', 'fortran_order': False, 'shape': (0,), }                                                            \n";
    /// np.save(f, np.array([True, False, True]))
    const B1: &[u8] = b"\x93NUMPY\x01\x00v\x00{'descr': '|b1', 'fortran_order': False, 'shape': (3,), }                                                            \n\x01\x00\x01";
    /// np.save(f, np.array([0, 1, 0x3f80, 0xffff], dtype='<u2'))
    const U2: &[u8] = b"\x93NUMPY\x01\x00v\x00{'descr': '<u2', 'fortran_order': False, 'shape': (4,), }                                                            \n\x00\x00\x01\x00\x80?\xff\xff";
    /// np.save(f, np.array([1.5, -2, np.inf], dtype='<f4'))
    const F4: &[u8] = b"\x93NUMPY\x01\x00v\x00{'descr': '<f4', 'fortran_order': False, 'shape': (3,), }                                                            \n\x00\x00\xc0?\x00\x00\x00\xc0\x00\x00\x80\x7f";
    /// np.save(f, np.zeros((0, 5), dtype='u1'))
    const U1_0X5: &[u8] = b"\x93NUMPY\x01\x00v\x00{'descr': '|u1', 'fortran_order': False, 'shape': (0, 5), }                                                          \n";
    /// np.save(f, np.arange(2, dtype='u1').reshape((1,) * 15 + (2,))): the
    /// growth padding pushes this header from 128 to 192 bytes.
    const U1_16D: &[u8] = b"\x93NUMPY\x01\x00\xb6\x00{'descr': '|u1', 'fortran_order': False, 'shape': (1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2), }                                                                                \n\x00\x01";
    /// np.lib.format.write_array(f, np.arange(3, dtype='<i4'), version=(2, 0))
    const I4_V2: &[u8] = b"\x93NUMPY\x02\x00t\x00\x00\x00{'descr': '<i4', 'fortran_order': False, 'shape': (3,), }                                                          \n\x00\x00\x00\x00\x01\x00\x00\x00\x02\x00\x00\x00";
    /// np.lib.format.write_array(f, np.arange(3, dtype='<i4'), version=(3, 0))
    const I4_V3: &[u8] = b"\x93NUMPY\x03\x00t\x00\x00\x00{'descr': '<i4', 'fortran_order': False, 'shape': (3,), }                                                          \n\x00\x00\x00\x00\x01\x00\x00\x00\x02\x00\x00\x00";
    /// np.save(f, np.arange(2, dtype='>i4'))
    const BIG_ENDIAN: &[u8] = b"\x93NUMPY\x01\x00v\x00{'descr': '>i4', 'fortran_order': False, 'shape': (2,), }                                                            \n\x00\x00\x00\x00\x00\x00\x00\x01";
    /// np.save(f, np.asfortranarray(np.arange(6, dtype='<i4').reshape(2, 3)))
    const FORTRAN: &[u8] = b"\x93NUMPY\x01\x00v\x00{'descr': '<i4', 'fortran_order': True, 'shape': (2, 3), }                                                           \n\x00\x00\x00\x00\x03\x00\x00\x00\x01\x00\x00\x00\x04\x00\x00\x00\x02\x00\x00\x00\x05\x00\x00\x00";

    fn arr(shape: Vec<usize>, data: NpyData) -> NpyArray {
        NpyArray::new(shape, data).unwrap()
    }

    /// Fixtures numpy wrote, and the array each holds.
    fn numpy_fixtures() -> Vec<(&'static str, &'static [u8], NpyArray)> {
        vec![
            (
                "i4 (2, 3)",
                I4_2X3,
                arr(vec![2, 3], NpyData::I32(vec![0, 1, 2, 3, 4, 5])),
            ),
            ("i8 scalar", I8_SCALAR, arr(vec![], NpyData::I64(vec![-7]))),
            ("f4 empty", F4_EMPTY, arr(vec![0], NpyData::F32(vec![]))),
            (
                "b1",
                B1,
                arr(vec![3], NpyData::Bool(vec![true, false, true])),
            ),
            (
                "u2",
                U2,
                arr(vec![4], NpyData::U16(vec![0, 1, 0x3f80, 0xffff])),
            ),
            (
                "f4",
                F4,
                arr(vec![3], NpyData::F32(vec![1.5, -2.0, f32::INFINITY])),
            ),
            ("u1 (0, 5)", U1_0X5, arr(vec![0, 5], NpyData::U8(vec![]))),
            (
                "u1 16-d",
                U1_16D,
                arr([vec![1; 15], vec![2]].concat(), NpyData::U8(vec![0, 1])),
            ),
        ]
    }

    #[test]
    fn writes_exactly_what_numpy_writes() {
        for (name, bytes, array) in numpy_fixtures() {
            assert_eq!(array.to_bytes(), bytes, "{name}");
            assert_eq!(
                (array.to_bytes().len() - array.len() * bytes_per(&array)) % 64,
                0
            );
        }
    }

    fn bytes_per(a: &NpyArray) -> usize {
        a.data.dtype().item_size()
    }

    #[test]
    fn reads_what_numpy_writes() {
        for (name, bytes, array) in numpy_fixtures() {
            assert_eq!(NpyArray::parse(bytes).unwrap(), array, "{name}");
        }
        let v = arr(vec![3], NpyData::I32(vec![0, 1, 2]));
        assert_eq!(NpyArray::parse(I4_V2).unwrap(), v);
        assert_eq!(NpyArray::parse(I4_V3).unwrap(), v);
    }

    #[test]
    fn reads_old_numpy_headers() {
        // numpy < 1.24 wrote no growth padding (128 bytes here, not 192) and
        // numpy < 1.14 aligned to 16 bytes; double quotes, no trailing comma,
        // other key orders and Python 2 longs are valid Python literals too.
        let headers = [
            "{'descr': '|u1', 'fortran_order': False, 'shape': (1, 2), }",
            "{'descr': '|u1', 'fortran_order': False, 'shape': (1, 2)}",
            "{\"shape\": (1,2), \"descr\": \"|u1\", \"fortran_order\": False}",
            "{ 'shape' : ( 1 , 2 , ) ,\n 'fortran_order':False,'descr':'<u1' , }",
            "{'descr': '|u1', 'fortran_order': False, 'shape': (1L, 2L), }",
        ];
        for (i, header) in headers.iter().enumerate() {
            for align in [16, 64] {
                let mut bytes = b"\x93NUMPY\x01\x00".to_vec();
                let mut text = header.to_string();
                while (10 + text.len() + 1) % align != 0 {
                    text.push(' ');
                }
                text.push('\n');
                bytes.extend_from_slice(&(text.len() as u16).to_le_bytes());
                bytes.extend_from_slice(text.as_bytes());
                bytes.extend_from_slice(&[7, 9]);
                let parsed = NpyArray::parse(&bytes).unwrap_or_else(|e| panic!("header {i}: {e}"));
                assert_eq!(
                    parsed,
                    arr(vec![1, 2], NpyData::U8(vec![7, 9])),
                    "header {i}"
                );
            }
        }
    }

    /// Wraps an arbitrary header text in a version-1.0 file with `data`.
    fn file_with_header(header: &str, data: &[u8]) -> Vec<u8> {
        let mut bytes = b"\x93NUMPY\x01\x00".to_vec();
        bytes.extend_from_slice(&(header.len() as u16).to_le_bytes());
        bytes.extend_from_slice(header.as_bytes());
        bytes.extend_from_slice(data);
        bytes
    }

    fn header(descr: &str, fortran: &str, shape: &str) -> String {
        format!("{{'descr': {descr}, 'fortran_order': {fortran}, 'shape': {shape}, }}\n")
    }

    fn parse_err(header_text: &str, data: &[u8]) -> NpyError {
        NpyArray::parse(&file_with_header(header_text, data)).unwrap_err()
    }

    #[test]
    fn shapes_in_python_tuple_syntax() {
        let ok = |shape: &str, n: usize| {
            let a = NpyArray::parse(&file_with_header(
                &header("'|u1'", "False", shape),
                &vec![0; n],
            ))
            .unwrap_or_else(|e| panic!("{shape}: {e}"));
            a.shape
        };
        assert_eq!(ok("()", 1), Vec::<usize>::new());
        assert_eq!(ok("( )", 1), Vec::<usize>::new());
        assert_eq!(ok("(3,)", 3), vec![3]);
        assert_eq!(ok("(2, 3)", 6), vec![2, 3]);
        assert_eq!(ok("(2,3,)", 6), vec![2, 3]);
        assert_eq!(ok("(0, 18446744073709551615)", 0), vec![0, usize::MAX]);
        // `(3)` is the integer 3 in Python, and a list is not a tuple: numpy
        // rejects both.
        for bad in [
            "(3)", "[3]", "3", "(-1,)", "(1.5,)", "('3',)", "(True,)", "(,)", "(1,,)",
        ] {
            let e = parse_err(&header("'|u1'", "False", bad), &[0; 3]);
            assert!(matches!(e, NpyError::BadHeader(_)), "{bad}: {e}");
        }
    }

    #[test]
    fn header_errors_are_specific() {
        let e = parse_err(&header("'>i4'", "False", "(2,)"), &[0; 8]);
        assert!(e.to_string().contains("only little-endian"), "{e}");
        assert!(matches!(
            NpyArray::parse(BIG_ENDIAN),
            Err(NpyError::BigEndian { .. })
        ));
        assert!(matches!(
            NpyArray::parse(FORTRAN),
            Err(NpyError::FortranOrder)
        ));
        for descr in [
            "'<f8'", "'|i1'", "'<i2'", "'=i4'", "'i4'", "'|u2'", "'>f8'", "'<U3'", "'O'",
        ] {
            let e = parse_err(&header(descr, "False", "(1,)"), &[0; 8]);
            match &e {
                NpyError::UnsupportedDtype { descr: d, allowed } => {
                    assert_eq!(d, descr);
                    assert!(allowed.contains("'<f4'"));
                }
                _ => panic!("{descr}: {e}"),
            }
        }
        let e = parse_err(&header("[('a', '<i4')]", "False", "(1,)"), &[0; 4]);
        assert!(matches!(e, NpyError::UnsupportedDtype { .. }), "{e}");
        for (text, needle) in [
            (
                "{'descr': '<i4', 'shape': (1,)}",
                "missing key 'fortran_order'",
            ),
            (
                "{'descr': '<i4', 'fortran_order': False}",
                "missing key 'shape'",
            ),
            (
                "{'fortran_order': False, 'shape': (1,)}",
                "missing key 'descr'",
            ),
            (
                "{'descr': '<i4', 'descr': '<i4', 'fortran_order': False, 'shape': (1,)}",
                "duplicate",
            ),
            (
                "{'descr': '<i4', 'fortran_order': False, 'shape': (1,), 'x': 1}",
                "unexpected key 'x'",
            ),
            (
                "{'descr': '<i4', 'fortran_order': 0, 'shape': (1,)}",
                "True or False",
            ),
            (
                "{'descr': '<i4', 'fortran_order': False, 'shape': (1,)} x",
                "after the header",
            ),
            (
                "{'descr': '<i4', 'fortran_order': False, 'shape': (1,)",
                "expected",
            ),
            ("{'descr: '<i4'}", "expected"),
            (
                "{'descr': '<i4', 'fortran_order': false, 'shape': (1,)}",
                "unknown name 'false'",
            ),
            ("['descr']", "expected a dict"),
            ("", "unexpected end"),
        ] {
            let e = parse_err(text, &[0; 4]);
            assert!(e.to_string().contains(needle), "{text}: {e}");
        }
    }

    #[test]
    fn prefix_errors() {
        assert!(matches!(
            NpyArray::parse(b""),
            Err(NpyError::Truncated { .. })
        ));
        assert!(matches!(
            NpyArray::parse(b"\x93NUM"),
            Err(NpyError::Truncated { .. })
        ));
        let e = NpyArray::parse(b"PK\x03\x04 this is a zip").unwrap_err();
        assert!(matches!(e, NpyError::BadMagic { .. }));
        assert!(e.to_string().contains("b'PK\\x03\\x04 t'"), "{e}");
        let mut v4 = I4_V2.to_vec();
        v4[6] = 4;
        let e = NpyArray::parse(&v4).unwrap_err();
        assert!(
            matches!(e, NpyError::UnsupportedVersion { major: 4, minor: 0 }),
            "{e}"
        );
        v4[6] = 1;
        v4[7] = 1;
        assert!(matches!(
            NpyArray::parse(&v4),
            Err(NpyError::UnsupportedVersion { .. })
        ));
        assert!(matches!(
            NpyArray::parse(&I4_V2[..11]),
            Err(NpyError::Truncated {
                what: "header length field",
                ..
            })
        ));
        assert!(matches!(
            NpyArray::parse(&I4_2X3[..60]),
            Err(NpyError::Truncated {
                what: "header",
                expected: 118,
                got: 50
            })
        ));
    }

    #[test]
    fn data_size_is_checked() {
        assert!(matches!(
            NpyArray::parse(&I4_2X3[..I4_2X3.len() - 1]),
            Err(NpyError::Truncated {
                what: "array data",
                expected: 24,
                got: 23
            })
        ));
        let mut long = I4_2X3.to_vec();
        long.push(0);
        assert!(matches!(
            NpyArray::parse(&long),
            Err(NpyError::TrailingData {
                expected: 24,
                extra: 1
            })
        ));
        let mut bad_bool = B1.to_vec();
        *bad_bool.last_mut().unwrap() = 2;
        assert!(matches!(
            NpyArray::parse(&bad_bool),
            Err(NpyError::InvalidBool { index: 2, value: 2 })
        ));
    }

    #[test]
    fn hostile_headers_error_without_allocating() {
        // Would need 2^63 bytes: must be a Truncated error, not an allocation.
        let e = parse_err(&header("'<i8'", "False", "(1152921504606846976,)"), &[0; 8]);
        assert!(
            matches!(e, NpyError::Truncated { expected, got: 8, .. } if expected == 1 << 63),
            "{e}"
        );
        let e = parse_err(&header("'<i8'", "False", "(4294967296, 4294967296)"), &[]);
        assert!(matches!(e, NpyError::TooLarge { .. }), "{e}");
        let e = parse_err(&header("'<f4'", "False", "(4611686018427387904,)"), &[]);
        assert!(matches!(e, NpyError::TooLarge { .. }), "{e}");
        let e = parse_err(&header("'<f4'", "False", "(99999999999999999999999,)"), &[]);
        assert!(matches!(e, NpyError::BadHeader(_)), "{e}");
        let e = parse_err(&header("'<f4'", "False", &"9".repeat(50)), &[]);
        assert!(e.to_string().contains("integer too large"), "{e}");
        let deep = format!("{}1{}", "(".repeat(10_000), ",)".repeat(10_000));
        let e = parse_err(&header("'<f4'", "False", &deep), &[]);
        assert!(e.to_string().contains("nesting"), "{e}");
        let dims = format!("({})", vec!["1"; 65].join(", "));
        let e = parse_err(&header("'<f4'", "False", &dims), &[0; 4]);
        assert!(matches!(e, NpyError::TooManyDims { ndim: 65 }), "{e}");
        // A 2.0 header length of 4 GiB on a tiny input.
        let mut v2 = I4_V2.to_vec();
        v2[8..12].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(
            NpyArray::parse(&v2),
            Err(NpyError::Truncated { what: "header", .. })
        ));
    }

    #[test]
    fn latin1_and_utf8_headers() {
        // Non-ASCII in a 1.0 header is latin-1; in a 3.0 header it must be UTF-8.
        let mut latin1 = header("'X'", "False", "(1,)").into_bytes();
        latin1[11] = 0xe9; // the X
        let mut v1 = b"\x93NUMPY\x01\x00".to_vec();
        v1.extend_from_slice(&(latin1.len() as u16).to_le_bytes());
        v1.extend_from_slice(&latin1);
        let e = NpyArray::parse(&v1).unwrap_err();
        assert!(
            matches!(&e, NpyError::UnsupportedDtype { descr, .. } if descr == "'\u{e9}'"),
            "{e}"
        );
        let mut v3 = b"\x93NUMPY\x03\x00".to_vec();
        let text = b"{'descr': '\xff'}";
        v3.extend_from_slice(&(text.len() as u32).to_le_bytes());
        v3.extend_from_slice(text);
        let e = NpyArray::parse(&v3).unwrap_err();
        assert!(e.to_string().contains("not UTF-8"), "{e}");
    }

    #[test]
    fn one_byte_types_accept_any_byte_order_mark() {
        for descr in ["'<u1'", "'>u1'", "'|u1'"] {
            let a =
                NpyArray::parse(&file_with_header(&header(descr, "False", "(1,)"), &[5])).unwrap();
            assert_eq!(a.data, NpyData::U8(vec![5]));
        }
        for descr in ["'<b1'", "'>b1'", "'|b1'"] {
            let a =
                NpyArray::parse(&file_with_header(&header(descr, "False", "(1,)"), &[1])).unwrap();
            assert_eq!(a.data, NpyData::Bool(vec![true]));
        }
    }

    #[test]
    fn version_2_when_header_exceeds_u16() {
        let text = "x".repeat(70_000);
        let wrapped = wrap_header(&text);
        assert_eq!(&wrapped[..8], b"\x93NUMPY\x02\x00");
        let len = u32::from_le_bytes(wrapped[8..12].try_into().unwrap()) as usize;
        assert_eq!(wrapped.len(), 12 + len);
        assert_eq!(wrapped.len() % 64, 0);
        assert_eq!(wrapped.last(), Some(&b'\n'));
        // Already aligned: numpy still adds a full 64 bytes of padding.
        let aligned = "y".repeat(64 - 10 - 1);
        assert_eq!(wrap_header(&aligned).len(), 128);
    }

    #[test]
    fn new_checks_shape() {
        let e = NpyArray::new(vec![2, 3], NpyData::U8(vec![0; 5])).unwrap_err();
        assert!(
            matches!(
                e,
                NpyError::ShapeMismatch {
                    expected: 6,
                    got: 5,
                    ..
                }
            ),
            "{e}"
        );
        assert!(NpyArray::new(vec![], NpyData::U8(vec![])).is_err());
        assert!(NpyArray::new(vec![0, usize::MAX], NpyData::U8(vec![])).is_ok());
        let e = NpyArray::new(vec![usize::MAX, 2], NpyData::U8(vec![])).unwrap_err();
        assert!(matches!(e, NpyError::TooLarge { .. }), "{e}");
        let e = NpyArray::new(vec![1; 65], NpyData::U8(vec![0])).unwrap_err();
        assert!(matches!(e, NpyError::TooManyDims { ndim: 65 }), "{e}");
        let a = arr(vec![2, 2], NpyData::I64(vec![1, 2, 3, 4]));
        assert_eq!((a.len(), a.is_empty(), a.dtype_descr()), (4, false, "<i8"));
    }

    #[test]
    fn typed_accessors() {
        let bits = arr(vec![2], NpyData::U16(vec![0x3f80, 0xc000]));
        let v = bits.into_bf16().unwrap();
        assert_eq!(v, [half::bf16::from_f32(1.0), half::bf16::from_f32(-2.0)]);
        // 1 + 2^-8 is a tie between 1 and 1 + 2^-7: ties to even gives 1;
        // 1 + 3 * 2^-8 is a tie that rounds up to the even 1 + 2^-6.
        let floats = arr(
            vec![3],
            NpyData::F32(vec![1.0 + 1.0 / 256.0, 1.0 + 3.0 / 256.0, 0.1]),
        );
        let v = floats.into_bf16().unwrap();
        assert_eq!(v[0].to_bits(), 0x3f80);
        assert_eq!(v[1].to_bits(), 0x3f82);
        assert_eq!(v[2].to_bits(), 0x3dcd);
        let e = arr(vec![1], NpyData::I64(vec![1])).into_bf16().unwrap_err();
        assert!(
            e.to_string().contains("'<u2'") && e.to_string().contains("found '<i8'"),
            "{e}"
        );

        assert_eq!(
            arr(vec![2], NpyData::I32(vec![-1, 7])).into_i64().unwrap(),
            [-1, 7]
        );
        assert_eq!(
            arr(vec![1], NpyData::I64(vec![i64::MIN]))
                .into_i64()
                .unwrap(),
            [i64::MIN]
        );
        let e = arr(vec![1], NpyData::F32(vec![1.0]))
            .into_i64()
            .unwrap_err();
        assert!(e.to_string().contains("found '<f4'"), "{e}");

        assert_eq!(
            arr(vec![1], NpyData::F32(vec![0.5])).into_f32().unwrap(),
            [0.5]
        );
        let e = arr(vec![1], NpyData::U16(vec![1])).into_f32().unwrap_err();
        assert!(
            e.to_string().contains("expected dtype '<f4'") && e.to_string().contains("'<u2'"),
            "{e}"
        );
    }

    #[test]
    fn file_round_trip_and_errors_name_the_path() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x.npy");
        let a = arr(vec![2, 3], NpyData::I32(vec![0, 1, 2, 3, 4, 5]));
        a.write(&path).unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), I4_2X3);
        assert_eq!(NpyArray::read(&path).unwrap(), a);

        std::fs::write(&path, &I4_2X3[..100]).unwrap();
        let e = NpyArray::read(&path).unwrap_err();
        assert!(
            e.to_string().starts_with(&path.display().to_string()),
            "{e}"
        );
        assert!(e.to_string().contains("truncated"), "{e}");

        let missing = dir.path().join("missing.npy");
        let e = NpyArray::read(&missing).unwrap_err();
        assert!(
            matches!(e, NpyError::Io { .. }) && e.to_string().contains("missing.npy"),
            "{e}"
        );

        let bad = NpyArray {
            shape: vec![3],
            data: NpyData::U8(vec![1]),
        };
        let e = bad.write(&path).unwrap_err();
        assert!(
            matches!(&e, NpyError::InFile { error, .. } if matches!(**error, NpyError::ShapeMismatch { .. })),
            "{e}"
        );
        let e = a.write(&dir.path().join("no/such/dir.npy")).unwrap_err();
        assert!(matches!(e, NpyError::Io { .. }), "{e}");
    }

    // ---- property tests ----

    fn shape_strategy() -> impl Strategy<Value = Vec<usize>> {
        prop::collection::vec(0usize..5, 0..5)
    }

    /// A shape and matching data of the dtype chosen by `values`.
    fn array_strategy() -> impl Strategy<Value = NpyArray> {
        shape_strategy().prop_flat_map(|shape| {
            let n = element_count(&shape).unwrap_or(0);
            let data = prop_oneof![
                prop::collection::vec(any::<bool>(), n).prop_map(NpyData::Bool),
                prop::collection::vec(any::<u8>(), n).prop_map(NpyData::U8),
                prop::collection::vec(any::<u16>(), n).prop_map(NpyData::U16),
                prop::collection::vec(any::<i32>(), n).prop_map(NpyData::I32),
                prop::collection::vec(any::<i64>(), n).prop_map(NpyData::I64),
                // From raw bits so every NaN payload and subnormal appears.
                prop::collection::vec(any::<u32>().prop_map(f32::from_bits), n)
                    .prop_map(NpyData::F32),
            ];
            (Just(shape), data).prop_map(|(shape, data)| NpyArray { shape, data })
        })
    }

    /// Equality that compares f32 by bits (NaN != NaN otherwise).
    fn same(a: &NpyArray, b: &NpyArray) -> bool {
        match (&a.data, &b.data) {
            (NpyData::F32(x), NpyData::F32(y)) => {
                a.shape == b.shape
                    && x.len() == y.len()
                    && x.iter().zip(y).all(|(p, q)| p.to_bits() == q.to_bits())
            }
            _ => a == b,
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        #[test]
        fn round_trip(a in array_strategy()) {
            let bytes = a.to_bytes();
            let header_len = bytes.len() - a.len() * bytes_per(&a);
            prop_assert_eq!(header_len % 64, 0);
            prop_assert_eq!(bytes[header_len - 1], b'\n');
            let back = NpyArray::parse(&bytes).unwrap();
            prop_assert!(same(&a, &back), "{:?} != {:?}", a, back);
        }
    }
}
