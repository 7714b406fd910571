//! NCCL, loaded at run time: the communicators of a data-parallel group, and the reduction a
//! replica's step graph runs between its backward pass and its update.
//!
//! The library is opened on first use as `libnccl.so.2` (NCCL's soname, the one name its Debian
//! packages and Python wheels all ship) or `libnccl.so`; where neither loads, every call here
//! is an [`Error::Cuda`] saying so, and nothing else in flatnn needs NCCL. (cudarc's loader
//! looks for neither name.) NCCL 2.11 or later: the step's reduction is a pre-multiplied sum.
//!
//! Nothing here sets NCCL's environment: NVLink multicast stays as the machine sets it
//! (`NCCL_NVLS_ENABLE`), and flatnn never calls the driver's multicast API.

use super::buffer::DevBuf;
use super::context::Gpu;
use crate::error::{Error, Result};
use cudarc::driver::{sys, CudaStream};
use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

/// `ncclComm_t`.
type RawComm = *mut c_void;
/// `ncclResult_t`, `ncclDataType_t`, `ncclRedOp_t`, `ncclScalarResidence_t`: C enums, int-sized;
/// kept as ints so that a value this code does not know is not undefined behaviour.
type Status = c_int;
const SUCCESS: Status = 0;
const IN_PROGRESS: Status = 7;
const FLOAT32: c_int = 7;
const FLOAT64: c_int = 8;
const SUM: c_int = 0;
const SCALAR_HOST_IMMEDIATE: c_int = 1;
/// NCCL_VERSION(2, 11, 0): the first with `ncclRedOpCreatePreMulSum`.
const MIN_VERSION: c_int = 21100;

/// `ncclUniqueId`: what every rank needs to join one communicator (rank 0 makes it).
#[repr(C)]
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) struct UniqueId(pub [u8; UNIQUE_ID_BYTES]);

/// NCCL_UNIQUE_ID_BYTES.
pub(crate) const UNIQUE_ID_BYTES: usize = 128;

/// The entry points flatnn uses, from the library that stays loaded with them.
struct Api {
    version: c_int,
    get_unique_id: unsafe extern "C" fn(*mut UniqueId) -> Status,
    comm_init_all: unsafe extern "C" fn(*mut RawComm, c_int, *const c_int) -> Status,
    comm_init_rank: unsafe extern "C" fn(*mut RawComm, c_int, UniqueId, c_int) -> Status,
    comm_destroy: unsafe extern "C" fn(RawComm) -> Status,
    comm_abort: unsafe extern "C" fn(RawComm) -> Status,
    comm_get_async_error: unsafe extern "C" fn(RawComm, *mut Status) -> Status,
    get_error_string: unsafe extern "C" fn(Status) -> *const c_char,
    all_reduce: unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, c_int, RawComm, sys::CUstream) -> Status,
    broadcast: unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, c_int, RawComm, sys::CUstream) -> Status,
    group_start: unsafe extern "C" fn() -> Status,
    group_end: unsafe extern "C" fn() -> Status,
    red_op_create_pre_mul_sum: unsafe extern "C" fn(*mut c_int, *mut c_void, c_int, c_int, RawComm) -> Status,
    red_op_destroy: unsafe extern "C" fn(c_int, RawComm) -> Status,
    _lib: libloading::Library,
}

/// NCCL's entry points, loaded once per process; an [`Error::Cuda`] where the library is
/// missing, too old or lacks one of them.
fn api() -> Result<&'static Api> {
    static API: OnceLock<std::result::Result<Api, String>> = OnceLock::new();
    API.get_or_init(load).as_ref().map_err(|what| Error::Cuda { what: what.clone() })
}

fn load() -> std::result::Result<Api, String> {
    let mut tried = Vec::new();
    for name in ["libnccl.so.2", "libnccl.so"] {
        // SAFETY: loading NCCL runs only its own initialisers.
        match unsafe { libloading::Library::new(name) } {
            Ok(lib) => return bind(lib),
            Err(e) => tried.push(format!("{name}: {e}")),
        }
    }
    Err(format!(
        "libnccl not found ({}): put the folder that holds libnccl.so.2 (for example site-packages/nvidia/nccl/lib, \
         or nvidia/cu13/lib, of a Python environment with PyTorch) on LD_LIBRARY_PATH",
        tried.join("; ")
    ))
}

fn bind(lib: libloading::Library) -> std::result::Result<Api, String> {
    macro_rules! entry {
        ($name:literal) => {
            // SAFETY: the type is the function's C prototype in nccl.h (enums as ints); the
            // pointer is used only while `lib` is loaded (it moves into the Api with it).
            *unsafe { lib.get($name) }.map_err(|e| format!("libnccl lacks {}: {e}", $name))?
        };
    }
    let get_version: unsafe extern "C" fn(*mut c_int) -> Status = entry!("ncclGetVersion");
    let mut version = 0;
    // SAFETY: writes one int.
    if unsafe { get_version(&mut version) } != SUCCESS || version < MIN_VERSION {
        return Err(format!("libnccl is version code {version}; flatnn needs NCCL 2.11 or later"));
    }
    Ok(Api {
        version,
        get_unique_id: entry!("ncclGetUniqueId"),
        comm_init_all: entry!("ncclCommInitAll"),
        comm_init_rank: entry!("ncclCommInitRank"),
        comm_destroy: entry!("ncclCommDestroy"),
        comm_abort: entry!("ncclCommAbort"),
        comm_get_async_error: entry!("ncclCommGetAsyncError"),
        get_error_string: entry!("ncclGetErrorString"),
        all_reduce: entry!("ncclAllReduce"),
        broadcast: entry!("ncclBroadcast"),
        group_start: entry!("ncclGroupStart"),
        group_end: entry!("ncclGroupEnd"),
        red_op_create_pre_mul_sum: entry!("ncclRedOpCreatePreMulSum"),
        red_op_destroy: entry!("ncclRedOpDestroy"),
        _lib: lib,
    })
}

/// NCCL's version (major, minor, patch), or why it cannot be used here.
pub fn nccl_version() -> Result<(u32, u32, u32)> {
    // NCCL_VERSION(X, Y, Z) = X·10000 + Y·100 + Z from 2.9 on
    let code = api()?.version as u32;
    Ok((code / 10000, code / 100 % 100, code % 100))
}

/// Ok for NCCL's success, else an error naming the call, its rank (where it has one) and
/// NCCL's reason.
fn check(api: &Api, status: Status, rank: Option<usize>, call: &str) -> Result<()> {
    if status == SUCCESS {
        return Ok(());
    }
    // SAFETY: NCCL returns a static, NUL-terminated string for any code.
    let reason = unsafe { CStr::from_ptr((api.get_error_string)(status)) }.to_string_lossy();
    let who = rank.map_or_else(|| "NCCL".to_string(), |r| format!("NCCL rank {r}"));
    Err(Error::Cuda { what: format!("{who}: {call} failed: {reason} (code {status})") })
}

/// A new id for a communicator (rank 0 makes it and hands it to the others).
pub(crate) fn unique_id() -> Result<UniqueId> {
    let api = api()?;
    let mut id = UniqueId([0; UNIQUE_ID_BYTES]);
    // SAFETY: writes one ncclUniqueId.
    check(api, unsafe { (api.get_unique_id)(&mut id) }, None, "ncclGetUniqueId")?;
    Ok(id)
}

/// Runs `queue` (NCCL calls of this thread) as one NCCL group: one launch per device, and the
/// form one thread must use to drive several ranks.
pub(crate) fn grouped(queue: impl FnOnce() -> Result<()>) -> Result<()> {
    let api = api()?;
    // SAFETY: no arguments; the group is always ended below.
    check(api, unsafe { (api.group_start)() }, None, "ncclGroupStart")?;
    let outcome = queue();
    // SAFETY: ends the group begun above.
    let ended = check(api, unsafe { (api.group_end)() }, None, "ncclGroupEnd");
    outcome.and(ended)
}

/// One rank's communicator, and the reductions made on it. Destroyed on drop (after the
/// graphs that use it: see `parallel`), unless aborted.
pub(crate) struct Comm {
    raw: RawComm,
    rank: usize,
    /// One a (share, global batch) met so far; a step's graph holds its operators.
    reduces: Vec<Reduce>,
    /// Shared by the ranks of this process (see [`Meeting`]).
    meeting: Arc<Meeting>,
    aborted: bool,
}

// SAFETY: a communicator may be used from any thread, one call at a time; `Comm` is used
// through `&mut` or from the one thread that runs its replica's step.
unsafe impl Send for Comm {}

/// A raw communicator handed between threads (back by the one that made it, to the one that
/// aborts it).
struct Made(RawComm);
// SAFETY: as for Comm.
unsafe impl Send for Made {}

impl Made {
    fn into_raw(self) -> RawComm {
        self.0
    }
}

/// An abort running on a thread of its own: NCCL's abort may wait for peers (its intra-node
/// clean-up), and a peer that died never comes.
pub(crate) struct Aborting(std::sync::mpsc::Receiver<()>);

impl Aborting {
    /// Whether the abort has returned by `deadline` (waits until then at most).
    pub(crate) fn returned_by(&self, deadline: Instant) -> bool {
        self.0.recv_timeout(deadline.saturating_duration_since(Instant::now())).is_ok()
    }
}

impl Comm {
    /// Communicators for `ordinals` (rank i on device `ordinals[i]`), all in this process.
    pub(crate) fn all(ordinals: &[usize], timeout: Duration) -> Result<Vec<Comm>> {
        let api = api()?;
        let devices = ordinals.iter().map(|&o| c_int::try_from(o).map_err(|_| Error::Config(format!("no CUDA device {o}"))));
        let devices = devices.collect::<Result<Vec<c_int>>>()?;
        let mut raw = vec![std::ptr::null_mut(); devices.len()];
        let world = c_int::try_from(devices.len()).map_err(|_| Error::Config("too many devices".into()))?;
        // SAFETY: `raw` holds one handle a device.
        check(api, unsafe { (api.comm_init_all)(raw.as_mut_ptr(), world, devices.as_ptr()) }, None, "ncclCommInitAll")?;
        let meeting = Arc::new(Meeting::new(devices.len(), timeout));
        let comm = |(rank, raw)| Comm { raw, rank, reduces: Vec::new(), meeting: Arc::clone(&meeting), aborted: false };
        Ok(raw.into_iter().enumerate().map(comm).collect())
    }

    /// This process's communicator, as `rank` of `world` on `gpu`, from `id` (the same on every
    /// rank). NCCL's initialisation waits for every rank: it runs on a thread of its own, and
    /// past `timeout` this is an error (that thread is left to NCCL, blocked or not).
    pub(crate) fn rank(gpu: &Arc<Gpu>, id: UniqueId, rank: usize, world: usize, timeout: Duration) -> Result<Comm> {
        let api = api()?;
        let (rank_c, world_c) = match (c_int::try_from(rank), c_int::try_from(world)) {
            (Ok(r), Ok(w)) if rank < world => (r, w),
            _ => return Err(Error::Config(format!("rank {rank} of a world of {world}"))),
        };
        let (sender, receiver) = std::sync::mpsc::channel();
        let gpu = Arc::clone(gpu);
        std::thread::spawn(move || {
            let made = gpu.bind().and_then(|()| {
                let mut raw = std::ptr::null_mut();
                // SAFETY: writes one handle; NCCL uses the device whose context is current.
                check(api, unsafe { (api.comm_init_rank)(&mut raw, world_c, id, rank_c) }, Some(rank), "ncclCommInitRank")?;
                Ok(Made(raw))
            });
            if let Err(std::sync::mpsc::SendError(Ok(Made(raw)))) = sender.send(made) {
                // the caller gave up waiting: nobody will use it
                // SAFETY: a communicator just made, aborted once.
                let _ = unsafe { (api.comm_abort)(raw) };
            }
        });
        let made = receiver.recv_timeout(timeout).map_err(|_| Error::Cuda {
            what: format!("NCCL rank {rank}: the group of {world} did not form within {timeout:?} (a rank died after the rendezvous?)"),
        })?;
        let Made(raw) = made?;
        Ok(Comm { raw, rank, reduces: Vec::new(), meeting: Arc::new(Meeting::new(1, timeout)), aborted: false })
    }

    /// This rank in the group.
    pub(crate) fn rank_in_group(&self) -> usize {
        self.rank
    }

    /// Queues on `stream` the broadcast of `len` f32 at `buf` from rank 0 to every rank, in
    /// place.
    pub(crate) fn broadcast(&self, stream: &CudaStream, buf: &DevBuf<f32>) -> Result<()> {
        let api = api()?;
        let ptr = buf.ptr() as *mut c_void;
        // SAFETY: `buf` holds `len` f32 of the communicator's device; in place, as NCCL allows.
        let status = unsafe { (api.broadcast)(ptr, ptr, buf.len(), FLOAT32, 0, self.raw, stream.cu_stream()) };
        check(api, status, Some(self.rank), "ncclBroadcast")
    }

    /// Queues on `stream` a plain in-place sum of `buf` over the group (what NCCL's own
    /// `all_reduce_perf` times), for measuring the step's reduction against.
    pub(crate) fn sum(&self, stream: &CudaStream, buf: &DevBuf<f32>) -> Result<()> {
        let api = api()?;
        let ptr = buf.ptr() as *mut c_void;
        // SAFETY: `buf` holds `len` f32 of the communicator's device, summed in place.
        let status = unsafe { (api.all_reduce)(ptr, ptr, buf.len(), FLOAT32, SUM, self.raw, stream.cu_stream()) };
        check(api, status, Some(self.rank), "ncclAllReduce")
    }

    /// The reduction for a step in which this rank holds `share` of `global` samples, made on
    /// first use (a training loop meets one or two: the full batch and the last).
    pub(crate) fn reduce_for(&mut self, share: usize, global: usize) -> Result<&Reduce> {
        if let Some(i) = self.reduces.iter().position(|r| r.share == share && r.global == global) {
            return Ok(&self.reduces[i]);
        }
        let reduce = Reduce::new(self, share, global)?;
        self.reduces.push(reduce);
        Ok(self.reduces.last().expect("just pushed"))
    }

    /// Whether a reduction for (`share`, `global`) was made already.
    pub(crate) fn has_reduce(&self, share: usize, global: usize) -> bool {
        self.reduces.iter().any(|r| r.share == share && r.global == global)
    }

    /// An error if NCCL found one on this communicator since it was made (a peer gone, a
    /// network failure).
    pub(crate) fn check_async(&self) -> Result<()> {
        let api = api()?;
        let mut state = SUCCESS;
        // SAFETY: a live communicator; writes one int.
        check(api, unsafe { (api.comm_get_async_error)(self.raw, &mut state) }, Some(self.rank), "ncclCommGetAsyncError")?;
        match state {
            IN_PROGRESS => Ok(()),
            state => check(api, state, Some(self.rank), "a collective"),
        }
    }

    /// Lets every rank of this process that waits for this one at a step's meeting (or will)
    /// fail instead: this one failed before reaching it.
    pub(crate) fn abandon_meeting(&self) {
        self.meeting.abandon();
    }

    /// Starts aborting the communicator, on a thread of its own: its kernels that wait for
    /// peers return, it is freed, and the graphs that use it must never run again. None where
    /// it was aborted before (or NCCL is not loaded); else the abort to wait for, bounded (the
    /// abort of a group that lost a peer may never return: the thread is then left to NCCL).
    /// The aborts of a process's ranks run at once, since NCCL's may wait for each other.
    pub(crate) fn abort(&mut self) -> Option<Aborting> {
        if std::mem::replace(&mut self.aborted, true) {
            return None;
        }
        self.meeting.abandon();
        let api = api().ok()?;
        let (sender, receiver) = std::sync::mpsc::channel();
        let comm = Made(self.raw);
        let abort = move || {
            // SAFETY: a live communicator, aborted once (`aborted` is set, so nothing here uses
            // or destroys it again).
            let _ = unsafe { (api.comm_abort)(comm.into_raw()) };
            let _ = sender.send(());
        };
        let name = format!("flatnn-nccl-abort-{}", self.rank);
        match std::thread::Builder::new().name(name).spawn(abort) {
            Ok(_) => Some(Aborting(receiver)),
            Err(_) => {
                // no thread to be had: abort here, unbounded
                // SAFETY: as above; the closure that would have aborted it never ran.
                let _ = unsafe { (api.comm_abort)(self.raw) };
                None
            }
        }
    }

    /// Whether this communicator was aborted.
    pub(crate) fn aborted(&self) -> bool {
        self.aborted
    }
}

impl Drop for Comm {
    fn drop(&mut self) {
        if self.aborted {
            return;
        }
        if let Ok(api) = api() {
            for r in &self.reduces {
                // SAFETY: operators made on this live communicator, destroyed once, after the
                // graphs that used them (the caller's order).
                unsafe {
                    let _ = (api.red_op_destroy)(r.grads_op, self.raw);
                    let _ = (api.red_op_destroy)(r.loss_op, self.raw);
                }
            }
            // SAFETY: a live communicator, destroyed once, its work done (the caller waited).
            let _ = unsafe { (api.comm_destroy)(self.raw) };
        }
    }
}

/// What a replica's step does between its backward pass and its update: the gradients and
/// the loss's totals summed over the group, each rank's pre-multiplied by its weight
/// share/global. With every rank's gradient the mean over its share, the sum is the mean
/// gradient over the global batch, weighted by samples; with equal shares the weight is
/// 1/world, which is how NCCL's own `ncclAvg` is computed for floating-point data (a
/// pre-multiplied sum), so it costs what `ncclAvg` does. Every rank gets the same bits.
pub(crate) struct Reduce {
    raw: RawComm,
    rank: usize,
    grads_op: c_int,
    loss_op: c_int,
    share: usize,
    global: usize,
    id: u64,
    meeting: Arc<Meeting>,
}

// SAFETY: as for Comm, whose reductions these are.
unsafe impl Send for Reduce {}

/// Reductions made so far in the process (their ids).
static REDUCES: AtomicU64 = AtomicU64::new(1);

impl Reduce {
    fn new(comm: &Comm, share: usize, global: usize) -> Result<Reduce> {
        if share == 0 || share > global {
            return Err(Error::Shape(format!("a share of {share} samples of a global batch of {global}")));
        }
        let api = api()?;
        let (mut weight, mut weight32) = (share as f64 / global as f64, (share as f64 / global as f64) as f32);
        let op = |scalar: *mut c_void, data_type: c_int| -> Result<c_int> {
            let mut op = 0;
            // SAFETY: `scalar` points to one value of `data_type`, read at once (host-immediate).
            let status = unsafe { (api.red_op_create_pre_mul_sum)(&mut op, scalar, data_type, SCALAR_HOST_IMMEDIATE, comm.raw) };
            check(api, status, Some(comm.rank), "ncclRedOpCreatePreMulSum").map(|()| op)
        };
        let grads_op = op((&mut weight32 as *mut f32).cast(), FLOAT32)?;
        let loss_op = op((&mut weight as *mut f64).cast(), FLOAT64).inspect_err(|_| {
            // SAFETY: made just above on the live communicator.
            let _ = unsafe { (api.red_op_destroy)(grads_op, comm.raw) };
        })?;
        let id = REDUCES.fetch_add(1, Ordering::Relaxed);
        Ok(Reduce { raw: comm.raw, rank: comm.rank, grads_op, loss_op, share, global, id, meeting: Arc::clone(&comm.meeting) })
    }

    /// Unique in the process, never 0: part of a step graph's key.
    pub(crate) fn id(&self) -> u64 {
        self.id
    }

    /// Waits until every rank of this process has reached this point of its step (before the
    /// step's graph is captured or launched): the ranks' NCCL calls then meet while none of
    /// them waits for a device-wide lock (`cuda::device_wide`) that another's capture holds.
    pub(crate) fn meet(&self) -> Result<()> {
        self.meeting.arrive(self.rank)
    }

    /// Queues on `stream`, as one NCCL group (one kernel), the reduction of the `grads` and of
    /// the loss totals `loss` ([last, sum, count], see `DevGrads`) in place.
    pub(crate) fn queue(&self, stream: &CudaStream, grads: &DevBuf<f32>, loss: &DevBuf<f64>) -> Result<()> {
        let api = api()?;
        let stream = stream.cu_stream();
        grouped(|| {
            if grads.len() > 0 {
                let g = grads.ptr() as *mut c_void;
                // SAFETY: the gradients, on the communicator's device, reduced in place
                // (allowed) after the backward pass that wrote them, in `stream`'s order.
                let status = unsafe { (api.all_reduce)(g, g, grads.len(), FLOAT32, self.grads_op, self.raw, stream) };
                check(api, status, Some(self.rank), "ncclAllReduce of the gradients")?;
            }
            let l = loss.ptr() as *mut c_void;
            // SAFETY: as above, the three loss totals (f64).
            let status = unsafe { (api.all_reduce)(l, l, 3, FLOAT64, self.loss_op, self.raw, stream) };
            check(api, status, Some(self.rank), "ncclAllReduce of the loss")
        })
    }
}

/// A barrier of the ranks one process drives, each from its own thread, which fails instead of
/// waiting forever: past its timeout, or once abandoned (a rank failed before reaching it).
pub(crate) struct Meeting {
    ranks: usize,
    arrived: AtomicUsize,
    round: AtomicU64,
    abandoned: AtomicBool,
    timeout: Duration,
}

impl Meeting {
    pub(crate) fn new(ranks: usize, timeout: Duration) -> Meeting {
        Meeting { ranks, arrived: AtomicUsize::new(0), round: AtomicU64::new(0), abandoned: AtomicBool::new(false), timeout }
    }

    /// Waits for the other ranks of this round; `rank` names the caller in an error.
    fn arrive(&self, rank: usize) -> Result<()> {
        let abandoned = || Error::Cuda { what: format!("NCCL rank {rank}: another rank of this process failed its step") };
        if self.abandoned.load(Ordering::Acquire) {
            return Err(abandoned());
        }
        let round = self.round.load(Ordering::Acquire);
        if self.arrived.fetch_add(1, Ordering::AcqRel) + 1 == self.ranks {
            self.arrived.store(0, Ordering::Relaxed);
            self.round.store(round + 1, Ordering::Release);
            return Ok(());
        }
        let start = Instant::now();
        let mut spins = 0u32;
        while self.round.load(Ordering::Acquire) == round {
            if self.abandoned.load(Ordering::Acquire) {
                return Err(abandoned());
            }
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(1024) && start.elapsed() > self.timeout {
                self.abandon();
                return Err(Error::Cuda {
                    what: format!("NCCL rank {rank}: the other ranks of this process did not reach the step within {:?}", self.timeout),
                });
            }
            if spins > 4096 {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
        Ok(())
    }

    /// Fails every wait, now and later.
    pub(crate) fn abandon(&self) {
        self.abandoned.store(true, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_meeting_lets_ranks_through_together_round_after_round() {
        let meeting = Arc::new(Meeting::new(3, Duration::from_secs(30)));
        let passed = Arc::new(AtomicUsize::new(0));
        let threads: Vec<_> = (0..3)
            .map(|rank| {
                let (meeting, passed) = (Arc::clone(&meeting), Arc::clone(&passed));
                std::thread::spawn(move || {
                    for round in 0..100 {
                        meeting.arrive(rank).unwrap();
                        // nobody passes round r before everyone has arrived at it
                        assert!(passed.fetch_add(1, Ordering::SeqCst) >= 3 * round);
                    }
                })
            })
            .collect();
        threads.into_iter().for_each(|t| t.join().unwrap());
        assert_eq!(passed.load(Ordering::SeqCst), 300);
    }

    #[test]
    fn a_meeting_fails_past_its_timeout_and_once_abandoned() {
        let meeting = Meeting::new(2, Duration::from_millis(50));
        let start = Instant::now();
        let err = meeting.arrive(1).unwrap_err().to_string();
        assert!(err.contains("rank 1") && err.contains("did not reach"), "{err}");
        assert!(start.elapsed() < Duration::from_secs(5));
        // abandoned by the timeout: the next wait fails at once
        let err = Meeting::arrive(&meeting, 0).unwrap_err().to_string();
        assert!(err.contains("another rank"), "{err}");
    }

    #[test]
    fn no_code_sets_nccl_variables_or_makes_multicast_objects() {
        // NVLink multicast must stay as the machine sets it (NCCL_NVLS_ENABLE): no code sets
        // NCCL's variables, for itself or for a process it starts, or calls the driver's
        // multicast API
        let needles = [format!("cuMulticast{}", "Create"), format!("set_var(\"{}", "NCCL"), format!(".env(\"{}", "NCCL")];
        let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
        let mut stack = vec![src.join("src"), src.join("examples"), src.join("benches"), src.join("tests")];
        while let Some(dir) = stack.pop() {
            for entry in std::fs::read_dir(&dir).unwrap() {
                let path = entry.unwrap().path();
                if path.is_dir() {
                    stack.push(path);
                } else if path.extension().is_some_and(|e| e == "rs" || e == "cu") {
                    let text = std::fs::read_to_string(&path).unwrap();
                    for needle in &needles {
                        assert!(!text.contains(needle.as_str()), "{} mentions {needle}", path.display());
                    }
                }
            }
        }
    }
}
