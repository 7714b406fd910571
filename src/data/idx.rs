//! IDX files (the MNIST family's format), raw or gzipped.
//!
//! Layout: two zero bytes, a type code, the rank; `rank` big-endian u32 dimensions; then the
//! values, big-endian, row-major. Every check is an [`Error::Format`] naming the file; no
//! buffer is ever sized by a header before the header has been checked against
//! [`MAX_ELEMENTS`] and, for raw files, against the file's length.

use crate::error::{Error, Result};
use flate2::read::GzDecoder;
use std::io::Read;
use std::path::Path;

/// The most values a file may promise (2³⁰, 4 GiB of f32): larger headers are refused.
pub const MAX_ELEMENTS: usize = 1 << 30;
/// The largest rank accepted (MNIST-family sets use 1 and 3).
pub const MAX_RANK: usize = 4;

/// A decoded IDX file.
#[derive(Clone, Debug, PartialEq)]
pub struct Idx {
    /// Dimensions, outermost first.
    pub dims: Vec<usize>,
    /// The values, row-major.
    pub data: IdxData,
}

/// The values of an IDX file, in its element type.
#[derive(Clone, Debug, PartialEq)]
pub enum IdxData {
    U8(Vec<u8>),
    I8(Vec<i8>),
    I16(Vec<i16>),
    I32(Vec<i32>),
    F32(Vec<f32>),
    F64(Vec<f64>),
}

/// Reads an IDX file, gzipped (detected by its magic bytes) or raw.
pub fn read_idx(path: &Path) -> Result<Idx> {
    let bytes = std::fs::read(path).map_err(|source| Error::Io { path: path.to_owned(), source })?;
    parse_idx(&bytes, path)
}

/// Parses IDX bytes (gzipped or raw); `name` is used only in error messages.
pub fn parse_idx(bytes: &[u8], name: &Path) -> Result<Idx> {
    let bad = |what: String| Error::Format { path: name.to_owned(), what };
    if bytes.starts_with(&[0x1f, 0x8b]) {
        // Decompress the header first, check it, then at most the promised data plus one byte
        // (to notice trailing data): a gzip bomb cannot make us allocate more than the header allows.
        let mut gz = GzDecoder::new(bytes);
        let mut head = [0u8; 4];
        gz.read_exact(&mut head).map_err(|e| bad(format!("gzip stream ends or is corrupt before the header: {e}")))?;
        let (elem, rank) = magic(&head, &bad)?;
        let mut dim_bytes = vec![0u8; 4 * rank];
        gz.read_exact(&mut dim_bytes).map_err(|e| bad(format!("gzip stream ends or is corrupt in the dimensions: {e}")))?;
        let (dims, count) = dimensions(&dim_bytes, &bad)?;
        let want = count * elem.size();
        let mut data = Vec::with_capacity(want.min(64 << 20));
        gz.by_ref().take(want as u64 + 1).read_to_end(&mut data).map_err(|e| bad(format!("corrupt gzip stream: {e}")))?;
        check_length(data.len(), want, &bad)?;
        Ok(Idx { data: decode(elem, &data), dims })
    } else {
        let (elem, rank) =
            magic(bytes.get(..4).ok_or_else(|| bad(format!("{} bytes is too short for an IDX header", bytes.len())))?, &bad)?;
        let dim_bytes = bytes.get(4..4 + 4 * rank).ok_or_else(|| bad("the file ends inside the dimensions".into()))?;
        let (dims, count) = dimensions(dim_bytes, &bad)?;
        let data = &bytes[4 + 4 * rank..];
        check_length(data.len(), count * elem.size(), &bad)?;
        Ok(Idx { data: decode(elem, data), dims })
    }
}

/// Reads an image file: u8 values, rank 3 (count, rows, cols). Returns the pixels and the
/// three dimensions.
pub fn read_images(path: &Path) -> Result<(Vec<u8>, usize, usize, usize)> {
    let idx = read_idx(path)?;
    match (idx.data, idx.dims.as_slice()) {
        (IdxData::U8(pixels), &[count, rows, cols]) => Ok((pixels, count, rows, cols)),
        (data, dims) => Err(Error::Format {
            path: path.to_owned(),
            what: format!("expected u8 images of rank 3, found {} of dimensions {dims:?}", type_name(&data)),
        }),
    }
}

/// Reads a label file: u8 values, rank 1.
pub fn read_labels(path: &Path) -> Result<Vec<u8>> {
    let idx = read_idx(path)?;
    match (idx.data, idx.dims.as_slice()) {
        (IdxData::U8(labels), &[_]) => Ok(labels),
        (data, dims) => Err(Error::Format {
            path: path.to_owned(),
            what: format!("expected u8 labels of rank 1, found {} of dimensions {dims:?}", type_name(&data)),
        }),
    }
}

#[derive(Clone, Copy)]
enum Elem {
    U8,
    I8,
    I16,
    I32,
    F32,
    F64,
}

impl Elem {
    fn size(self) -> usize {
        match self {
            Elem::U8 | Elem::I8 => 1,
            Elem::I16 => 2,
            Elem::I32 | Elem::F32 => 4,
            Elem::F64 => 8,
        }
    }
}

fn type_name(data: &IdxData) -> &'static str {
    match data {
        IdxData::U8(_) => "u8",
        IdxData::I8(_) => "i8",
        IdxData::I16(_) => "i16",
        IdxData::I32(_) => "i32",
        IdxData::F32(_) => "f32",
        IdxData::F64(_) => "f64",
    }
}

fn magic(head: &[u8], bad: &dyn Fn(String) -> Error) -> Result<(Elem, usize)> {
    if head[0] != 0 || head[1] != 0 {
        return Err(bad(format!("bad magic number {:02x}{:02x}{:02x}{:02x}: not an IDX file", head[0], head[1], head[2], head[3])));
    }
    let elem = match head[2] {
        0x08 => Elem::U8,
        0x09 => Elem::I8,
        0x0B => Elem::I16,
        0x0C => Elem::I32,
        0x0D => Elem::F32,
        0x0E => Elem::F64,
        code => return Err(bad(format!("unknown IDX type code 0x{code:02x}"))),
    };
    let rank = head[3] as usize;
    if rank == 0 || rank > MAX_RANK {
        return Err(bad(format!("rank {rank} is not in 1..={MAX_RANK}")));
    }
    Ok((elem, rank))
}

fn dimensions(bytes: &[u8], bad: &dyn Fn(String) -> Error) -> Result<(Vec<usize>, usize)> {
    let dims: Vec<usize> = bytes.chunks_exact(4).map(|b| u32::from_be_bytes([b[0], b[1], b[2], b[3]]) as usize).collect();
    if dims.contains(&0) {
        return Err(bad(format!("dimensions {dims:?} include a zero")));
    }
    let count = dims.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d)).filter(|&c| c <= MAX_ELEMENTS);
    let count = count.ok_or_else(|| bad(format!("dimensions {dims:?} promise more than {MAX_ELEMENTS} values")))?;
    Ok((dims, count))
}

fn check_length(have: usize, want: usize, bad: &dyn Fn(String) -> Error) -> Result<()> {
    match have.cmp(&want) {
        std::cmp::Ordering::Less => Err(bad(format!("truncated: the header promises {want} bytes of data, the file has {have}"))),
        std::cmp::Ordering::Greater => Err(bad(format!("{} bytes after the data the header describes", have - want))),
        std::cmp::Ordering::Equal => Ok(()),
    }
}

fn decode(elem: Elem, data: &[u8]) -> IdxData {
    match elem {
        Elem::U8 => IdxData::U8(data.to_vec()),
        Elem::I8 => IdxData::I8(data.iter().map(|&b| b as i8).collect()),
        Elem::I16 => IdxData::I16(data.chunks_exact(2).map(|b| i16::from_be_bytes([b[0], b[1]])).collect()),
        Elem::I32 => IdxData::I32(data.chunks_exact(4).map(|b| i32::from_be_bytes([b[0], b[1], b[2], b[3]])).collect()),
        Elem::F32 => IdxData::F32(data.chunks_exact(4).map(|b| f32::from_be_bytes([b[0], b[1], b[2], b[3]])).collect()),
        Elem::F64 => IdxData::F64(data.chunks_exact(8).map(|b| f64::from_be_bytes(b.try_into().expect("8 bytes"))).collect()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use flate2::{write::GzEncoder, Compression};
    use std::io::Write;

    fn file(code: u8, dims: &[u32], data: &[u8]) -> Vec<u8> {
        let mut out = vec![0, 0, code, dims.len() as u8];
        dims.iter().for_each(|d| out.extend(d.to_be_bytes()));
        out.extend(data);
        out
    }

    fn gzip(bytes: &[u8]) -> Vec<u8> {
        let mut enc = GzEncoder::new(Vec::new(), Compression::fast());
        enc.write_all(bytes).unwrap();
        enc.finish().unwrap()
    }

    fn parse(bytes: &[u8]) -> Result<Idx> {
        parse_idx(bytes, Path::new("test.idx"))
    }

    #[test]
    fn every_type_decodes_big_endian_raw_and_gzipped() {
        let cases = [
            (0x08, vec![1u8, 255], IdxData::U8(vec![1, 255])),
            (0x09, vec![0xff, 2], IdxData::I8(vec![-1, 2])),
            (0x0B, vec![0x01, 0x02, 0xff, 0xfe], IdxData::I16(vec![258, -2])),
            (0x0C, vec![0, 0, 1, 0, 0xff, 0xff, 0xff, 0xff], IdxData::I32(vec![256, -1])),
            (0x0D, [1.5f32.to_be_bytes(), (-2.0f32).to_be_bytes()].concat(), IdxData::F32(vec![1.5, -2.0])),
            (0x0E, [0.25f64.to_be_bytes(), 3.0f64.to_be_bytes()].concat(), IdxData::F64(vec![0.25, 3.0])),
        ];
        for (code, data, want) in cases {
            let raw = file(code, &[2, 1], &data);
            let expected = Idx { dims: vec![2, 1], data: want };
            assert_eq!(parse(&raw).unwrap(), expected);
            assert_eq!(parse(&gzip(&raw)).unwrap(), expected);
        }
    }

    #[test]
    fn corrupt_files_are_errors_that_name_the_file() {
        let good = file(0x08, &[2, 2], &[1, 2, 3, 4]);
        let huge = file(0x0D, &[1 << 20, 1 << 20], &[]);
        let cases: Vec<(Vec<u8>, &str)> = vec![
            (vec![], "too short"),
            (vec![0, 0, 8], "too short"),
            (file(0x08, &[2], &[1, 2]).iter().map(|b| b ^ 0xff).collect(), "bad magic"),
            (file(0x07, &[1], &[1]), "unknown IDX type"),
            (vec![0, 0, 8, 0], "rank 0"),
            (file(0x08, &[1, 1, 1, 1, 1], &[1]), "rank 5"),
            (file(0x08, &[2, 0], &[]), "zero"),
            (huge.clone(), "promise more"),
            (gzip(&huge), "promise more"),
            (good[..good.len() - 1].to_vec(), "truncated"),
            ([good.clone(), vec![9]].concat(), "1 bytes after the data"),
            (gzip(&[good.clone(), vec![9, 9]].concat()), "after the data"),
            (gzip(&good)[..12].to_vec(), "gzip"),
            ([vec![0x1f, 0x8b], vec![0x55; 30]].concat(), "gzip"),
            (file(0x08, &[3], &[1])[..6].to_vec(), "ends inside the dimensions"),
        ];
        for (bytes, needle) in cases {
            let err = parse(&bytes).unwrap_err();
            let msg = err.to_string();
            assert!(matches!(err, Error::Format { .. }), "{msg}");
            assert!(msg.starts_with("test.idx: ") && msg.contains(needle), "{msg:?} lacks {needle:?}");
        }
    }

    #[test]
    fn images_and_labels_check_type_and_rank() {
        let dir = std::env::temp_dir().join(format!("flatnn-idx-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let labels = dir.join("labels.idx");
        std::fs::write(&labels, file(0x08, &[3], &[1, 2, 3])).unwrap();
        assert_eq!(read_labels(&labels).unwrap(), [1, 2, 3]);
        let err = read_images(&labels).unwrap_err().to_string();
        assert!(err.contains("labels.idx") && err.contains("rank 3"), "{err}");
        let floats = dir.join("floats.idx");
        std::fs::write(&floats, file(0x0D, &[1], &1.0f32.to_be_bytes())).unwrap();
        assert!(read_labels(&floats).unwrap_err().to_string().contains("found f32"));
        assert!(matches!(read_idx(&dir.join("absent.idx")), Err(Error::Io { .. })));
    }

    #[test]
    fn real_mnist_files() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("data/mnist");
        let (pixels, count, rows, cols) = read_images(&dir.join("train-images.idx3-ubyte.gz")).unwrap();
        assert_eq!((pixels.len(), count, rows, cols), (60_000 * 784, 60_000, 28, 28));
        let train = read_labels(&dir.join("train-labels.idx1-ubyte.gz")).unwrap();
        let test = read_labels(&dir.join("t10k-labels.idx1-ubyte.gz")).unwrap();
        assert_eq!((train.len(), train[0], test.len(), test[0]), (60_000, 5, 10_000, 7));
        assert!(train.iter().all(|&l| l < 10));
    }
}
