//! What runs a direction of a convolution ([`Route`]), and how the report says which did and
//! what each candidate took ([`describe`]).

use super::Choice;
use crate::cuda::cudnn::Dir;

/// What runs one direction of a convolution.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Route {
    /// flatnn's lowered route: im2col and cuBLAS products (`conv.rs`).
    Own,
    /// flatnn's implicit product, the weight gradient alone: no lowered matrix, the batch split
    /// into shares (`conv_weight_grad_implicit`).
    Implicit,
    /// cuDNN's algorithm `Choice::algo`.
    Cudnn,
}

impl Route {
    /// Every route, as the report names them.
    pub const ALL: [Route; 3] = [Route::Own, Route::Implicit, Route::Cudnn];

    pub fn name(self) -> &'static str {
        match self {
            Route::Own => "own",
            Route::Implicit => "own-implicit",
            Route::Cudnn => "cudnn",
        }
    }

    /// Whether this route can run `dir` (given cuDNN for [`Route::Cudnn`]).
    pub fn runs(self, dir: Dir) -> bool {
        self != Route::Implicit || dir == Dir::Weight
    }
}

/// What the report says of `dir` of a layer: "not measured yet", "not needed", the route that
/// runs it where nothing else was a candidate, else the route chosen and its time, then the
/// other candidates' ("own-implicit 210.0 µs (own 1536.0 µs, cudnn BWD_FILTER_ALGO_1 1842.0
/// µs)"; "cudnn -" where cuDNN had no algorithm); `cudnn`: whether cuDNN was a candidate.
pub(super) fn describe(dir: Dir, ch: Choice, cudnn: bool) -> String {
    if !ch.decided {
        return "not measured yet".into();
    }
    if !ch.needed {
        return "not needed".into();
    }
    let named = |route: Route| match (route, ch.algo) {
        (Route::Own, _) => (Route::Own.name().to_string(), ch.own_us),
        (Route::Implicit, _) => (Route::Implicit.name().to_string(), ch.implicit_us),
        (Route::Cudnn, Some(algo)) => (format!("cudnn {}", algo.name(dir)), ch.cudnn_us),
        (Route::Cudnn, None) => ("cudnn -".to_string(), ch.cudnn_us),
    };
    let candidates = Route::ALL.into_iter().filter(|&r| r.runs(dir) && (r != Route::Cudnn || cudnn));
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
    /// direction, each route chosen and cuDNN a candidate or not, the report names the chosen
    /// route first and then every other candidate once (the implicit product for the weight
    /// gradient alone, cuDNN only where it was a candidate), each with its time.
    #[test]
    fn every_route_a_report_names_exists() {
        let algo = Algo { id: 1, math: CUDNN_FMA_MATH, deterministic: true };
        for dir in [Dir::Forward, Dir::Weight, Dir::Input] {
            for cudnn in [false, true] {
                let candidates: Vec<Route> = Route::ALL.into_iter().filter(|r| r.runs(dir) && (*r != Route::Cudnn || cudnn)).collect();
                assert_eq!(candidates.contains(&Route::Implicit), dir == Dir::Weight);
                for &route in &candidates {
                    let ch = Choice {
                        decided: true,
                        algo: Some(algo),
                        route,
                        own_us: 3.0,
                        implicit_us: 2.0,
                        cudnn_us: 1.0,
                        ..Choice::default()
                    };
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
                    assert!(parts.iter().all(|p| p.contains(" µs")), "{text}");
                }
            }
        }
        let ch = Choice { decided: true, route: Route::Own, ..Choice::default() };
        assert_eq!(describe(Dir::Weight, ch, true), "own NaN µs (own-implicit NaN µs, cudnn - NaN µs)");
        assert_eq!(describe(Dir::Weight, Choice::default(), true), "not measured yet");
        assert_eq!(describe(Dir::Input, Choice { decided: true, needed: false, ..Choice::default() }, true), "not needed");
    }
}
