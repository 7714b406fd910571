//! Runs a plan over flat buffers: the fast CPU path, and (in `spec`) the plain loops it is
//! tested against. One file per layer kind; the bias and activation pass is shared here.
//!
//! Buffers: `params`/`grads` in the plan's parameter layout; `acts`/`dacts` hold, per region
//! r, `capacity × plan.regions[r]` values, sample-major; a batch ≤ capacity uses the front.

pub mod conv;
pub mod dense;
#[cfg(test)]
mod gradcheck;
pub mod pool;
#[cfg(test)]
pub mod spec;

use crate::activation::Activation;
use crate::chain::{batch_len, Layer, Plan, Step};
use crate::cpu::gemm::GemmWorkspace;
use crate::cpu::pool::Pool;
use crate::cpu::{for_chunks, SharedMut};
use crate::error::{zeros, Result};
use std::ops::Range;

/// Values of region `r` for `batch` samples, in a buffer built for `capacity`.
pub(crate) fn region(plan: &Plan, r: usize, capacity: usize, batch: usize) -> Range<usize> {
    let start = plan.region_offset(r, capacity);
    start..start + batch * plan.regions[r]
}

/// Borrows two ordered, disjoint ranges: the first shared, the second mutable.
pub(crate) fn split2<T>(buf: &mut [T], a: Range<usize>, b: Range<usize>) -> (&[T], &mut [T]) {
    debug_assert!(a.end <= b.start);
    let (lo, hi) = buf.split_at_mut(b.start);
    (&lo[a], &mut hi[..b.end - b.start])
}

/// (channels, pixels per channel) of a parametrised layer's output, for the bias pass.
pub(crate) fn bias_layout(step: &Step) -> (usize, usize) {
    match step.output {
        crate::chain::Shape::Vector(n) => (n, 1),
        crate::chain::Shape::Image { channels, height, width } => (channels, height * width),
    }
}

/// Conv geometry of a step (which must be a conv).
pub(crate) fn conv_geometry(step: &Step) -> conv::Geometry {
    let Layer::Conv { kernel, stride, padding, .. } = step.layer else { unreachable!("not a conv") };
    conv::Geometry::new(step.input, step.output, kernel, stride, padding)
}

/// Max-pool geometry of a step (which must be a pool).
pub(crate) fn pool_geometry(step: &Step) -> pool::Geometry {
    let Layer::MaxPool { window, stride } = step.layer else { unreachable!("not a pool") };
    pool::Geometry::new(step.input, step.output, window, stride)
}

/// Scratch a forward pass needs beyond the activations, allocated once per cache.
pub(crate) struct Workspace {
    pub gemm: GemmWorkspace,
    pub cols: Vec<f32>,
    pub col_len: usize,
}

impl Workspace {
    /// A lowered sample's columns for each of `threads` threads; an error, not an abort, when
    /// they cannot be had.
    pub fn new(plan: &Plan, threads: usize) -> Result<Workspace> {
        let col_len = max_col_len(plan);
        let cols = zeros(batch_len(threads, col_len, "convolution columns")?, || format!("the convolution columns of {threads} threads"))?;
        Ok(Workspace { gemm: GemmWorkspace::new(threads)?, cols, col_len })
    }

    /// No scratch: for a cache whose steps run on a GPU.
    pub fn none() -> Workspace {
        Workspace { gemm: GemmWorkspace::none(), cols: Vec::new(), col_len: 0 }
    }
}

/// Scratch a backward pass needs beyond the gradients: lowered-gradient columns and per-block
/// partial conv weight gradients (see `conv::backward`).
pub(crate) struct GradWorkspace {
    pub dcols: Vec<f32>,
    pub partials: Vec<f32>,
}

impl GradWorkspace {
    /// As [`Workspace::new`], for the backward pass: a lowered gradient's columns a thread, and
    /// the partial conv weight gradients of the sample blocks after the first
    /// ([`conv::wgrad_blocks`], fixed by the capacity, not the thread count).
    pub fn new(plan: &Plan, capacity: usize, threads: usize) -> Result<GradWorkspace> {
        let w_len = conv_steps(plan).map(Step::weight_len).max().unwrap_or(0);
        let dcols = batch_len(threads, max_col_len(plan), "convolution gradient columns")?;
        let partials = batch_len(conv::wgrad_blocks(capacity) - 1, w_len, "partial weight gradients")?;
        Ok(GradWorkspace {
            dcols: zeros(dcols, || format!("the convolution gradient columns of {threads} threads"))?,
            partials: zeros(partials, || "the partial conv weight gradients".into())?,
        })
    }

    /// No scratch: for gradients computed on a GPU.
    pub fn none() -> GradWorkspace {
        GradWorkspace { dcols: Vec::new(), partials: Vec::new() }
    }
}

/// The plan's dense steps.
#[cfg(feature = "cuda")]
pub(crate) fn dense_steps(plan: &Plan) -> impl Iterator<Item = &Step> {
    plan.steps.iter().filter(|s| matches!(s.layer, Layer::Dense { .. }))
}

/// The plan's convolution steps.
pub(crate) fn conv_steps(plan: &Plan) -> impl Iterator<Item = &Step> {
    plan.steps.iter().filter(|s| matches!(s.layer, Layer::Conv { .. }))
}

/// The longest lowered sample (im2col columns) of any convolution in the plan (at most
/// `chain::MAX_VALUES`: `Plan::new` checked a bound of it).
pub(crate) fn max_col_len(plan: &Plan) -> usize {
    conv_steps(plan).map(|s| conv_geometry(s).col_len()).max().unwrap_or(0)
}

/// The fast forward: every step's output for the first `batch` samples.
pub(crate) fn forward(plan: &Plan, params: &[f32], acts: &mut [f32], capacity: usize, batch: usize, pool: &Pool, ws: &mut Workspace) {
    let scratch = conv::Scratch { col_len: ws.col_len, cols: SharedMut::new(&mut ws.cols) };
    for step in &plan.steps {
        let x = region(plan, step.input_region, capacity, batch);
        let z = region(plan, step.z_region, capacity, batch);
        let y = region(plan, step.output_region, capacity, batch);
        let (w_range, b_range) = step.weight_and_bias();
        let (w, b) = (&params[w_range], &params[b_range]);
        match step.layer {
            Layer::Dense { out_features, .. } => {
                let (xs, zs) = split2(acts, x, z.clone());
                dense::forward(pool, &mut ws.gemm, batch, step.input.len(), out_features, w, xs, zs);
            }
            Layer::Conv { .. } => {
                let (xs, zs) = split2(acts, x, z.clone());
                conv::forward(pool, &mut ws.gemm, &scratch, &conv_geometry(step), batch, w, xs, zs);
            }
            Layer::MaxPool { .. } => {
                let (xs, ys) = split2(acts, x, y);
                pool::forward(pool, &pool_geometry(step), batch, xs, ys);
                continue;
            }
            Layer::Flatten => continue,
        }
        let (channels, pixels) = bias_layout(step);
        let act = step.layer.activation();
        if z == y {
            bias_act(pool, act, b, channels, pixels, batch, &mut acts[z], None);
        } else {
            let (zs, ys) = acts[z.start..y.end].split_at_mut(y.start - z.start);
            bias_act(pool, act, b, channels, pixels, batch, zs, Some(&mut ys[..]));
        }
    }
}

/// The fast backward. `dacts` holds the loss gradient in the last step's output region;
/// fills `grads` (overwriting) and every needed activation gradient. The model input's
/// gradient is not computed.
#[allow(clippy::too_many_arguments)]
pub(crate) fn backward(
    plan: &Plan,
    params: &[f32],
    acts: &[f32],
    dacts: &mut [f32],
    grads: &mut [f32],
    capacity: usize,
    batch: usize,
    pool: &Pool,
    ws: &mut Workspace,
    gws: &mut GradWorkspace,
) {
    let scratch = conv::Scratch { col_len: ws.col_len, cols: SharedMut::new(&mut ws.cols) };
    let dscratch = conv::Scratch { col_len: ws.col_len, cols: SharedMut::new(&mut gws.dcols) };
    for step in plan.steps.iter().rev() {
        let x = region(plan, step.input_region, capacity, batch);
        let z = region(plan, step.z_region, capacity, batch);
        let y = region(plan, step.output_region, capacity, batch);
        let need_dx = step.input_region != 0;
        match step.layer {
            Layer::Dense { .. } | Layer::Conv { .. } => {
                let act = step.layer.activation();
                let (channels, pixels) = bias_layout(step);
                if z != y {
                    let (dzs, dys) = dacts[z.start..y.end].split_at_mut(y.start - z.start);
                    act_backward(pool, act, &acts[z.clone()], &acts[y.clone()], &dys[..y.len()], &mut dzs[..z.len()]);
                }
                let (w_range, _) = step.weight_and_bias();
                let (dw, db) = grads[step.params.clone()].split_at_mut(w_range.len());
                let (dxs, dzs) = dacts.split_at_mut(z.start);
                let dz = &dzs[..z.len()];
                bias_grad(channels, pixels, batch, dz, db);
                let dx = need_dx.then(|| &mut dxs[x.clone()]);
                let (w, xs) = (&params[w_range], &acts[x.clone()]);
                if let Layer::Dense { out_features, .. } = step.layer {
                    dense::backward(pool, &mut ws.gemm, batch, step.input.len(), out_features, w, xs, dz, dw, dx);
                } else {
                    let g = conv_geometry(step);
                    conv::backward(pool, &mut ws.gemm, &scratch, &dscratch, &mut gws.partials, &g, batch, w, xs, dz, dw, dx);
                }
            }
            Layer::MaxPool { .. } if need_dx => {
                let (dxs, dys) = dacts.split_at_mut(y.start);
                pool::backward(pool, &pool_geometry(step), batch, &acts[x.clone()], &dys[..y.len()], &mut dxs[x]);
            }
            Layer::MaxPool { .. } | Layer::Flatten => {}
        }
    }
}

/// z[s, c, p] += b[c]; y = act(z) when `y` is given (else the activation is the identity).
/// Both passes run over a block of samples at a time, so the activation reads z from L1.
#[allow(clippy::too_many_arguments)]
fn bias_act(pool: &Pool, act: Activation, b: &[f32], channels: usize, pixels: usize, batch: usize, z: &mut [f32], y: Option<&mut [f32]>) {
    /// Values of z per block: z and y together take 16 KiB, within every L1.
    const BLOCK: usize = 2048;
    let per_sample = channels * pixels;
    let block = (BLOCK / per_sample).max(1) * per_sample;
    let z = SharedMut::new(&mut z[..batch * per_sample]);
    let y = y.map(|y| SharedMut::new(&mut y[..batch * per_sample]));
    for_chunks(pool, batch, (8192 / per_sample).max(1), &|_, samples| {
        let range = samples.start * per_sample..samples.end * per_sample;
        // SAFETY: chunks are disjoint sample ranges.
        let zs = unsafe { z.slice(range.clone()) };
        // SAFETY: as above.
        let mut ys = y.as_ref().map(|y| unsafe { y.slice(range) });
        for (i, zs) in zs.chunks_mut(block).enumerate() {
            for sample in zs.chunks_exact_mut(per_sample) {
                if pixels == 1 {
                    // a dense layer: one bias per value, added as a vector
                    sample.iter_mut().zip(b).for_each(|(v, b)| *v += b);
                } else {
                    for (c, row) in sample.chunks_exact_mut(pixels).enumerate() {
                        row.iter_mut().for_each(|v| *v += b[c]);
                    }
                }
            }
            if let Some(ys) = ys.as_deref_mut() {
                act.apply_slice(zs, &mut ys[i * block..][..zs.len()]);
            }
        }
    });
}

/// dz = dy ⊙ act'(z), element-wise, spread over the pool.
fn act_backward(pool: &Pool, act: Activation, z: &[f32], y: &[f32], dy: &[f32], dz: &mut [f32]) {
    let n = dz.len();
    let dz = SharedMut::new(dz);
    for_chunks(pool, n, 16384, &|_, r| {
        // SAFETY: chunks are disjoint element ranges.
        let dz = unsafe { dz.slice(r.clone()) };
        act.backward_slice(&z[r.clone()], &y[r.clone()], &dy[r], dz);
    });
}

/// db[c] = Σ_{s,p} dz[s, c, p], in a fixed order.
fn bias_grad(channels: usize, pixels: usize, batch: usize, dz: &[f32], db: &mut [f32]) {
    db.fill(0.0);
    for sample in dz[..batch * channels * pixels].chunks_exact(channels * pixels) {
        if pixels == 1 {
            db.iter_mut().zip(sample).for_each(|(d, v)| *d += v);
        } else {
            for (d, row) in db.iter_mut().zip(sample.chunks_exact(pixels)) {
                *d += lane_sum(row);
            }
        }
    }
}

/// Σ row with 8 partial sums (lane l takes the values at l mod 8), then the lanes and the
/// tail in a fixed order: vectorises (a plain `sum` is one serial chain of adds) and stays
/// deterministic.
fn lane_sum(row: &[f32]) -> f32 {
    let mut lanes = [0.0f32; 8];
    let chunks = row.chunks_exact(8);
    let tail = chunks.remainder();
    for chunk in chunks {
        lanes.iter_mut().zip(chunk).for_each(|(s, &v)| *s += v);
    }
    lanes.iter().sum::<f32>() + tail.iter().sum::<f32>()
}
