//! Compiled kernels kept between runs: NVRTC takes from a fraction of a second to seconds
//! (11 s for the main program with NVRTC 13.5 on a development machine) to compile flatnn's
//! kernels for a device (the main program, and each recurrent fused module on first need), so
//! each machine code it gives is written to a file, and a later process that would compile the
//! same program reads it instead.
//!
//! A file holds a header naming everything that went into the code (the program's name, the
//! architecture, NVRTC's options and its major.minor version, the source's length and two
//! 64-bit hashes of it), a line with the code's length and hash, and then the code (a cubin: an
//! ELF image). It is used only where its header is the one the program at hand would have and
//! its code has the length and hash its line states and starts as an ELF image does; anything
//! else (a file cut short, a damaged one, another program's) is compiled again and the file
//! replaced. Files are written whole under a name of their own (process and call) and then
//! renamed, so a process never reads one half written. A directory that cannot be made, read
//! or written leaves the kernels to be compiled, as they would be without it: nothing here
//! fails a program.
//!
//! The cache keeps [`KEEP`] files of each program as compiled for one device with the same
//! options and NVRTC (each a version of its source), the most recently used: a file read is
//! marked used, and writing a new one removes the least recently used past [`KEEP`], and any
//! file of the same program another process began to write over an hour ago and never renamed
//! (it died writing). So a new version of flatnn's kernels replaces the old ones as it is used,
//! and a few versions used in turn on one machine keep theirs.
//!
//! Where: `FLATNN_KERNEL_CACHE` (a directory; `off`, `0`, `no` or `false` for none), else
//! `$XDG_CACHE_HOME/flatnn`, else `$HOME/.cache/flatnn`; directories it makes are its user's
//! alone (mode 0700). Deleting the directory empties the cache (do so after a patch update of
//! NVRTC, whose version the key holds as major.minor only: all NVRTC reports). The code in a
//! file runs on the GPU as it is: a directory others can write is not one to use.

use crate::error::Result;
use std::collections::hash_map::DefaultHasher;
use std::ffi::OsString;
use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// The first bytes of a file of this format.
const MAGIC: &str = "flatnn kernels 2";

/// Files kept of each program variant (name, device, options, NVRTC), the most recently used.
const KEEP: usize = 3;

/// How old a file begun and never renamed must be to count as left by a process that died
/// writing it (a write takes milliseconds).
const ABANDONED: std::time::Duration = std::time::Duration::from_secs(3600);

/// The start of every ELF image (a cubin is one).
const ELF: &[u8] = b"\x7fELF";

/// What a program's machine code is compiled from, as a file's header states it.
pub(crate) struct Key {
    /// The program's name (its NVRTC name, `flatnn_kernels.cu`, `rnn_fused.cu`).
    pub name: String,
    /// Compute capability.
    pub cc: (i32, i32),
    /// NVRTC's options, in order.
    pub options: Vec<String>,
    /// NVRTC's version (major, minor).
    pub nvrtc: (i32, i32),
    /// The source text.
    pub source: String,
}

impl Key {
    /// The header line: every part of the key, the source by its length and two hashes.
    fn header(&self) -> String {
        format!(
            "{MAGIC}; {}; sm_{}{}; nvrtc {}.{}; {:?}; source {} bytes {:016x}{:016x}\n",
            self.name,
            self.cc.0,
            self.cc.1,
            self.nvrtc.0,
            self.nvrtc.1,
            self.options,
            self.source.len(),
            hash(1, &self.source),
            hash(2, &self.source)
        )
    }

    /// The start of the names of the files of this program variant (everything in the key but
    /// the source): the program's name, the architecture and a hash of the rest.
    fn variant(&self) -> String {
        let stem = self.name.trim_end_matches(".cu");
        let rest = hash(3, &(&self.name, self.cc, &self.options, self.nvrtc));
        format!("{stem}-sm_{}{}-{rest:016x}-", self.cc.0, self.cc.1)
    }

    /// The file's name: [`Key::variant`], then a hash of the header.
    fn file_name(&self, header: &str) -> String {
        format!("{}{:016x}.cubin", self.variant(), hash(0, header))
    }
}

/// A 64-bit hash of `value`, one of a family chosen by `seed`.
fn hash<T: Hash + ?Sized>(seed: u64, value: &T) -> u64 {
    let mut h = DefaultHasher::new();
    seed.hash(&mut h);
    value.hash(&mut h);
    h.finish()
}

/// The cache's directory from the environment's values of `FLATNN_KERNEL_CACHE`,
/// `XDG_CACHE_HOME` and `HOME`, in that order of preference (`off`, `0`, `no` or `false` for the
/// first, in any case: none; an empty value counts as unset).
pub(crate) fn directory(setting: Option<OsString>, xdg: Option<OsString>, home: Option<OsString>) -> Option<PathBuf> {
    let given = |v: Option<OsString>| v.filter(|v| !v.is_empty());
    let off = |v: &OsString| v.to_str().is_some_and(|v| ["off", "0", "no", "false"].contains(&v.to_ascii_lowercase().as_str()));
    match given(setting) {
        Some(v) if off(&v) => None,
        Some(v) => Some(PathBuf::from(v)),
        None => given(xdg).map(|x| PathBuf::from(x).join("flatnn")).or_else(|| given(home).map(|h| PathBuf::from(h).join(".cache/flatnn"))),
    }
}

/// [`directory`] from this process's environment.
pub(crate) fn directory_from_env() -> Option<PathBuf> {
    directory(std::env::var_os("FLATNN_KERNEL_CACHE"), std::env::var_os("XDG_CACHE_HOME"), std::env::var_os("HOME"))
}

/// The machine code of `key`: read from its file in `dir` where that holds it, else
/// `compile()`'s, then written there (`dir` None: compiled, nothing read or written).
pub(crate) fn cached(dir: Option<&Path>, key: &Key, compile: impl FnOnce() -> Result<Vec<u8>>) -> Result<Vec<u8>> {
    let Some(dir) = dir else { return compile() };
    let header = key.header();
    let path = dir.join(key.file_name(&header));
    if let Some(code) = read(&path, &header) {
        mark_used(&path);
        return Ok(code);
    }
    let code = compile()?;
    if write(dir, &path, &header, &code) {
        prune(dir, &key.variant());
    }
    Ok(code)
}

/// The file's modification time set to now (what [`prune`] orders by); a failure is ignored.
fn mark_used(path: &Path) {
    if let Ok(file) = std::fs::File::options().write(true).open(path) {
        let _ = file.set_modified(std::time::SystemTime::now());
    }
}

/// Of the files in `dir` whose names start with `variant`, removes the finished ones past the
/// [`KEEP`] most recently modified and those begun over [`ABANDONED`] ago and never finished;
/// failures are ignored (another process may be removing them too).
fn prune(dir: &Path, variant: &str) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    let now = std::time::SystemTime::now();
    let mut finished = Vec::new();
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(name) = name.to_str().filter(|n| n.starts_with(variant)) else { continue };
        let Ok(modified) = entry.metadata().and_then(|m| m.modified()) else { continue };
        if name.ends_with(".cubin") {
            finished.push((modified, entry.path()));
        } else if name.contains(".partial.") && now.duration_since(modified).is_ok_and(|age| age > ABANDONED) {
            let _ = std::fs::remove_file(entry.path());
        }
    }
    finished.sort_by_key(|&(modified, _)| std::cmp::Reverse(modified));
    for (_, path) in finished.iter().skip(KEEP) {
        let _ = std::fs::remove_file(path);
    }
}

/// The line after the header: the code's length and hash.
fn code_line(code: &[u8]) -> String {
    format!("code {} bytes {:016x}\n", code.len(), hash(0, code))
}

/// The code in `path` where the file starts with `header`, then the code's line, and the code
/// is an ELF image.
fn read(path: &Path, header: &str) -> Option<Vec<u8>> {
    let bytes = std::fs::read(path).ok()?;
    let rest = bytes.strip_prefix(header.as_bytes())?;
    let end = rest.iter().position(|&b| b == b'\n')? + 1;
    let (line, code) = rest.split_at(end);
    (line == code_line(code).as_bytes() && code.starts_with(ELF)).then(|| code.to_vec())
}

/// `header`, the code's line and `code` into `path`, through a file of a name of its own
/// (process and call) renamed onto it; whether that was done. A failure leaves no file behind
/// where it can and is otherwise ignored.
fn write(dir: &Path, path: &Path, header: &str, code: &[u8]) -> bool {
    static CALLS: AtomicU64 = AtomicU64::new(0);
    let call = CALLS.fetch_add(1, Ordering::Relaxed);
    let partial = path.with_extension(format!("partial.{}.{call}", std::process::id()));
    let contents = [header.as_bytes(), code_line(code).as_bytes(), code].concat();
    let written = make_dir(dir).and_then(|()| std::fs::write(&partial, contents)).and_then(|()| std::fs::rename(&partial, path));
    if written.is_err() {
        let _ = std::fs::remove_file(&partial);
    }
    written.is_ok()
}

/// `dir` and its missing parents, those it makes its user's alone (mode 0700 on Unix).
fn make_dir(dir: &Path) -> std::io::Result<()> {
    let mut builder = std::fs::DirBuilder::new();
    builder.recursive(true);
    #[cfg(unix)]
    std::os::unix::fs::DirBuilderExt::mode(&mut builder, 0o700);
    builder.create(dir)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    fn key(source: &str) -> Key {
        Key { name: "k.cu".into(), cc: (9, 0), options: vec!["--fmad=false".into()], nvrtc: (13, 0), source: source.into() }
    }

    /// A fresh directory under the system's temporary one.
    fn scratch(what: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("flatnn-kernel-cache-{what}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        dir
    }

    /// A compiler that counts its calls and gives an ELF image holding `tag`.
    fn counting<'a>(calls: &'a Cell<usize>, tag: &'a str) -> impl Fn() -> Result<Vec<u8>> + 'a {
        move || {
            calls.set(calls.get() + 1);
            Ok([ELF, tag.as_bytes()].concat())
        }
    }

    /// The first call compiles and writes a file (in a directory it makes with mode 0700); the
    /// next with the same key reads it (no compile, the same bytes); a key that differs in any
    /// part compiles again into a file of its own.
    #[test]
    fn a_second_call_reads_what_the_first_compiled() {
        let dir = scratch("reuse");
        let calls = Cell::new(0);
        let first = cached(Some(&dir), &key("a"), counting(&calls, "a")).unwrap();
        let second = cached(Some(&dir), &key("a"), counting(&calls, "other")).unwrap();
        assert_eq!((calls.get(), &first), (1, &second));
        let variants = [
            key("b"),
            Key { cc: (8, 0), ..key("a") },
            Key { options: vec![], ..key("a") },
            Key { nvrtc: (13, 1), ..key("a") },
            Key { name: "j.cu".into(), ..key("a") },
        ];
        for (i, variant) in variants.iter().enumerate() {
            let code = cached(Some(&dir), variant, counting(&calls, "v")).unwrap();
            assert_eq!((calls.get(), code), (2 + i, [ELF, b"v"].concat()), "variant {i}");
        }
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 6, "a file a key, none left partial");
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            assert_eq!(std::fs::metadata(&dir).unwrap().permissions().mode() & 0o777, 0o700, "the directory its user's alone");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A file whose header is not the key's, cut short (by a value, or into its code's line), with
    /// a value of its code changed, or whose code is not an ELF image is compiled again and
    /// replaced.
    #[test]
    fn a_file_that_does_not_match_is_compiled_again() {
        let dir = scratch("damaged");
        let calls = Cell::new(0);
        let k = key("a");
        cached(Some(&dir), &k, counting(&calls, "a")).unwrap();
        let path = std::fs::read_dir(&dir).unwrap().next().unwrap().unwrap().path();
        let good = std::fs::read(&path).unwrap();
        let header = k.header().len();
        let mut other_header = good.clone();
        other_header[header - 2] ^= 1;
        let mut flipped = good.clone();
        *flipped.last_mut().unwrap() ^= 1;
        let elf_only = [&good[..header], code_line(ELF).as_bytes(), ELF].concat();
        let damaged = [
            other_header,
            good[..good.len() - 1].to_vec(),
            flipped,
            good[..header + 2].to_vec(),
            [&good[..header], code_line(b"not elf").as_bytes(), b"not elf"].concat(),
            Vec::new(),
        ];
        assert_eq!(read(&path, &k.header()), Some([ELF, b"a"].concat()), "the good file reads");
        std::fs::write(&path, &elf_only).unwrap();
        assert_eq!(read(&path, &k.header()), Some(ELF.to_vec()), "any ELF image with its line reads");
        for (i, bytes) in damaged.into_iter().enumerate() {
            std::fs::write(&path, bytes).unwrap();
            let code = cached(Some(&dir), &k, counting(&calls, "a")).unwrap();
            assert_eq!((calls.get(), code), (2 + i, [ELF, b"a"].concat()), "damage {i}");
            assert_eq!(std::fs::read(&path).unwrap(), good, "damage {i}: the file replaced");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// Writing a new version of a program's code keeps the [`KEEP`] most recently used of its
    /// variant (a read counts as a use), removes its files begun over [`ABANDONED`] ago and never
    /// finished, and leaves other variants' files and fresh partial ones alone.
    #[test]
    fn a_new_version_replaces_the_least_recently_used() {
        let dir = scratch("prune");
        let calls = Cell::new(0);
        let other = Key { options: vec![], ..key("other") };
        cached(Some(&dir), &other, counting(&calls, "o")).unwrap();
        let now = std::time::SystemTime::now();
        let age = |path: &Path, secs: u64| {
            std::fs::File::options().write(true).open(path).unwrap().set_modified(now - std::time::Duration::from_secs(secs)).unwrap()
        };
        let file = |k: &Key| dir.join(k.file_name(&k.header()));
        // versions a, b, c of the source, written in turn; then a read again, so b is the least recently used
        for (i, source) in ["a", "b", "c"].into_iter().enumerate() {
            cached(Some(&dir), &key(source), counting(&calls, source)).unwrap();
            age(&file(&key(source)), 30 - 10 * i as u64);
        }
        age(&file(&other), 100);
        cached(Some(&dir), &key("a"), counting(&calls, "a")).unwrap();
        assert_eq!(calls.get(), 4, "a read from its file");
        let variant = key("a").variant();
        let (stale, fresh) = (dir.join(format!("{variant}0.partial.1.0")), dir.join(format!("{variant}0.partial.1.1")));
        for partial in [&stale, &fresh] {
            std::fs::write(partial, b"half").unwrap();
        }
        age(&stale, ABANDONED.as_secs() + 60);
        cached(Some(&dir), &key("d"), counting(&calls, "d")).unwrap();
        let mut names: Vec<String> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
        names.sort();
        let mut expected: Vec<String> = [key("a"), key("c"), key("d"), other]
            .iter()
            .map(|k| k.file_name(&k.header()))
            .chain([fresh.file_name().unwrap().to_str().unwrap().to_string()])
            .collect();
        expected.sort();
        assert_eq!(names, expected, "b and the abandoned partial file removed");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// Without a directory every call compiles; a directory that cannot be made (its parent is
    /// a file) compiles too and fails nothing; a compiler's error is the call's.
    #[test]
    fn no_directory_or_an_unusable_one_compiles() {
        let calls = Cell::new(0);
        for _ in 0..2 {
            cached(None, &key("a"), counting(&calls, "a")).unwrap();
        }
        assert_eq!(calls.get(), 2);
        let file = scratch("file");
        std::fs::write(&file, b"a file").unwrap();
        let under = file.join("cache");
        for _ in 0..2 {
            assert_eq!(cached(Some(&under), &key("a"), counting(&calls, "a")).unwrap(), [ELF, b"a"].concat());
        }
        assert_eq!(calls.get(), 4);
        let failing = || Err(crate::error::Error::Cuda { what: "no compiler".into() });
        assert!(cached(Some(&scratch("failing")), &key("a"), failing).is_err());
        std::fs::remove_file(&file).unwrap();
    }

    /// `FLATNN_KERNEL_CACHE` names the directory (`off`, `0`, `no`, `false` in any case: none),
    /// else `$XDG_CACHE_HOME/flatnn`, else `$HOME/.cache/flatnn`, else none; an empty value
    /// counts as unset.
    #[test]
    fn the_directory_comes_from_the_environment() {
        let os = |s: &str| Some(OsString::from(s));
        assert_eq!(directory(os("/c"), os("/x"), os("/h")), Some(PathBuf::from("/c")));
        for off in ["off", "OFF", "0", "no", "false", "False"] {
            assert_eq!(directory(os(off), os("/x"), os("/h")), None, "{off}");
        }
        assert_eq!(directory(os("cache"), None, None), Some(PathBuf::from("cache")));
        assert_eq!(directory(os(""), os("/x"), os("/h")), Some(PathBuf::from("/x/flatnn")));
        assert_eq!(directory(None, os(""), os("/h")), Some(PathBuf::from("/h/.cache/flatnn")));
        assert_eq!(directory(None, None, None), None);
    }
}
