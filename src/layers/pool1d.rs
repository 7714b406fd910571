//! MaxPool1d: y[c, o] = the maximum of window o of a signal (C, L): the taps x[c, o·s + j·d − p]
//! for j < k that fall inside the signal (padding is −∞, so never the maximum), as PyTorch's
//! `nn.MaxPool1d(k, stride, padding, dilation)`, whose rule for the maximum it follows: the first
//! tap inside is the maximum so far, and a later one replaces it where it is greater or NaN.
//! Backward sends each output gradient to its window's maximum, windows in output order
//! (overlapping ones add). No parameters; the maximum is found again from the input, so nothing
//! is kept. The fast CPU path is the plain loop itself, its samples spread over the pool's
//! threads; the GPU kernels (`kernels/pool1d.cu`) follow the same rule and add in the same
//! order, so both devices give the same bits.

use super::kind::{LayerKind, Mode};
use super::{split2, BackPass, Pass};
use crate::chain::{Chain, Shape, Step};
use crate::cpu::{for_chunks, SharedMut};
use crate::error::Result;
#[cfg(test)]
use crate::float::Float;
use crate::io::Words;

/// Max-pooling over a signal: the maximum of each `window` taps spaced by `dilation`, moved by
/// `stride`, the signal padded by `padding` on each side.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MaxPool1d {
    pub window: usize,
    pub stride: usize,
    pub padding: usize,
    pub dilation: usize,
}

/// Options of a 1-D max-pool beyond its window: PyTorch's defaults are a stride equal to the
/// window, no padding and dilation 1 ([`Chain::max_pool1d`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pool1dOptions {
    pub stride: usize,
    pub padding: usize,
    pub dilation: usize,
}

impl Chain {
    /// 1-D max-pool with stride equal to the window (`nn.MaxPool1d(window)`).
    pub fn max_pool1d(self, window: usize) -> Chain {
        self.max_pool1d_with(window, Pool1dOptions { stride: window, padding: 0, dilation: 1 })
    }

    /// 1-D max-pool with an explicit stride, padding and dilation.
    pub fn max_pool1d_with(self, window: usize, options: Pool1dOptions) -> Chain {
        let Pool1dOptions { stride, padding, dilation } = options;
        self.layer(MaxPool1d { window, stride, padding, dilation }.into())
    }
}

impl LayerKind for MaxPool1d {
    const WORD: &'static str = "maxpool1d";

    fn output_shape(&self, input: Shape) -> std::result::Result<Shape, String> {
        let MaxPool1d { window, stride, padding, dilation } = *self;
        let Shape::Signal { channels, length } = input else {
            return Err("needs a signal input".into());
        };
        if window == 0 || stride == 0 || dilation == 0 {
            return Err("window, stride and dilation must be at least 1".into());
        }
        // as PyTorch: so that every window holds a value of the signal
        if padding > window / 2 {
            return Err(format!("padding {padding} is more than half the window {window}"));
        }
        let span = (window - 1).checked_mul(dilation).and_then(|s| s.checked_add(1));
        let padded = padding.checked_mul(2).and_then(|p| p.checked_add(length));
        let (Some(span), Some(padded)) = (span, padded) else {
            return Err("the window's or the padded input's size overflows".into());
        };
        if span > padded {
            return Err(format!("window {window} dilated by {dilation} spans {span}, more than the padded input's {padded}"));
        }
        let out_length = (padded - span) / stride + 1;
        // a dilated window may step over the whole signal: only the windows that start in the
        // padding can (those that start at or after it begin with a value of the signal)
        for o in 0..out_length.min(padding.div_ceil(stride)) {
            let first = (padding - o * stride).div_ceil(dilation);
            if first >= window || o * stride + first * dilation - padding >= length {
                return Err(format!("window {o} holds no value of the signal, only padding (PyTorch gives −inf there)"));
            }
        }
        Ok(Shape::Signal { channels, length: out_length })
    }

    /// `maxpool1d WINDOW STRIDE PADDING DILATION`
    fn describe(&self) -> String {
        let MaxPool1d { window, stride, padding, dilation } = *self;
        format!("maxpool1d {window} {stride} {padding} {dilation}")
    }

    fn parse(words: &Words) -> Result<MaxPool1d> {
        if words.len() != 5 {
            return Err(words.unknown());
        }
        let [window, stride, padding, dilation] = words.numbers()?;
        Ok(MaxPool1d { window, stride, padding, dilation })
    }

    fn summary(&self, _input: Shape) -> String {
        let MaxPool1d { window, stride, padding, dilation } = *self;
        let pad = if padding == 0 { String::new() } else { format!(", pad {padding}") };
        let dilated = if dilation == 1 { String::new() } else { format!(", dilation {dilation}") };
        format!("MaxPool1d({window}, stride {stride}{pad}{dilated})")
    }

    fn forward(&self, step: &Step, pass: &mut Pass, _mode: Mode) {
        let (x, y) = (pass.region(step.input_region), pass.region(step.output_region));
        let (g, batch) = (self.geometry(step), pass.batch);
        let (xs, ys) = split2(pass.acts, x, y);
        let ys = SharedMut::new(&mut ys[..batch * g.out_len()]);
        for_chunks(pass.pool, batch, 8, &|_, samples| {
            for s in samples {
                // SAFETY: chunks are disjoint sample ranges.
                let y = unsafe { ys.slice(s * g.out_len()..(s + 1) * g.out_len()) };
                forward_sample_fast(&g, &xs[s * g.in_len()..][..g.in_len()], y);
            }
        });
    }

    fn backward(&self, step: &Step, pass: &mut BackPass) {
        if !pass.needs_dx(step) {
            return;
        }
        let (x, y) = (pass.region(step.input_region), pass.region(step.output_region));
        let (g, batch, xs) = (self.geometry(step), pass.batch, pass.acts);
        let (dxs, dys) = pass.dacts.split_at_mut(y.start);
        let (dys, xs) = (&dys[..y.len()], &xs[x.clone()]);
        let dxs = SharedMut::new(&mut dxs[x]);
        for_chunks(pass.pool, batch, 8, &|_, samples| {
            for s in samples {
                // SAFETY: chunks are disjoint sample ranges.
                let dx = unsafe { dxs.slice(s * g.in_len()..(s + 1) * g.in_len()) };
                let (x, dy) = (&xs[s * g.in_len()..][..g.in_len()], &dys[s * g.out_len()..][..g.out_len()]);
                backward_sample_fast(&g, x, dy, dx);
            }
        });
    }

    #[cfg(test)]
    fn spec_forward<F: Float>(&self, step: &Step, pass: &mut super::spec::Pass<F>, _mode: Mode) {
        let (x, y) = (pass.region(step.input_region), pass.region(step.output_region));
        let (g, batch) = (self.geometry(step), pass.batch);
        let (xs, ys) = split2(pass.acts, x, y);
        for s in 0..batch {
            forward_sample(&g, &xs[s * g.in_len()..][..g.in_len()], &mut ys[s * g.out_len()..][..g.out_len()]);
        }
    }

    #[cfg(test)]
    fn spec_backward<F: Float>(&self, step: &Step, pass: &mut super::spec::BackPass<F>) {
        if !pass.needs_dx(step) {
            return;
        }
        let (x, y) = (pass.region(step.input_region), pass.region(step.output_region));
        let (g, batch) = (self.geometry(step), pass.batch);
        let dys = pass.dacts[y].to_vec();
        let (xs, dxs) = (&pass.acts[x.clone()], &mut pass.dacts[x]);
        for s in 0..batch {
            let (x, dy) = (&xs[s * g.in_len()..][..g.in_len()], &dys[s * g.out_len()..][..g.out_len()]);
            backward_sample(&g, x, dy, &mut dxs[s * g.in_len()..][..g.in_len()]);
        }
    }

    #[cfg(feature = "cuda")]
    fn gpu_forward(&self, step: &Step, pass: &crate::cuda::exec::GpuForward, _mode: Mode) -> Result<()> {
        use crate::cuda::{blocks, kernel_args, Kernel};
        let (g, batch) = (self.geometry(step), pass.f.batch);
        let (x, y) = (pass.acts(pass.region(step.input_region)).ptr(), pass.acts_mut(pass.region(step.output_region)).ptr());
        let [c, l, ol, k, s, p, d, b] = g.dims(batch)?;
        pass.gpu.run(pass.stream, Kernel::Maxpool1dForward, blocks(batch * g.out_len()), kernel_args![x, y, c, l, ol, k, s, p, d, b])
    }

    #[cfg(feature = "cuda")]
    fn gpu_backward(&self, step: &Step, pass: &mut crate::cuda::exec::GpuBackward) -> Result<()> {
        use crate::cuda::{blocks, kernel_args, Kernel};
        if !pass.need_dx {
            return Ok(());
        }
        let (g, batch) = (self.geometry(step), pass.f.batch);
        let (x, y) = (pass.region(step.input_region), pass.region(step.output_region));
        let (dx, dy, x) = (pass.dacts_mut(x.clone()).ptr(), pass.dacts(y).ptr(), pass.acts(x).ptr());
        let [c, l, ol, k, s, p, d, b] = g.dims(batch)?;
        // windows that tile the signal: one thread a window, no gather
        if g.tiles() {
            let windows = crate::cuda::int(batch * g.out_len())?;
            let args = kernel_args![x, dy, dx, l, ol, k, windows];
            return pass.gpu.run(pass.stream, Kernel::Maxpool1dBackwardTiles, blocks(batch * g.out_len()), args);
        }
        let args = kernel_args![x, dy, dx, c, l, ol, k, s, p, d, b];
        pass.gpu.run(pass.stream, Kernel::Maxpool1dBackward, blocks(batch * g.in_len()), args)
    }
}

impl MaxPool1d {
    fn geometry(&self, step: &Step) -> Geometry {
        let (Shape::Signal { channels, length }, Shape::Signal { length: out_length, .. }) = (step.input, step.output) else {
            unreachable!("the plan gives 1-D pools signal shapes");
        };
        let MaxPool1d { window, stride, padding, dilation } = *self;
        Geometry { channels, length, out_length, window, stride, padding, dilation }
    }
}

/// One 1-D max-pool's sizes, from its plan step.
#[derive(Clone, Copy, Debug)]
struct Geometry {
    channels: usize,
    length: usize,
    out_length: usize,
    window: usize,
    stride: usize,
    padding: usize,
    dilation: usize,
}

impl Geometry {
    fn in_len(&self) -> usize {
        self.channels * self.length
    }

    fn out_len(&self) -> usize {
        self.channels * self.out_length
    }

    /// Index in `row` (one channel of the signal) of the maximum of window `o` (see the module
    /// doc).
    #[cfg(test)]
    #[inline(always)]
    fn argmax<F: Float>(&self, row: &[F], o: usize) -> usize {
        let mut best: Option<usize> = None;
        for j in 0..self.window {
            // tap j reads o·s + j·d − p: before the signal, skip it; past it, so are the rest
            let Some(at) = (o * self.stride + j * self.dilation).checked_sub(self.padding) else { continue };
            if at >= self.length {
                break;
            }
            // the first, or greater, or NaN (which is not even equal to itself)
            let take = best.is_none_or(|b| row[at] > row[b] || row[at].partial_cmp(&row[at]).is_none());
            if take {
                best = Some(at);
            }
        }
        best.expect("every window holds a value of the signal (padding is at most half the window)")
    }

    /// Whether the windows tile the signal: no padding or dilation, and the 2-D pool's windows
    /// over it as an image of height 1 tile it ([`super::pool::Geometry::tiles`]).
    #[cfg(any(test, feature = "cuda"))]
    fn tiles(&self) -> bool {
        let image = |length| Shape::image(self.channels, 1, length);
        let g = super::pool::Geometry::new(image(self.length), image(self.out_length), (1, self.window), (1, self.stride));
        self.padding == 0 && self.dilation == 1 && g.tiles()
    }

    /// The outputs whose windows lie wholly inside the signal (no tap in the padding).
    fn inner(&self) -> std::ops::Range<usize> {
        let (s, p) = (self.stride, self.padding);
        let reach = (self.window - 1) * self.dilation;
        // o·s − p ≥ 0 and o·s − p + reach < length
        let first = p.div_ceil(s).min(self.out_length);
        let end = (self.length + p).checked_sub(reach).map_or(0, |room| room.div_ceil(s)).clamp(first, self.out_length);
        first..end
    }

    /// [`Geometry::argmax`] with the window's taps inside the signal found first and the
    /// running maximum kept by selects, not branches (the winner is unpredictable on real data,
    /// so a branch a tap mispredicts often); the same index.
    #[inline(always)]
    fn argmax_fast(&self, row: &[f32], o: usize) -> usize {
        let (start, d, p) = (o * self.stride, self.dilation, self.padding);
        // tap j reads start + j·d − p: the taps first..end are inside the signal (at least
        // one: padding is at most half the window)
        let first = p.saturating_sub(start).div_ceil(d);
        let end = (self.length + p - start).div_ceil(d).min(self.window);
        let mut at = start + first * d - p;
        let mut best = row[at];
        for j in first + 1..end {
            let i = start + j * d - p;
            let v = row[i];
            // the first, or greater, or NaN, as `argmax`
            let take = v > best || v.is_nan();
            at = std::hint::select_unpredictable(take, i, at);
            best = std::hint::select_unpredictable(take, v, best);
        }
        at
    }

    /// The kernels' sizes: channels, length, out length, window, stride, padding, dilation,
    /// batch; a Shape error where the batch's input is too large for one kernel.
    #[cfg(feature = "cuda")]
    fn dims(&self, batch: usize) -> Result<[i32; 8]> {
        use crate::cuda::int;
        int(batch * self.in_len())?;
        let sizes = [self.channels, self.length, self.out_length, self.window, self.stride, self.padding, self.dilation, batch];
        let mut out = [0; 8];
        for (o, v) in out.iter_mut().zip(sizes) {
            *o = int(v)?;
        }
        Ok(out)
    }
}

/// One sample's outputs.
#[cfg(test)]
fn forward_sample<F: Float>(g: &Geometry, xs: &[F], ys: &mut [F]) {
    for (row, out) in xs.chunks_exact(g.length).zip(ys.chunks_exact_mut(g.out_length)) {
        for (o, y) in out.iter_mut().enumerate() {
            *y = row[g.argmax(row, o)];
        }
    }
}

/// [`forward_sample`], fast: windows wholly inside the signal by a select a tap (no bounds, no
/// branch), the others through [`Geometry::argmax_fast`]; the same values.
fn forward_sample_fast(g: &Geometry, xs: &[f32], ys: &mut [f32]) {
    let (inner, (s, d, p)) = (g.inner(), (g.stride, g.dilation, g.padding));
    for (row, out) in xs.chunks_exact(g.length).zip(ys.chunks_exact_mut(g.out_length)) {
        for o in (0..inner.start).chain(inner.end..g.out_length) {
            out[o] = row[g.argmax_fast(row, o)];
        }
        if (g.window, s, d) == (2, 2, 1) && !inner.is_empty() {
            // windows of two side by side (`max_pool1d(2)`): the pairs from 2·first − p on
            let from = 2 * inner.start - p;
            pairs_max(&row[from..from + 2 * inner.len()], &mut out[inner.clone()]);
            continue;
        }
        for o in inner.clone() {
            let start = o * s - p;
            let mut best = row[start];
            for j in 1..g.window {
                let v = row[start + j * d];
                // the first, or greater, or NaN, as `argmax`
                best = std::hint::select_unpredictable(v > best || v.is_nan(), v, best);
            }
            out[o] = best;
        }
    }
}

/// out[k] = x[2k], or x[2k + 1] where it is greater or NaN (as `argmax` chooses in a window of
/// two), for each k; x holds 2·out.len() values. On 16 lanes where the CPU has them, the pairs
/// split by permutes.
fn pairs_max(x: &[f32], out: &mut [f32]) {
    assert_eq!(x.len(), 2 * out.len(), "pairs_max: not two values an output");
    #[cfg(target_arch = "x86_64")]
    if crate::cpu::isa::Isa::best() == crate::cpu::isa::Isa::Avx512 {
        // SAFETY: x holds 2·out.len() values (checked above); AVX-512F present.
        return unsafe { avx512::pairs_max(x.as_ptr(), out.as_mut_ptr(), out.len()) };
    }
    for (o, pair) in out.iter_mut().zip(x.chunks_exact(2)) {
        let take = pair[1] > pair[0] || pair[1].is_nan();
        *o = std::hint::select_unpredictable(take, pair[1], pair[0]);
    }
}

/// [`pairs_max`] on 16 lanes.
#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    /// out[k] for k < n from the pairs of x (2·n values).
    ///
    /// # Safety
    /// x holds 2·n values, out n; AVX-512F present.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn pairs_max(x: *const f32, out: *mut f32, n: usize) {
        let evens = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
        let odds = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
        // SAFETY: group k0 loads x's values below 2·n and stores out's below n, by masks.
        unsafe {
            for k0 in (0..n).step_by(16) {
                let lanes = |len: usize| if len >= 16 { 0xFFFF } else { ((1u32 << len) - 1) as __mmask16 };
                let rest = 2 * (n - k0);
                let (a, b) = (
                    _mm512_maskz_loadu_ps(lanes(rest), x.add(2 * k0)),
                    _mm512_maskz_loadu_ps(lanes(rest.saturating_sub(16)), x.add(2 * k0 + 16)),
                );
                let (first, second) = (_mm512_permutex2var_ps(a, evens, b), _mm512_permutex2var_ps(a, odds, b));
                // the second where it is greater or NaN
                let take = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(second, first) | _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(second, second);
                _mm512_mask_storeu_ps(out.add(k0), lanes(n - k0), _mm512_mask_blend_ps(take, first, second));
            }
        }
    }
}

/// [`backward_sample`], fast, as [`forward_sample_fast`]: the same sums.
fn backward_sample_fast(g: &Geometry, xs: &[f32], dys: &[f32], dxs: &mut [f32]) {
    dxs.fill(0.0);
    let (inner, (s, d, p)) = (g.inner(), (g.stride, g.dilation, g.padding));
    let rows = xs.chunks_exact(g.length).zip(dxs.chunks_exact_mut(g.length)).zip(dys.chunks_exact(g.out_length));
    for ((row, drow), dy) in rows {
        for (o, &dy) in dy.iter().enumerate() {
            let at = if inner.contains(&o) {
                let start = o * s - p;
                let (mut at, mut best) = (start, row[start]);
                for j in 1..g.window {
                    let (i, v) = (start + j * d, row[start + j * d]);
                    let take = v > best || v.is_nan();
                    at = std::hint::select_unpredictable(take, i, at);
                    best = std::hint::select_unpredictable(take, v, best);
                }
                at
            } else {
                g.argmax_fast(row, o)
            };
            drow[at] += dy;
        }
    }
}

/// One sample's input gradient, overwritten: each dy added at its window's maximum, in output
/// order.
#[cfg(test)]
fn backward_sample<F: Float>(g: &Geometry, xs: &[F], dys: &[F], dxs: &mut [F]) {
    dxs.iter_mut().for_each(|v| *v = F::ZERO);
    let rows = xs.chunks_exact(g.length).zip(dxs.chunks_exact_mut(g.length)).zip(dys.chunks_exact(g.out_length));
    for ((row, drow), dy) in rows {
        for (o, &d) in dy.iter().enumerate() {
            drow[g.argmax(row, o)] += d;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::poisoned;

    #[test]
    fn the_first_maximum_inside_the_signal_takes_the_gradient() {
        // window 3, stride 2, padding 1, dilation 1 over 7 values: windows at −1..2, 1..4, 3..6, 5..8
        let g = Geometry { channels: 1, length: 7, out_length: 4, window: 3, stride: 2, padding: 1, dilation: 1 };
        let x = [-5.0f32, -7.0, 3.0, 3.0, 1.0, 2.0, 2.0];
        let mut y = poisoned(4);
        forward_sample(&g, &x, &mut y);
        // the padding is never the maximum, even of negative values; ties go to the first
        assert_eq!(y, [-5.0, 3.0, 3.0, 2.0]);
        let mut dx = poisoned(7);
        backward_sample(&g, &x, &[1.0, 2.0, 4.0, 8.0], &mut dx);
        assert_eq!(dx, [1.0, 0.0, 2.0, 4.0, 0.0, 8.0, 0.0]);
        // dilation 3: window o reads o·1 + {0, 3}
        let g = Geometry { channels: 1, length: 5, out_length: 2, window: 2, stride: 1, padding: 0, dilation: 3 };
        let mut y = poisoned(2);
        forward_sample(&g, &[1.0f32, 9.0, 0.0, 4.0, 2.0], &mut y);
        assert_eq!(y, [4.0, 9.0]);
    }

    /// The select-based argmax picks the spec's index, and the fast sample loops give the
    /// spec's values and gradients, in every window of every valid geometry up to window 5,
    /// stride 3, dilation 3 and 12 values, over ties and NaN.
    #[test]
    fn the_fast_argmax_picks_the_specs_index() {
        let mut rng = crate::testutil::Rng::new(8);
        let mut windows = 0;
        for (window, stride, dilation, length) in
            // (and rows of 33 and 71: several vectors of windows side by side)
            (1..=5)
                .flat_map(|w| (1..=3).flat_map(move |s| (1..=3).flat_map(move |d| (1..=12).chain([33, 71]).map(move |l| (w, s, d, l)))))
        {
            for padding in 0..=window / 2 {
                let pool = MaxPool1d { window, stride, padding, dilation };
                let Ok(Shape::Signal { length: out_length, .. }) = pool.output_shape(Shape::signal(1, length)) else { continue };
                let g = Geometry { channels: 1, length, out_length, window, stride, padding, dilation };
                for _ in 0..8 {
                    // ties (three values) and a NaN in about one value of six
                    let row: Vec<f32> = rng.ints(length).iter().map(|v| if *v > 3.0 { f32::NAN } else { (v % 3.0).abs() }).collect();
                    for o in 0..out_length {
                        assert_eq!(g.argmax_fast(&row, o), g.argmax(&row, o), "{g:?} window {o} of {row:?}");
                        windows += 1;
                    }
                    // and the fast sample loops (windows inside and at the edges) against the spec's
                    let (mut want, mut got) = (poisoned(out_length), poisoned(out_length));
                    forward_sample(&g, &row, &mut want);
                    forward_sample_fast(&g, &row, &mut got);
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&got), bits(&want), "{g:?} forward of {row:?}");
                    let dy = rng.ints(out_length);
                    let (mut want, mut got) = (poisoned(length), poisoned(length));
                    backward_sample(&g, &row, &dy, &mut want);
                    backward_sample_fast(&g, &row, &dy, &mut got);
                    assert_eq!(got, want, "{g:?} backward of {row:?}");
                }
            }
        }
        assert!(windows > 10_000, "{windows} windows checked");
    }

    /// The 1-D windows tile a signal as the 2-D pool's tile an image of height 1, and never with
    /// padding or dilation.
    #[test]
    fn windows_tile_only_an_unpadded_undilated_signal_they_cover() {
        let tiles = |length, window, stride, padding, dilation| {
            let pool = MaxPool1d { window, stride, padding, dilation };
            let Ok(Shape::Signal { length: out_length, .. }) = pool.output_shape(Shape::signal(2, length)) else { unreachable!() };
            Geometry { channels: 2, length, out_length, window, stride, padding, dilation }.tiles()
        };
        assert!(tiles(12, 3, 3, 0, 1) && tiles(7, 1, 1, 0, 1) && tiles(5, 5, 5, 0, 1));
        // the last value left out, overlapping windows, gaps
        assert!(!tiles(13, 3, 3, 0, 1) && !tiles(12, 3, 2, 0, 1) && !tiles(12, 2, 3, 0, 1));
        // padding or dilation where the lengths alone would tile: 9 padded by 1 in windows of 3,
        // windows of 1 dilated by 3
        assert!(!tiles(9, 3, 3, 1, 1) && !tiles(6, 1, 1, 0, 3));
    }

    #[test]
    fn lengths_follow_pytorchs_rule_and_bad_options_are_refused() {
        let pool = |window, stride, padding, dilation| MaxPool1d { window, stride, padding, dilation };
        for (length, p, want) in
            [(250, pool(2, 2, 0, 1), 125), (7, pool(3, 2, 1, 1), 4), (5, pool(2, 1, 0, 3), 2), (9, pool(4, 3, 2, 2), 3)]
        {
            assert_eq!(p.output_shape(Shape::signal(3, length)), Ok(Shape::signal(3, want)), "{p:?} on {length}");
        }
        assert!(pool(2, 2, 2, 1).output_shape(Shape::signal(1, 8)).unwrap_err().contains("more than half the window"));
        assert!(pool(2, 2, 0, 1).output_shape(Shape::image(1, 1, 8)).unwrap_err().contains("needs a signal input"));
        assert!(pool(3, 1, 0, 4).output_shape(Shape::signal(1, 8)).unwrap_err().contains("spans 9"));
        // window 2 dilated by 2 with padding 1 over one value reads −1 and 1: padding only
        assert!(pool(2, 1, 1, 2).output_shape(Shape::signal(1, 1)).unwrap_err().contains("holds no value of the signal"));
        assert_eq!(pool(2, 1, 1, 2).output_shape(Shape::signal(1, 2)), Ok(Shape::signal(1, 2)));
    }

    #[test]
    fn gradients_and_the_fast_path_match_the_spec() {
        use crate::layers::conv1d::Conv1dOptions;
        use crate::layers::gradcheck::{fast_matches_spec, gradients_match_finite_differences};
        let chain = || {
            Chain::new(Shape::signal(2, 23))
                .conv1d_with(3, 2, crate::Tanh, Conv1dOptions { stride: 1, padding: 1, dilation: 1 })
                .max_pool1d_with(3, Pool1dOptions { stride: 2, padding: 1, dilation: 2 })
                .max_pool1d(2)
                .flatten()
                .dense(3, crate::Identity)
        };
        gradients_match_finite_differences("maxpool1d", chain(), &[crate::Loss::Mse], 41);
        for threads in [1, 2, 3] {
            fast_matches_spec(&chain().build().unwrap().with_threads(threads).unwrap(), 42, "maxpool1d");
        }
    }
}
