//! GRU and LSTM through the public API on the CPU: a stream over n steps gives, bit for bit, the
//! outputs of a forward pass over the n steps (from zero and from set initial states, on one
//! thread and two, with batches that change size); final states; model files; what a stream and
//! the state setters refuse; and that a GRU and an LSTM learn a sequence task.

use flatnn::prelude::*;
use flatnn::testutil::{Rng, TempDir};
use flatnn::Layer;

fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

/// The layers of the models checked, over `features` inputs: every recurrent layer kind, with
/// both outputs, stacked, and a dense layer after one that keeps its last step.
fn chains(steps: usize, features: usize, hidden: usize) -> Vec<(String, Chain, bool)> {
    let input = Shape::sequence(steps, features);
    vec![
        (format!("gru {hidden}"), Chain::new(input).gru(hidden, RnnOutput::Sequence), true),
        (format!("lstm {hidden}"), Chain::new(input).lstm(hidden, RnnOutput::Sequence), true),
        (
            format!("lstm {hidden} → gru 9 last → dense"),
            Chain::new(input).lstm(hidden, RnnOutput::Sequence).gru(9, RnnOutput::LastStep).dense(2, Tanh),
            false,
        ),
        (
            format!("gru {hidden} → lstm 20 last → dense"),
            Chain::new(input).gru(hidden, RnnOutput::Sequence).lstm(20, RnnOutput::LastStep).dense(3, Identity),
            false,
        ),
    ]
}

/// Random initial states for every recurrent layer of `model`, set in both caches.
fn set_states(model: &Model, batch: usize, rng: &mut Rng, cache: &mut Cache, stream: &mut Stream) {
    for (index, step) in model.plan().steps.iter().enumerate() {
        let per_sample = match step.layer {
            Layer::Gru(gru) => gru.hidden,
            Layer::Lstm(lstm) => 2 * lstm.hidden,
            _ => continue,
        };
        let values = rng.uniform(batch * per_sample);
        cache.set_state(index, &values).unwrap();
        stream.set_state(index, &values).unwrap();
    }
}

#[test]
fn streaming_n_steps_is_the_forward_pass_over_n_steps_bit_for_bit() {
    let mut rng = Rng::new(3);
    let mut checked = 0;
    for threads in [1, 2] {
        for (steps, features, hidden) in [(1, 1, 1), (5, 3, 16), (7, 1, 17), (4, 8, 40)] {
            for (name, chain, per_step) in chains(steps, features, hidden) {
                for (batch, from_states) in [(1, false), (3, true), (9, true)] {
                    let model = chain.clone().build().unwrap().init(Init::GlorotUniform, 5).with_threads(threads).unwrap();
                    let x = rng.uniform(batch * steps * features);
                    let mut cache = model.preallocate(batch).unwrap();
                    let mut stream = model.stream(batch).unwrap();
                    if from_states {
                        set_states(&model, batch, &mut rng, &mut cache, &mut stream);
                    }
                    cache.set_inputs(&x).unwrap();
                    let whole = model.forward(&mut cache).unwrap().to_vec();
                    let per_call = whole.len() / batch / if per_step { steps } else { 1 };
                    for t in 0..steps {
                        let step_x: Vec<f32> = (0..batch).flat_map(|s| x[(s * steps + t) * features..][..features].to_vec()).collect();
                        let out = stream.step(&step_x).unwrap().to_vec();
                        let want: Vec<f32> = if per_step {
                            (0..batch).flat_map(|s| whole[(s * steps + t) * per_call..][..per_call].to_vec()).collect()
                        } else if t + 1 == steps {
                            whole.clone()
                        } else {
                            continue;
                        };
                        assert!(same_bits(&out, &want), "{name}, {threads} threads, batch {batch}, step {t}: {out:?} vs {want:?}");
                        checked += 1;
                    }
                    // the stream's state is the forward pass's final state
                    for (index, step) in model.plan().steps.iter().enumerate() {
                        if matches!(step.layer, Layer::Gru(_) | Layer::Lstm(_)) {
                            let (streamed, final_state) = (stream.state(index).unwrap(), cache.final_state(index).unwrap());
                            assert!(same_bits(&streamed, &final_state), "{name}: layer {index}'s state");
                        }
                    }
                }
            }
        }
    }
    assert!(checked > 100, "{checked} comparisons");
}

#[test]
fn a_stream_takes_batches_of_any_size_and_starts_over_on_reset() {
    let model =
        Chain::new(Shape::sequence(3, 2)).gru(8, RnnOutput::LastStep).dense(1, Identity).build().unwrap().init(Init::GlorotUniform, 1);
    let mut stream = model.stream(2).unwrap();
    let steps = [[0.1f32, 0.2, -0.3, 0.4], [0.5, -0.6, 0.7, 0.8], [-0.9, 1.0, 0.1, 0.2]];
    let first: Vec<Vec<f32>> = steps.iter().map(|x| stream.step(x).unwrap().to_vec()).collect();
    stream.reset_state().unwrap();
    let again: Vec<Vec<f32>> = steps.iter().map(|x| stream.step(x).unwrap().to_vec()).collect();
    assert_eq!(first, again);
    // sequence 0 alone: the same outputs as in a batch of two, and sequence 1 does not move
    stream.reset_state().unwrap();
    let before = stream.state(0).unwrap();
    for (t, x) in steps.iter().enumerate() {
        let out = stream.step(&x[..2]).unwrap();
        assert!(same_bits(out, &first[t][..1]), "step {t}");
    }
    let after = stream.state(0).unwrap();
    assert_eq!(&after[8..], &before[8..], "sequence 1 moved");
    assert!(matches!(stream.step(&[0.0; 6]), Err(Error::Capacity { batch: 3, capacity: 2 })));
    assert!(matches!(stream.step(&[0.0; 3]), Err(Error::Shape(_))));
    assert!(matches!(stream.step(&[f32::NAN, 0.0]), Err(Error::NonFinite { .. })));
}

#[test]
fn final_states_are_the_last_hidden_and_cell_states() {
    let (steps, hidden) = (6, 5);
    let model = Chain::new(Shape::sequence(steps, 2)).lstm(hidden, RnnOutput::Sequence).build().unwrap().init(Init::GlorotUniform, 2);
    let mut cache = model.preallocate(2).unwrap();
    cache.set_inputs(&Rng::new(1).uniform(2 * steps * 2)).unwrap();
    let out = model.forward(&mut cache).unwrap().to_vec();
    let state = cache.final_state(0).unwrap();
    assert_eq!(state.len(), 2 * 2 * hidden);
    for s in 0..2 {
        // h_T is the last step's output; c_T is bounded by the cell's step: |c_t| ≤ |c_{t−1}| + 1
        assert_eq!(&state[s * 2 * hidden..][..hidden], &out[(s * steps + steps - 1) * hidden..][..hidden]);
        assert!(state[s * 2 * hidden + hidden..][..hidden].iter().all(|c| c.abs() <= steps as f32));
    }
    // h_T = o·tanh(c_T), so |h_T| ≤ |tanh(c_T)|
    for (h, c) in state[..hidden].iter().zip(&state[hidden..2 * hidden]) {
        assert!(h.abs() <= c.tanh().abs() + 1e-6, "h {h}, c {c}");
    }
}

#[test]
fn what_a_stream_and_the_state_setters_refuse() {
    let flat = Chain::new(Shape::sequence(4, 2)).gru(3, RnnOutput::Sequence).flatten().dense(2, Identity).build().unwrap();
    match flat.stream(1) {
        Err(Error::Config(msg)) => assert!(msg.contains("layer 1") && msg.contains("mixes time steps"), "{msg}"),
        other => panic!("expected a Config error, got {:?}", other.map(|_| ())),
    }
    let vector = Chain::new(Shape::vector(3)).dense(2, Relu).build().unwrap();
    assert!(matches!(vector.stream(1), Err(Error::Config(_))));
    let model = Chain::new(Shape::sequence(4, 2)).gru(3, RnnOutput::LastStep).dense(2, Identity).build().unwrap();
    assert!(matches!(model.stream(0), Err(Error::Config(_))));
    let mut cache = model.preallocate(2).unwrap();
    for (layer, values, what) in [
        (1, vec![0.0; 3], "is not a recurrent layer"),
        (2, vec![0.0; 3], "the model has 2 layers"),
        (0, vec![0.0; 4], "not a whole number of samples of 3"),
        (0, vec![0.0; 9], "up to the capacity of 2"),
    ] {
        let err = cache.set_state(layer, &values).unwrap_err().to_string();
        assert!(err.contains(what), "{err}");
    }
    assert!(matches!(cache.set_state(0, &[0.0, f32::INFINITY, 0.0]), Err(Error::NonFinite { .. })));
}

#[test]
fn recurrent_models_round_trip_through_model_files() {
    let dir = TempDir::new("recurrent");
    let chain = Chain::new(Shape::sequence(5, 3)).lstm(6, RnnOutput::Sequence).gru(4, RnnOutput::LastStep).dense(2, Identity);
    let model = chain.build().unwrap().init(Init::GlorotNormal, 9);
    let path = dir.join("rnn.safetensors");
    model.save(&path).unwrap();
    let loaded = Model::load(&path).unwrap();
    assert_eq!(loaded.plan(), model.plan());
    assert_eq!(loaded.parameters().unwrap(), model.parameters().unwrap());
    let names: Vec<String> = loaded.plan().steps[..2]
        .iter()
        .flat_map(|s| s.tensors.iter().map(move |t| format!("{}.{} {:?}", s.module, t.name, t.shape)))
        .collect();
    assert_eq!(
        names,
        [
            "0.weight_ih_l0 [24, 3]",
            "0.weight_hh_l0 [24, 6]",
            "0.bias_ih_l0 [24]",
            "0.bias_hh_l0 [24]",
            "1.weight_ih_l0 [12, 6]",
            "1.weight_hh_l0 [12, 4]",
            "1.bias_ih_l0 [12]",
            "1.bias_hh_l0 [12]"
        ]
    );
    let x = Rng::new(4).uniform(2 * 15);
    let (mut a, mut b) = (model.preallocate(2).unwrap(), loaded.preallocate(2).unwrap());
    a.set_inputs(&x).unwrap();
    b.set_inputs(&x).unwrap();
    assert_eq!(model.forward(&mut a).unwrap(), loaded.forward(&mut b).unwrap());
    println!("{loaded}");
}

/// Sequences of 12 steps of ±1 noise; the target is the sum of steps 2 and 5 (a memory task a
/// model without state cannot do past chance).
fn memory_task(rng: &mut Rng, batch: usize) -> (Vec<f32>, Vec<f32>) {
    let x: Vec<f32> = rng.uniform(batch * 12).iter().map(|v| v.signum()).collect();
    let y = (0..batch).map(|s| x[s * 12 + 2] + x[s * 12 + 5]).collect();
    (x, y)
}

#[test]
fn a_gru_and_an_lstm_learn_to_remember() {
    for chain in [
        Chain::new(Shape::sequence(12, 1)).gru(16, RnnOutput::LastStep).dense(1, Identity),
        Chain::new(Shape::sequence(12, 1)).lstm(16, RnnOutput::LastStep).dense(1, Identity),
    ] {
        let mut model = chain.build().unwrap().init(Init::GlorotUniform, 4).with_threads(1).unwrap();
        let (mut fwd, mut bwd) = (model.preallocate(32).unwrap(), model.preallocate_grads(32).unwrap());
        let mut opt = Optimizer::new(&model, Optim::adam(1e-2)).unwrap();
        let mut rng = Rng::new(8);
        let mut first = None;
        for _ in 0..1200 {
            let (x, y) = memory_task(&mut rng, 32);
            fwd.set_inputs(&x).unwrap();
            fwd.set_targets(&y).unwrap();
            opt.train_step(&mut model, &mut bwd, &mut fwd, Loss::Mse).unwrap();
            first.get_or_insert(bwd.last_loss().unwrap());
        }
        let (x, y) = memory_task(&mut rng, 32);
        fwd.set_inputs(&x).unwrap();
        fwd.set_targets(&y).unwrap();
        let loss = model.loss(&mut fwd, Loss::Mse).unwrap();
        // the targets' variance is 2: a model that forgot either step would stay at 1 or more
        println!("{:?}: loss {} → {loss}", model.plan().steps[0].layer, first.unwrap());
        assert!(loss < 0.25, "{:?}: loss {loss}", model.plan().steps[0].layer);
    }
}
