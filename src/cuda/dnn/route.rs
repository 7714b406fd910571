//! What runs a direction of a convolution ([`Route`]), what each candidate took ([`Times`]),
//! what a measurement is of ([`MeasureKey`]), and how the report says it ([`describe`]).

use super::Choice;
use crate::cuda::conv_direct::{DirectForward, DirectWgrad};
use crate::cuda::conv_mma::{mma_runs_on, MmaForward};
use crate::cuda::conv_mma_wgrad::MmaWgrad;
use crate::cuda::cudnn::{Algo, Dir};
use crate::cuda::timing::FirstMeasured;
use crate::layers::conv;

/// What runs one direction of a convolution.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(in crate::cuda) enum Route {
    /// flatnn's lowered route: im2col and cuBLAS products (`conv.rs`).
    Own,
    /// flatnn's implicit product, the weight gradient alone: no lowered matrix, the batch split
    /// into shares (`conv_weight_grad_implicit`).
    Implicit,
    /// flatnn's direct kernels, the forward, the weight gradient and (stride 1) the input
    /// gradient, where they fit (`conv_direct.rs`).
    Direct,
    /// flatnn's tensor-core kernels (sm_80 on), the forward, the weight gradient and (stride 1)
    /// the input gradient, where they fit (`conv_mma.rs`, `conv_mma_wgrad.rs`): 3xTF32, or TF32
    /// where the model's TF32 is on.
    Mma,
    /// cuDNN's algorithm `Choice::algo`.
    Cudnn,
}

impl Route {
    /// Every route, as the report names them, in the order of their discriminants.
    pub const ALL: [Route; 5] = [Route::Own, Route::Implicit, Route::Direct, Route::Mma, Route::Cudnn];

    pub fn name(self) -> &'static str {
        match self {
            Route::Own => "own",
            Route::Implicit => "own-implicit",
            Route::Direct => "own-direct",
            Route::Mma => "own-mma",
            Route::Cudnn => "cudnn",
        }
    }

    /// Whether this route can run `dir` (given cuDNN for [`Route::Cudnn`], and a layer the
    /// direct or tensor-core kernels fit for [`Route::Direct`] and [`Route::Mma`]).
    pub fn runs(self, dir: Dir) -> bool {
        match self {
            Route::Own | Route::Cudnn | Route::Direct | Route::Mma => true,
            Route::Implicit => dir == Dir::Weight,
        }
    }

    /// The routes measured for `dir` of a layer: those that run it, cuDNN where `cudnn` (it
    /// was a candidate), the direct kernels where `direct` and the tensor-core ones where `mma`
    /// (they fit the layer).
    pub fn candidates(dir: Dir, cudnn: bool, direct: bool, mma: bool) -> impl Iterator<Item = Route> {
        Route::ALL
            .into_iter()
            .filter(move |&r| r.runs(dir) && (r != Route::Cudnn || cudnn) && (r != Route::Direct || direct) && (r != Route::Mma || mma))
    }
}

/// A time per call (µs) for each route: NaN where not measured, never faster than a number.
#[derive(Clone, Copy, Debug)]
pub(super) struct Times([f32; Route::ALL.len()]);

impl Times {
    pub const NONE: Times = Times([f32::NAN; Route::ALL.len()]);

    pub fn of(&self, route: Route) -> f32 {
        self.0[route as usize]
    }

    pub fn set(&mut self, route: Route, us: f32) {
        self.0[route as usize] = us;
    }

    /// The fastest of `routes` (the first where none is faster; `Route::Own` where none is given).
    pub fn fastest(&self, routes: impl Iterator<Item = Route>) -> Route {
        let key = |r: Route| if self.of(r).is_nan() { f32::INFINITY } else { self.of(r) };
        routes.reduce(|best, r| if key(r) < key(best) { r } else { best }).unwrap_or(Route::Own)
    }
}

/// Whether flatnn's direct kernel for `dir` fits a layer of geometry `g` at `batch` (shared
/// memory, register tiles; for the input gradient, a stride of 1 and a padding of at most
/// (k − 1)·d, where it is a forward convolution): then it is a candidate.
pub(super) fn direct_fits(dir: Dir, g: &conv::Geometry, batch: usize) -> bool {
    match dir {
        Dir::Forward => DirectForward::of(g).is_some(),
        Dir::Weight => DirectWgrad::of(g, batch).is_some(),
        Dir::Input => DirectForward::input_grad(g).is_some(),
    }
}

/// Whether flatnn's tensor-core kernel for `dir` fits a layer of geometry `g` at `batch` on a
/// device of compute capability `cc` (8.0 on; shared memory; the input gradient as for
/// [`direct_fits`]): then it is a candidate.
pub(super) fn mma_fits(dir: Dir, g: &conv::Geometry, batch: usize, cc: (u32, u32)) -> bool {
    mma_runs_on(cc)
        && match dir {
            Dir::Forward => MmaForward::of(g).is_some(),
            Dir::Weight => MmaWgrad::of(g, batch).is_some(),
            Dir::Input => MmaForward::input_grad(g).is_some(),
        }
}

/// What a measurement is of: the device, the layer's shape (C, H, W, OC, kh, kw, sh, sw, ph,
/// pw, dh, dw), the batch, the arithmetic, whether non-deterministic algorithms were candidates,
/// whether cuDNN was, and the direction.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) struct MeasureKey {
    pub ordinal: usize,
    pub shape: [usize; 12],
    pub batch: usize,
    pub tf32: bool,
    pub deterministic: bool,
    pub cudnn: bool,
    pub dir: Dir,
}

/// The routes timed (µs per call; NaN where not), and cuDNN's fastest algorithm, if any ran.
#[derive(Clone)]
pub(super) struct Measured {
    pub algo: Option<Algo>,
    pub us: Times,
    pub note: String,
}

/// Every measurement made in this process: the first one of a key is what every cache uses.
pub(super) static MEASURED: FirstMeasured<MeasureKey, Measured> = FirstMeasured::new();

/// Tests: a route every convolution direction that can take it takes on this thread, whatever
/// was measured (measuring still runs, and its times are reported).
#[cfg(test)]
pub(in crate::cuda) mod forced {
    use super::Route;
    use std::cell::Cell;

    thread_local! {
        static FORCED: Cell<Option<Route>> = const { Cell::new(None) };
    }

    /// Forces `route` (None: the measurement decides again) for the caches this thread prepares.
    pub fn set(route: Option<Route>) {
        FORCED.with(|f| f.set(route));
    }

    pub(in crate::cuda::dnn) fn route() -> Option<Route> {
        FORCED.with(|f| f.get())
    }
}

/// What the report says of `dir` of a layer: "not measured yet", "not needed", the route that
/// runs it where nothing else was a candidate, else the route chosen and its time, then the
/// other candidates' ("own-direct 40.1 µs (own 604.0 µs, cudnn FWD_ALGO_1 372.2 µs)"; "cudnn -"
/// where cuDNN had no algorithm); `cudnn`: whether cuDNN was a candidate.
pub(super) fn describe(dir: Dir, ch: Choice, cudnn: bool) -> String {
    if !ch.decided {
        return "not measured yet".into();
    }
    if !ch.needed {
        return "not needed".into();
    }
    let named = |route: Route| match (route, ch.algo) {
        (Route::Cudnn, Some(algo)) => (format!("cudnn {}", algo.name(dir)), ch.us.of(route)),
        (Route::Cudnn, None) => ("cudnn -".to_string(), ch.us.of(route)),
        _ => (route.name().to_string(), ch.us.of(route)),
    };
    let candidates = Route::candidates(dir, cudnn, ch.direct, ch.mma);
    let others: Vec<String> = candidates.filter(|&r| r != ch.route).map(named).map(|(name, us)| format!("{name} {us:.1} µs")).collect();
    let (name, us) = named(ch.route);
    if others.is_empty() {
        return format!("{name} (the only route)");
    }
    format!("{name} {us:.1} µs ({})", others.join(", "))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::cudnn::Algo;
    use cudarc::cudnn::sys::cudnnMathType_t::CUDNN_FMA_MATH;

    /// The route a report's words name (the chosen one first, the others after it), if any.
    fn route_named(words: &str) -> Option<Route> {
        let name = words.trim_start_matches('(').split_whitespace().next()?;
        Route::ALL.into_iter().find(|r| r.name() == name)
    }

    /// Every route a report can name exists and can run the direction it is named for: for each
    /// direction, each route chosen and cuDNN, the direct and the tensor-core kernels candidates
    /// or not, the report names the chosen route first and then every other candidate once (the
    /// implicit product for the weight gradient alone, cuDNN only where it was a candidate), each
    /// with its time.
    #[test]
    fn every_route_a_report_names_exists() {
        let algo = Algo { id: 1, math: CUDNN_FMA_MATH, deterministic: true };
        for dir in [Dir::Forward, Dir::Weight, Dir::Input] {
            for (cudnn, direct, mma) in (0..8).map(|bits| (bits & 1 != 0, bits & 2 != 0, bits & 4 != 0)) {
                let candidates: Vec<Route> = Route::candidates(dir, cudnn, direct, mma).collect();
                assert_eq!(candidates.contains(&Route::Implicit), dir == Dir::Weight);
                assert_eq!(candidates.contains(&Route::Direct), direct);
                assert_eq!(candidates.contains(&Route::Mma), mma);
                assert_eq!(candidates.contains(&Route::Cudnn), cudnn);
                let mut us = Times::NONE;
                for (i, &r) in Route::ALL.iter().enumerate() {
                    us.set(r, 1.0 + i as f32);
                }
                for &route in &candidates {
                    let ch = Choice { decided: true, algo: Some(algo), route, us, direct, mma, ..Choice::default() };
                    let text = describe(dir, ch, cudnn);
                    let parts: Vec<&str> = text.split(['(', ',']).filter(|p| !p.trim().is_empty()).collect();
                    assert_eq!(route_named(parts[0]), Some(route), "{text}");
                    if candidates.len() == 1 {
                        assert_eq!(text, format!("{} (the only route)", route.name()));
                        continue;
                    }
                    let named: Vec<Route> = parts.iter().map(|p| route_named(p).unwrap_or_else(|| panic!("{p:?} in {text}"))).collect();
                    let mut sorted = named.clone();
                    sorted.sort_by_key(|r| r.name());
                    let mut want = candidates.clone();
                    want.sort_by_key(|r| r.name());
                    assert_eq!(sorted, want, "{dir:?}: {text}");
                    // each with its own time
                    for (part, r) in parts.iter().zip(&named) {
                        assert!(part.contains(&format!(" {:.1} µs", us.of(*r))), "{r:?} in {text}");
                    }
                }
            }
        }
        let ch = Choice { decided: true, route: Route::Own, ..Choice::default() };
        assert_eq!(describe(Dir::Weight, ch, true), "own NaN µs (own-implicit NaN µs, cudnn - NaN µs)");
        let ch = Choice { decided: true, route: Route::Direct, direct: true, ..Choice::default() };
        assert_eq!(describe(Dir::Forward, ch, false), "own-direct NaN µs (own NaN µs)");
        let ch = Choice { decided: true, route: Route::Mma, direct: true, mma: true, ..Choice::default() };
        assert_eq!(describe(Dir::Input, ch, true), "own-mma NaN µs (own NaN µs, own-direct NaN µs, cudnn - NaN µs)");
        // the weight gradient names the tensor-core route where it fits, and only there
        let ch = Choice { decided: true, route: Route::Mma, mma: true, ..Choice::default() };
        assert_eq!(describe(Dir::Weight, ch, false), "own-mma NaN µs (own NaN µs, own-implicit NaN µs)");
        let ch = Choice { decided: true, route: Route::Own, ..Choice::default() };
        assert_eq!(describe(Dir::Weight, ch, false), "own NaN µs (own-implicit NaN µs)");
        assert_eq!(describe(Dir::Weight, Choice::default(), true), "not measured yet");
        assert_eq!(describe(Dir::Input, Choice { decided: true, needed: false, ..Choice::default() }, true), "not needed");
    }

    /// The tensor-core route is a candidate for the forward, the weight gradient (at any batch
    /// but an empty one) and a stride-1 input gradient of a layer it fits on compute capability
    /// 8.0 and later, never below (no TF32 mma.sync, no cp.async).
    #[test]
    fn the_tensor_core_route_is_a_candidate_from_sm_80_on() {
        let g = conv::Geometry::new(
            crate::chain::Shape::image(16, 16, 16),
            crate::chain::Shape::image(32, 16, 16),
            (3, 3),
            (1, 1),
            (1, 1),
            (1, 1),
        );
        for cc in [(9, 0), (8, 0), (8, 6)] {
            assert!([Dir::Forward, Dir::Weight, Dir::Input].iter().all(|&dir| mma_fits(dir, &g, 4096, cc)), "{cc:?}");
            assert!(mma_fits(Dir::Weight, &g, 1, cc) && !mma_fits(Dir::Weight, &g, 0, cc), "{cc:?}");
        }
        for cc in [(7, 5), (7, 0), (6, 1)] {
            assert!([Dir::Forward, Dir::Weight, Dir::Input].iter().all(|&dir| !mma_fits(dir, &g, 4096, cc)), "{cc:?}");
        }
        // stride 2: the input gradient is not a forward convolution
        let strided = conv::Geometry::new(
            crate::chain::Shape::image(16, 16, 16),
            crate::chain::Shape::image(32, 8, 8),
            (3, 3),
            (2, 2),
            (1, 1),
            (1, 1),
        );
        let fits = |dir| mma_fits(dir, &strided, 17, (9, 0));
        assert!(fits(Dir::Forward) && fits(Dir::Weight) && !fits(Dir::Input));
    }

    /// Times are keyed by route: the fastest is the one with the least time, NaN never wins, and
    /// with none timed the lowered route stays.
    #[test]
    fn the_fastest_route_is_the_least_time_and_nan_never_wins() {
        let mut us = Times::NONE;
        let own = [Route::Own, Route::Implicit, Route::Direct, Route::Mma];
        assert_eq!(us.fastest(own.into_iter()), Route::Own);
        us.set(Route::Direct, 40.1);
        assert_eq!(us.fastest(own.into_iter()), Route::Direct);
        us.set(Route::Own, 604.0);
        us.set(Route::Implicit, 30.0);
        assert_eq!(us.fastest(own.into_iter()), Route::Implicit);
        assert_eq!(us.fastest([Route::Own, Route::Direct].into_iter()), Route::Direct);
        us.set(Route::Mma, 12.5);
        assert_eq!(us.fastest(own.into_iter()), Route::Mma);
        assert_eq!(us.fastest([Route::Own, Route::Direct].into_iter()), Route::Direct);
        assert_eq!((us.of(Route::Own), us.of(Route::Mma), us.of(Route::Cudnn).is_nan()), (604.0, 12.5, true));
    }
}
