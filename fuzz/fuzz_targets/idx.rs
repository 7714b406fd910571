//! IDX reader: any bytes, raw or gzipped, must give `Ok` or `Err`, never a panic, a hang or an
//! allocation sized by an unchecked header.
#![no_main]

use libfuzzer_sys::fuzz_target;
use std::path::Path;

fuzz_target!(|data: &[u8]| {
    let _ = flatnn::data::idx::parse_idx(data, Path::new("fuzz"));
});
