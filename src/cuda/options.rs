//! How a model runs on a GPU ([`GpuOptions`]), and the switches that narrow the routes flatnn
//! measures ([`Tuning`], with [`Convs`] and [`RnnAlgos`]): every `FLATNN_*` tuning switch, read
//! from the environment in one place ([`Tuning::from_env`]).
//!
//! This file uses nothing of CUDA: a build without the `cuda` feature has the same types.

use std::sync::OnceLock;

/// How a model runs on the GPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GpuOptions {
    /// Capture each step as a CUDA graph and replay it (default). Off: the same launches, eager.
    pub graphs: bool,
    /// TF32 tensor-core products in cuBLAS, cuDNN and flatnn's tensor-core kernels (dense tiles
    /// and convolutions; about 10 mantissa bits in each product; results differ from FP32 by
    /// ~1e-3 relative). Off by default.
    pub tf32: bool,
    /// Only cuDNN's deterministic convolution algorithms are measured (default): the same
    /// model, inputs, batch size and options give the same bits run after run. Off, cuDNN's
    /// non-deterministic ones are measured too (the weight-gradient and input-gradient
    /// algorithms that sum with atomics, in an order that changes from run to run), and kept
    /// where faster: results then differ from run to run in the last bits (20 LeNet training
    /// steps were measured 3e-4 to 8e-4 from the CPU's, against ~1e-7). FFT and Winograd
    /// algorithms stay out either way (accuracy); flatnn's own kernels and the dense and
    /// recurrent routes are the same either way (none of them has a non-deterministic variant).
    pub deterministic: bool,
    /// Which routes may be measured and chosen (default: [`Tuning::from_env`]).
    pub tuning: Tuning,
}

impl Default for GpuOptions {
    fn default() -> Self {
        GpuOptions { graphs: true, tf32: false, deterministic: true, tuning: Tuning::from_env() }
    }
}

/// How the route reports name the options a setup or table of routes was made for: "FP32" or
/// "TF32", then "(non-deterministic allowed)" where [`GpuOptions::deterministic`] is off.
#[cfg(feature = "cuda")]
pub(crate) fn arithmetic(tf32: bool, deterministic: bool) -> &'static str {
    match (tf32, deterministic) {
        (false, true) => "FP32",
        (true, true) => "TF32",
        (false, false) => "FP32 (non-deterministic allowed)",
        (true, false) => "TF32 (non-deterministic allowed)",
    }
}

/// Switches that take candidates away from the measurement that chooses each GPU route (every
/// one is on by default: all candidates that fit are timed, the fastest kept), for measuring one
/// way against another. A switch never forces a route: what is left is still measured.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tuning {
    /// A training step may end in one kernel for the last dense layer, the loss and that
    /// layer's input gradient (the head). `FLATNN_HEAD=0` turns it off.
    pub head: bool,
    /// The head may take the dense layer before the last too (a deep head). `FLATNN_HEAD=1`
    /// (or `0`) turns it off.
    pub deep_head: bool,
    /// Dense weight gradients may be measured split over the batch in clusters of blocks
    /// (sm_90 and later). `FLATNN_SPLIT=0` turns it off.
    pub split_weight_grads: bool,
    /// Dense weight gradients may be measured on 32 × 32 tensor-core tiles whose slices are
    /// split over two blocks (sm_90 and later). `FLATNN_MMA_SPLIT=0` turns it off.
    pub split_tiles: bool,
    /// Dense products may be measured on cuBLASLt's algorithms (src/cuda/blaslt.rs) beside
    /// cuBLAS's and flatnn's own. `FLATNN_BLASLT=0` turns it off.
    pub blaslt: bool,
    /// Which convolution and recurrent (GRU, LSTM) routes are measured: `FLATNN_CUDNN`.
    pub convs: Convs,
    /// Which recurrent routes may be measured: `FLATNN_RNN_ALGO`, a list of [`RnnAlgos::NAMES`]
    /// (`,` between; unset or empty: all): cuDNN's algorithms, `fused` (flatnn's fused route,
    /// every variant on one block a sample slice that fits), `cluster` (its variants whose
    /// forward runs on a cluster of blocks) and `per_step` (flatnn's per-step route). The
    /// per-step route still runs a layer where nothing allowed was measured;
    /// `FLATNN_RNN_ALGO=fused` runs every layer a fused variant fits by the fused route (for
    /// testing it).
    pub rnn_algos: RnnAlgos,
    /// Kernels launch as programmatic dependents of the kernel ahead (sm_90 and later, CUDA 12.3
    /// drivers on). `FLATNN_DEPENDENT_LAUNCH=0` turns it off. A device's setting: it is taken
    /// from the environment when the process first sets the device up, whatever a model says.
    pub dependent_launch: bool,
    /// The kernels that stage through shared memory ask for the largest shared-memory carveout.
    /// `FLATNN_CARVEOUT=0` leaves it to the driver. A device's setting, as `dependent_launch`.
    pub carveout: bool,
}

/// Which convolution routes are measured (`FLATNN_CUDNN`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Convs {
    /// flatnn's kernels and cuDNN's product algorithms (deterministic ones only unless
    /// [`GpuOptions::deterministic`] is off), the fastest kept
    /// (`auto`, the default; also what a value not understood means).
    Measured,
    /// flatnn's kernels alone; cuDNN is not loaded (`0`).
    Own,
    /// cuDNN wherever it has an algorithm for the layer, flatnn's kernels elsewhere (`1`).
    Cudnn,
}

impl Convs {
    /// The value of `FLATNN_CUDNN` that asks for this.
    pub fn setting(self) -> &'static str {
        match self {
            Convs::Measured => "auto",
            Convs::Own => "0",
            Convs::Cudnn => "1",
        }
    }
}

/// A set of recurrent routes (`FLATNN_RNN_ALGO`), by their places in [`RnnAlgos::NAMES`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RnnAlgos {
    allowed: [bool; RnnAlgos::NAMES.len()],
}

impl RnnAlgos {
    /// The recurrent routes as `FLATNN_RNN_ALGO` names them: cuDNN's algorithms as the route
    /// report names them too (`CUDNN_RNN_ALGO_*` less the prefix, in lower case; in
    /// `rnn_cudnn::Algo::ALL`'s order), then flatnn's fused, per-step and cluster routes.
    pub const NAMES: [&'static str; 5] = ["standard", "persist_static_small_h", "fused", "per_step", "cluster"];

    /// Every algorithm (the default).
    pub const ALL: RnnAlgos = RnnAlgos { allowed: [true; RnnAlgos::NAMES.len()] };

    /// The algorithms `value` names (a list of [`RnnAlgos::NAMES`], `,` between; none named:
    /// all); None where it names something else.
    pub fn named(value: &str) -> Option<RnnAlgos> {
        let mut allowed = [false; RnnAlgos::NAMES.len()];
        for name in value.split(',').map(str::trim).filter(|n| !n.is_empty()) {
            let index = RnnAlgos::NAMES.iter().position(|&known| known == name)?;
            allowed[index] = true;
        }
        match allowed.contains(&true) {
            true => Some(RnnAlgos { allowed }),
            false => Some(RnnAlgos::ALL),
        }
    }

    /// Whether the route `RnnAlgos::NAMES[index]` is in the set.
    #[cfg(feature = "cuda")]
    pub(crate) fn allows(self, index: usize) -> bool {
        self.allowed.get(index).copied().unwrap_or(false)
    }

    /// Whether flatnn's fused route is in the set.
    #[cfg(feature = "cuda")]
    pub(crate) fn allows_fused(self) -> bool {
        self.allows(2)
    }

    /// Whether flatnn's per-step route is in the set (to be measured).
    #[cfg(feature = "cuda")]
    pub(crate) fn allows_per_step(self) -> bool {
        self.allows(3)
    }

    /// Whether flatnn's fused variants with their forward on a cluster are in the set.
    #[cfg(feature = "cuda")]
    pub(crate) fn allows_cluster(self) -> bool {
        self.allows(4)
    }
}

impl Default for Tuning {
    /// Every candidate measured: nothing taken away.
    fn default() -> Self {
        Tuning {
            head: true,
            deep_head: true,
            split_weight_grads: true,
            split_tiles: true,
            blaslt: true,
            convs: Convs::Measured,
            rnn_algos: RnnAlgos::ALL,
            dependent_launch: true,
            carveout: true,
        }
    }
}

/// The environment's tuning, read once per process, and the values of its settings that were
/// not understood (which the GPU's route reports alone read).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
struct Env {
    tuning: Tuning,
    /// `FLATNN_CUDNN`'s, where not understood (then taken as `auto`).
    cudnn_not_understood: Option<String>,
    /// `FLATNN_RNN_ALGO`'s, where it names something else (then every algorithm is allowed).
    rnn_algo_not_understood: Option<String>,
}

fn from_env_once() -> &'static Env {
    static ENV: OnceLock<Env> = OnceLock::new();
    ENV.get_or_init(|| {
        let off = |name: &str| std::env::var(name).is_ok_and(|v| v.trim() == "0");
        let head = std::env::var("FLATNN_HEAD").unwrap_or_default();
        let (convs, cudnn_not_understood) = match std::env::var_os("FLATNN_CUDNN").map(|v| v.to_string_lossy().into_owned()) {
            None => (Convs::Measured, None),
            Some(value) => match value.trim() {
                "0" | "off" | "own" => (Convs::Own, None),
                "1" | "on" | "cudnn" => (Convs::Cudnn, None),
                "auto" | "" => (Convs::Measured, None),
                _ => (Convs::Measured, Some(value)),
            },
        };
        let rnn_algo = std::env::var("FLATNN_RNN_ALGO").unwrap_or_default();
        let (rnn_algos, rnn_algo_not_understood) = match RnnAlgos::named(&rnn_algo) {
            Some(algos) => (algos, None),
            None => (RnnAlgos::ALL, Some(rnn_algo)),
        };
        let tuning = Tuning {
            head: head.trim() != "0",
            deep_head: !matches!(head.trim(), "0" | "1"),
            split_weight_grads: !off("FLATNN_SPLIT"),
            split_tiles: !off("FLATNN_MMA_SPLIT"),
            blaslt: !off("FLATNN_BLASLT"),
            convs,
            rnn_algos,
            dependent_launch: !off("FLATNN_DEPENDENT_LAUNCH"),
            carveout: !off("FLATNN_CARVEOUT"),
        };
        Env { tuning, cudnn_not_understood, rnn_algo_not_understood }
    })
}

impl Tuning {
    /// The tuning the environment asks for, read once per process (the first time this is
    /// called: when the first model is built): each `FLATNN_*` switch above, `=0` to take its
    /// candidates away; `FLATNN_CUDNN` as [`Convs`]; `FLATNN_RNN_ALGO` as [`RnnAlgos::named`].
    /// Unset, every candidate is measured.
    pub fn from_env() -> Tuning {
        from_env_once().tuning
    }

    /// The value of `FLATNN_CUDNN` where it was not understood (then taken as `auto`).
    #[cfg(feature = "cuda")]
    pub(crate) fn cudnn_not_understood() -> Option<&'static str> {
        from_env_once().cudnn_not_understood.as_deref()
    }

    /// The value of `FLATNN_RNN_ALGO` where it names something else (then every algorithm is
    /// allowed).
    #[cfg(feature = "cuda")]
    pub(crate) fn rnn_algo_not_understood() -> Option<&'static str> {
        from_env_once().rnn_algo_not_understood.as_deref()
    }
}

#[cfg(test)]
mod tests {
    use super::RnnAlgos;

    /// The set of the algorithms at `indices` in [`RnnAlgos::NAMES`].
    fn set(indices: &[usize]) -> RnnAlgos {
        let mut allowed = [false; RnnAlgos::NAMES.len()];
        indices.iter().for_each(|&i| allowed[i] = true);
        RnnAlgos { allowed }
    }

    #[test]
    fn rnn_algo_setting_names_algorithms() {
        assert_eq!(RnnAlgos::named(""), Some(RnnAlgos::ALL));
        assert_eq!(RnnAlgos::named(" , "), Some(RnnAlgos::ALL));
        assert_eq!(RnnAlgos::named("persist_static_small_h"), Some(set(&[1])));
        assert_eq!(RnnAlgos::named("persist_static_small_h, standard"), Some(set(&[0, 1])));
        assert_eq!(RnnAlgos::named("persist_static"), None);
        assert_eq!(RnnAlgos::named("standard,standard"), Some(set(&[0])));
        assert_eq!(RnnAlgos::named("standard,small_h"), None);
        assert_eq!(RnnAlgos::named("PERSIST_STATIC"), None);
        assert_eq!(RnnAlgos::named("fused"), Some(set(&[2])));
        assert_eq!(RnnAlgos::named("per_step,fused"), Some(set(&[2, 3])));
        assert_eq!(RnnAlgos::named("cluster"), Some(set(&[4])));
        for (i, name) in RnnAlgos::NAMES.into_iter().enumerate() {
            assert_eq!(RnnAlgos::named(name), Some(set(&[i])));
        }
    }
}
