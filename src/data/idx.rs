//! IDX files (the MNIST family's format), raw or gzipped.
//!
//! Layout: two zero bytes, a type code, the rank; `rank` big-endian u32 dimensions; then the
//! values, big-endian, row-major. Every check is an [`Error::Format`] naming the file; no
//! buffer is ever sized by a header before the header has been checked against
//! [`MAX_ELEMENTS`] and, for raw files, against the file's length.

use crate::error::{Error, Result};
use flate2::bufread::MultiGzDecoder;
use std::cmp::Ordering;
use std::fs::File;
use std::io::{self, BufRead, BufReader, ErrorKind, Read};
use std::path::Path;

/// The most values a file may promise (2³⁰, 4 GiB of f32): larger headers are refused.
pub const MAX_ELEMENTS: usize = 1 << 30;
/// The largest rank accepted (MNIST-family sets use 1 and 3).
pub const MAX_RANK: usize = 4;

/// The first two bytes of every gzip stream.
const GZIP_MAGIC: [u8; 2] = [0x1f, 0x8b];
/// Where the length of the data is not known in advance (gzip, pipes), the buffer starts at most
/// this large and grows only as decompressed bytes arrive.
const FIRST_CHUNK: usize = 64 << 20;

/// A decoded IDX file.
#[derive(Clone, Debug, PartialEq)]
pub struct Idx {
    /// Dimensions, outermost first; none is zero and their product is at most [`MAX_ELEMENTS`].
    pub dims: Vec<usize>,
    /// The values, row-major; as many as the product of `dims`.
    pub data: IdxData,
}

/// The values of an IDX file, in its element type (the type code in the header).
#[derive(Clone, Debug, PartialEq)]
pub enum IdxData {
    /// Type code 0x08.
    U8(Vec<u8>),
    /// Type code 0x09.
    I8(Vec<i8>),
    /// Type code 0x0B, big-endian in the file.
    I16(Vec<i16>),
    /// Type code 0x0C, big-endian in the file.
    I32(Vec<i32>),
    /// Type code 0x0D, big-endian in the file.
    F32(Vec<f32>),
    /// Type code 0x0E, big-endian in the file.
    F64(Vec<f64>),
}

/// Reads an IDX file, gzipped (detected by its magic bytes 1f 8b) or raw.
///
/// The file is streamed: a raw file's header is checked against its length, and a gzipped
/// file's against [`MAX_ELEMENTS`], before the data is read, and at most the promised data plus
/// one byte is ever decompressed.
pub fn read_idx(path: &Path) -> Result<Idx> {
    let io_err = |source| Error::Io { path: path.to_owned(), source };
    let file = File::open(path).map_err(io_err)?;
    let meta = file.metadata().map_err(io_err)?;
    // Only a regular file's length is known in advance (not a pipe's or a device's).
    let len = meta.is_file().then_some(meta.len());
    parse_stream(BufReader::new(file), len, path)
}

/// Parses IDX bytes (gzipped or raw), with the same checks as [`read_idx`]; `name` is used only
/// in error messages.
pub fn parse_idx(bytes: &[u8], name: &Path) -> Result<Idx> {
    parse_stream(bytes, Some(bytes.len() as u64), name)
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

/// `len`: the source's length in bytes where known (raw files are checked against it).
fn parse_stream(mut src: impl BufRead, len: Option<u64>, name: &Path) -> Result<Idx> {
    // A slice, or a BufReader's first fill of a regular file, holds both magic bytes.
    let start = src.fill_buf().map_err(|source| Error::Io { path: name.to_owned(), source })?;
    if start.starts_with(&GZIP_MAGIC) {
        // Multi-member: a second gzip member after the first is decompressed (and then refused
        // as trailing data) rather than silently ignored.
        body(MultiGzDecoder::new(src), None, true, name)
    } else {
        body(src, len, false, name)
    }
}

/// Reads header, dimensions and data from the (decompressed) stream; `len`: its length where
/// known in advance; `gz`: whether it is being decompressed (for error messages).
fn body(mut src: impl Read, len: Option<u64>, gz: bool, name: &Path) -> Result<Idx> {
    let mut head = [0u8; 4];
    src.read_exact(&mut head).map_err(|e| read_error(e, gz, "header", name))?;
    let (elem, rank) = magic(&head, name)?;
    let mut dim_bytes = [0u8; 4 * MAX_RANK];
    let dim_bytes = &mut dim_bytes[..4 * rank];
    src.read_exact(dim_bytes).map_err(|e| read_error(e, gz, "dimensions", name))?;
    let (dims, want) = dimensions(dim_bytes, elem, name)?;
    if let Some(len) = len {
        check_length(len.saturating_sub(4 + 4 * rank as u64), want, name)?;
    }
    // Checked against MAX_ELEMENTS (and for raw sources against their length) above.
    let mut data = Vec::with_capacity(if len.is_some() { want } else { want.min(FIRST_CHUNK) });
    src.by_ref().take(want as u64).read_to_end(&mut data).map_err(|e| read_error(e, gz, "data", name))?;
    check_length(data.len() as u64, want, name)?;
    // One byte more: trailing data, or (gzip) a bad checksum, a further member, or garbage.
    match src.read(&mut [0u8; 1]) {
        Ok(0) => {}
        Ok(_) => return Err(bad(name, "more bytes after the data the header describes".into())),
        Err(e) => return Err(read_error(e, gz, "trailer after the data", name)),
    }
    Ok(Idx { data: decode(elem, data), dims })
}

/// A failed read: the stream ending early or corrupt gzip is a format error, anything else an
/// I/O error.
fn read_error(source: io::Error, gz: bool, part: &str, name: &Path) -> Error {
    let what = match (source.kind(), gz) {
        (ErrorKind::UnexpectedEof, false) => format!("the file ends inside the {part}: too short for an IDX file"),
        (ErrorKind::UnexpectedEof, true) => format!("the gzip stream ends inside the {part}"),
        (ErrorKind::InvalidData | ErrorKind::InvalidInput, true) => format!("corrupt gzip stream in the {part}: {source}"),
        _ => return Error::Io { path: name.to_owned(), source },
    };
    Error::Format { path: name.to_owned(), what }
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

fn bad(name: &Path, what: String) -> Error {
    Error::Format { path: name.to_owned(), what }
}

/// Checks the 4-byte magic: two zero bytes, a known type code, a rank in 1..=MAX_RANK.
fn magic(head: &[u8; 4], name: &Path) -> Result<(Elem, usize)> {
    if head[..2] != [0, 0] {
        let [a, b, c, d] = *head;
        return Err(bad(name, format!("bad magic number {a:02x}{b:02x}{c:02x}{d:02x}: not an IDX file")));
    }
    let elem = match head[2] {
        0x08 => Elem::U8,
        0x09 => Elem::I8,
        0x0B => Elem::I16,
        0x0C => Elem::I32,
        0x0D => Elem::F32,
        0x0E => Elem::F64,
        code => return Err(bad(name, format!("unknown IDX type code 0x{code:02x}"))),
    };
    let rank = head[3] as usize;
    if rank == 0 || rank > MAX_RANK {
        return Err(bad(name, format!("rank {rank} is not in 1..={MAX_RANK}")));
    }
    Ok((elem, rank))
}

/// Decodes `rank` big-endian u32 dimensions; returns them and the data's length in bytes.
fn dimensions(bytes: &[u8], elem: Elem, name: &Path) -> Result<(Vec<usize>, usize)> {
    let dims: Vec<usize> = bytes.chunks_exact(4).map(|b| u32::from_be_bytes([b[0], b[1], b[2], b[3]]) as usize).collect();
    if dims.contains(&0) {
        return Err(bad(name, format!("dimensions {dims:?} include a zero: the file holds no values")));
    }
    let count = dims.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d)).filter(|&c| c <= MAX_ELEMENTS);
    let count = count.ok_or_else(|| bad(name, format!("dimensions {dims:?} promise more than {MAX_ELEMENTS} values")))?;
    let bytes = count.checked_mul(elem.size());
    let bytes = bytes.ok_or_else(|| bad(name, format!("dimensions {dims:?} promise more bytes than this machine can address")))?;
    Ok((dims, bytes))
}

/// `have`: bytes after the header; `want`: bytes the header promises.
fn check_length(have: u64, want: usize, name: &Path) -> Result<()> {
    let want = want as u64;
    match have.cmp(&want) {
        Ordering::Less => Err(bad(name, format!("truncated: the header promises {want} bytes of data, only {have} follow it"))),
        Ordering::Greater => Err(bad(name, format!("{} bytes after the data the header describes", have - want))),
        Ordering::Equal => Ok(()),
    }
}

/// Big-endian bytes to values; `data.len()` is a multiple of `elem.size()`.
fn decode(elem: Elem, data: Vec<u8>) -> IdxData {
    debug_assert_eq!(data.len() % elem.size(), 0);
    fn be<const N: usize, T>(data: &[u8], from: fn([u8; N]) -> T) -> Vec<T> {
        data.chunks_exact(N).map(|b| from(b.try_into().expect("chunks_exact yields N bytes"))).collect()
    }
    match elem {
        Elem::U8 => IdxData::U8(data),
        Elem::I8 => IdxData::I8(data.iter().map(|&b| b as i8).collect()),
        Elem::I16 => IdxData::I16(be(&data, i16::from_be_bytes)),
        Elem::I32 => IdxData::I32(be(&data, i32::from_be_bytes)),
        Elem::F32 => IdxData::F32(be(&data, f32::from_be_bytes)),
        Elem::F64 => IdxData::F64(be(&data, f64::from_be_bytes)),
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
        let gz = gzip(&good);
        let n = gz.len();
        let flip = |i: usize| {
            let mut bytes = gz.clone();
            bytes[i] ^= 0x40;
            bytes
        };
        // 2⁴⁰ f32 values: refused from the header alone, before anything is allocated or read.
        let huge = file(0x0D, &[1 << 20, 1 << 20], &[]);
        let cases: Vec<(Vec<u8>, &str)> = vec![
            (vec![], "too short"),
            (vec![0, 0, 8], "too short"),
            (file(0x08, &[2], &[1, 2]).iter().map(|b| b ^ 0xff).collect(), "bad magic"),
            (file(0x07, &[1], &[1]), "unknown IDX type code 0x07"),
            (vec![0, 0, 8, 0], "rank 0"),
            (file(0x08, &[1, 1, 1, 1, 1], &[1]), "rank 5"),
            (file(0x08, &[2, 0], &[]), "include a zero"),
            (huge.clone(), "promise more"),
            (gzip(&huge), "promise more"),
            (file(0x0E, &[u32::MAX; 4], &[]), "promise more"),
            // Exactly MAX_ELEMENTS is allowed, so this gets as far as the length check.
            (file(0x08, &[1 << 15, 1 << 15], &[1]), "truncated"),
            (gzip(&file(0x08, &[1 << 15, 1 << 15], &[1])), "truncated"),
            (good[..good.len() - 1].to_vec(), "truncated"),
            (gzip(&good[..good.len() - 1]), "truncated"),
            ([good.clone(), vec![9]].concat(), "1 bytes after the data"),
            (gzip(&[good.clone(), vec![9, 9]].concat()), "more bytes after the data"),
            ([gz.clone(), gzip(&[9])].concat(), "more bytes after the data"),
            ([gz.clone(), vec![0x55; 30]].concat(), "gzip"),
            (gz[..12].to_vec(), "gzip stream ends inside the header"),
            (gz[..n - 4].to_vec(), "gzip stream ends inside the trailer"),
            (flip(n - 8), "checksum"),
            (flip(n - 10), "gzip"),
            ([vec![0x1f, 0x8b], vec![0x55; 30]].concat(), "corrupt gzip"),
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
    fn sources_of_unknown_length_are_checked_as_they_are_read() {
        let good = file(0x0B, &[2], &[0x80, 0, 0, 1]);
        let name = Path::new("pipe");
        let unknown = |bytes: &[u8]| parse_stream(bytes, None, name);
        assert_eq!(unknown(&good).unwrap(), Idx { dims: vec![2], data: IdxData::I16(vec![i16::MIN, 1]) });
        assert!(unknown(&good[..good.len() - 1]).unwrap_err().to_string().contains("truncated"));
        assert!(unknown(&[good.clone(), vec![0]].concat()).unwrap_err().to_string().contains("after the data"));
        // A header promising MAX_ELEMENTS u8 over a pipe: the buffer starts at FIRST_CHUNK.
        assert!(unknown(&file(0x08, &[1 << 15, 1 << 15], &[1, 2])).unwrap_err().to_string().contains("truncated"));
    }

    #[test]
    fn files_on_disk_and_images_and_labels_check_type_and_rank() {
        let dir = std::env::temp_dir().join(format!("flatnn-idx-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let labels = dir.join("labels.idx");
        std::fs::write(&labels, file(0x08, &[3], &[1, 2, 3])).unwrap();
        assert_eq!(read_labels(&labels).unwrap(), [1, 2, 3]);
        let err = read_images(&labels).unwrap_err().to_string();
        assert!(err.contains("labels.idx") && err.contains("rank 3"), "{err}");
        let images = dir.join("images.idx.gz");
        std::fs::write(&images, gzip(&file(0x08, &[2, 1, 3], &[0, 1, 2, 3, 4, 5]))).unwrap();
        assert_eq!(read_images(&images).unwrap(), (vec![0, 1, 2, 3, 4, 5], 2, 1, 3));
        assert!(read_labels(&images).unwrap_err().to_string().contains("rank 1"));
        let floats = dir.join("floats.idx");
        std::fs::write(&floats, file(0x0D, &[1], &1.0f32.to_be_bytes())).unwrap();
        assert!(read_labels(&floats).unwrap_err().to_string().contains("found f32"));
        let truncated = dir.join("truncated.idx");
        std::fs::write(&truncated, file(0x0C, &[1 << 20], &[0; 7])).unwrap();
        let err = read_idx(&truncated).unwrap_err().to_string();
        assert!(err.contains("truncated.idx") && err.contains("truncated"), "{err}");
        assert!(matches!(read_idx(&dir.join("absent.idx")), Err(Error::Io { .. })));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn real_mnist_files() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("data/mnist");
        let (pixels, count, rows, cols) = read_images(&dir.join("train-images.idx3-ubyte.gz")).unwrap();
        assert_eq!((pixels.len(), count, rows, cols), (60_000 * 784, 60_000, 28, 28));
        let (pixels, count, rows, cols) = read_images(&dir.join("t10k-images.idx3-ubyte.gz")).unwrap();
        assert_eq!((pixels.len(), count, rows, cols), (10_000 * 784, 10_000, 28, 28));
        let train = read_labels(&dir.join("train-labels.idx1-ubyte.gz")).unwrap();
        let test = read_labels(&dir.join("t10k-labels.idx1-ubyte.gz")).unwrap();
        assert_eq!((train.len(), train[0], test.len(), test[0]), (60_000, 5, 10_000, 7));
        assert!(train.iter().chain(&test).all(|&l| l < 10));
        let err = read_images(&dir.join("t10k-labels.idx1-ubyte.gz")).unwrap_err().to_string();
        assert!(err.contains("t10k-labels.idx1-ubyte.gz") && err.contains("expected u8 images of rank 3"), "{err}");
    }
}
