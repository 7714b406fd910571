"""ONNX files of the zoo's networks: exported from the PyTorch twin where torch imports, else built
with onnx.helper from the same layer list; and a reader for the safetensors files flatnn writes.

Both ways give a graph with one input "x" (batch, *input shape) and one output "y"
(batch, outputs), the batch dimension symbolic, opset 17. GELU is written as PyTorch's exporter
writes nn.GELU() (x * 0.5 * (1 + erf(x / sqrt 2))), which ONNX Runtime fuses into one Gelu node.
"""

import json
import math
import os
import struct
import tempfile

import numpy as np

import zoo_models

IR_VERSION = 8
OPSET = 17


def read_safetensors(path):
    """{name: array} and the metadata of a safetensors file: little-endian F32 as float32, and
    I64 (batch norm's num_batches_tracked) as int64."""
    with open(path, "rb") as f:
        data = f.read()
    (header_len,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + header_len])
    meta = header.pop("__metadata__", {})
    body = data[8 + header_len :]
    out = {}
    types = {"F32": ("<f4", np.float32), "I64": ("<i8", np.int64)}
    for name, info in header.items():
        if info["dtype"] not in types:
            raise ValueError(f"{path}: tensor {name} is {info['dtype']}, expected F32 or I64")
        stored, kept = types[info["dtype"]]
        begin, end = info["data_offsets"]
        out[name] = np.frombuffer(body[begin:end], dtype=stored).reshape(info["shape"]).astype(kept)
    return out, meta


def random_weights(name, seed):
    """Weights drawn as PyTorch's default init would scale them (uniform ±1/sqrt(fan_in)); only
    their shapes matter for timing."""
    rng = np.random.default_rng(seed)
    out = {}
    for tensor, shape in zoo_models.tensors(name):
        if tensor.endswith("num_batches_tracked"):
            out[tensor] = np.zeros(shape, dtype=np.int64)
        elif tensor.endswith("running_var"):
            out[tensor] = np.ones(shape, dtype=np.float32)
        else:
            fan_in = int(np.prod(shape[1:])) if len(shape) > 1 else shape[0]
            out[tensor] = rng.uniform(-1, 1, size=shape).astype(np.float32) / math.sqrt(fan_in)
    return out


def build(name, weights):
    """The network `name` with `weights` ({state_dict name: array}) as an onnx.ModelProto."""
    from onnx import TensorProto, helper, numpy_helper

    nodes, inits = [], []
    counter = [0]

    def fresh(prefix):
        counter[0] += 1
        return f"{prefix}{counter[0]}"

    def const(value):
        n = fresh("c")
        inits.append(numpy_helper.from_array(np.array(value, dtype=np.float32), n))
        return n

    def activation(act, x):
        if act == "identity":
            return x
        if act in ("relu", "sigmoid", "tanh"):
            y = fresh("a")
            nodes.append(helper.make_node({"relu": "Relu", "sigmoid": "Sigmoid", "tanh": "Tanh"}[act], [x], [y]))
            return y
        if act == "gelu":
            d, e, a, m, y = (fresh("g") for _ in range(5))
            nodes.append(helper.make_node("Div", [x, const(math.sqrt(2.0))], [d]))
            nodes.append(helper.make_node("Erf", [d], [e]))
            nodes.append(helper.make_node("Add", [e, const(1.0)], [a]))
            nodes.append(helper.make_node("Mul", [x, a], [m]))
            nodes.append(helper.make_node("Mul", [m, const(0.5)], [y]))
            return y
        raise ValueError(f"unknown activation {act}")

    def init(tensor, value=None):
        """An initializer named `tensor`: the weight of that name (float32), or `value(weights)`
        as it is typed."""
        array = np.ascontiguousarray(weights[tensor], dtype=np.float32) if value is None else np.ascontiguousarray(value(weights))
        inits.append(numpy_helper.from_array(array, tensor))
        return tensor

    shape, layers, _ = zoo_models.MODELS[name]
    x = emit(layers, shape, "", "x", nodes, fresh, init, activation, helper)
    nodes.append(helper.make_node("Identity", [x], ["y"]))
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", *zoo_models.input_shape(name)])]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", zoo_models.output_len(name)])]
    graph = helper.make_graph(nodes, name, inputs, outputs, initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="flatnn-zoo")
    # a newer onnx package writes an IR version an older ONNX Runtime refuses; opset 17 needs
    # only IR 8
    model.ir_version = IR_VERSION
    import onnx

    onnx.checker.check_model(model)
    return model


def emit(layers, shape, prefix, x, nodes, fresh, init, activation, helper):
    """Appends the nodes of `layers` (from `shape`, module paths after `prefix`) reading `x` to
    `nodes`; returns the name of their output. Batch norm is inference's (the running
    statistics); a residual block adds its body's output to its input."""
    for module, layer, shape, _ in zoo_models.walk_layers(layers, shape, prefix):
        kind = layer[0]
        if kind in ("dense", "conv", "conv1d"):
            w, b = init(f"{module}.weight"), init(f"{module}.bias")
            z = fresh("z")
            if kind == "dense":
                nodes.append(helper.make_node("Gemm", [x, w, b], [z], transB=1))
            else:
                k, pad, dims = layer[2], layer[3], 2 if kind == "conv" else 1
                nodes.append(
                    helper.make_node("Conv", [x, w, b], [z], kernel_shape=[k] * dims, pads=[pad] * 2 * dims, strides=[1] * dims)
                )
            x = activation(layer[-1], z)
        elif kind in ("maxpool", "maxpool1d"):
            y, dims = fresh("p"), 2 if kind == "maxpool" else 1
            nodes.append(helper.make_node("MaxPool", [x], [y], kernel_shape=[layer[1]] * dims, strides=[layer[1]] * dims))
            x = y
        elif kind == "globalavgpool":
            p, y = fresh("g"), fresh("f")
            nodes.append(helper.make_node("GlobalAveragePool", [x], [p]))
            nodes.append(helper.make_node("Flatten", [p], [y], axis=1))
            x = y
        elif kind == "batchnorm":
            z = fresh("n")
            names = [init(f"{module}.{t}") for t in ("weight", "bias", "running_mean", "running_var")]
            nodes.append(helper.make_node("BatchNormalization", [x, *names], [z], epsilon=1e-5))
            x = activation(layer[-1], z)
        elif kind in zoo_models.GATES:
            x = recurrent(module, layer, x, nodes, fresh, init, helper)
        elif kind == "residual":
            body = emit(layer[1], shape, f"{module}.body.", x, nodes, fresh, init, activation, helper)
            z = fresh("r")
            nodes.append(helper.make_node("Add", [x, body], [z]))
            x = activation(layer[-1], z)
        else:
            y = fresh("f")
            nodes.append(helper.make_node("Flatten", [x], [y], axis=1))
            x = y
    return x


def recurrent(module, layer, x, nodes, fresh, init, helper):
    """An ONNX GRU or LSTM node over x (batch, steps, features), PyTorch's weights (gate blocks
    r, z, n reordered to ONNX's z, r, h with linear_before_reset = 1, PyTorch's formula; i, f, g, o
    to i, o, f, c): the time-major transposes around it, and the output sequence (batch, steps,
    hidden) or the last step's state (batch, hidden). Returns the output's name."""
    kind, hidden, last = layer
    order = [1, 0, 2] if kind == "gru" else [0, 3, 1, 2]

    def blocks(a):
        return np.concatenate([a[g * hidden:(g + 1) * hidden] for g in order], axis=0).astype(np.float32)

    w = init(f"{module}.weight_ih_l0", lambda ws: blocks(ws[f"{module}.weight_ih_l0"])[None])
    r = init(f"{module}.weight_hh_l0", lambda ws: blocks(ws[f"{module}.weight_hh_l0"])[None])
    # ONNX's B: the input biases, then the recurrent ones
    b = init(f"{module}.bias", lambda ws: np.concatenate([blocks(ws[f"{module}.bias_ih_l0"]), blocks(ws[f"{module}.bias_hh_l0"])])[None])
    axis = init(fresh("axis"), lambda _: np.array([0 if last == "last" else 1], dtype=np.int64))
    time_major, y, y_h = fresh("t"), fresh("y"), fresh("yh")
    nodes.append(helper.make_node("Transpose", [x], [time_major], perm=[1, 0, 2]))
    if kind == "gru":
        nodes.append(helper.make_node("GRU", [time_major, w, r, b], [y, y_h], hidden_size=hidden, linear_before_reset=1))
    else:
        nodes.append(helper.make_node("LSTM", [time_major, w, r, b], [y, y_h], hidden_size=hidden))
    out = fresh("o")
    if last == "last":
        # Y_h (1, batch, hidden) -> (batch, hidden)
        nodes.append(helper.make_node("Squeeze", [y_h, axis], [out]))
        return out
    # Y (steps, 1, batch, hidden) -> (steps, batch, hidden) -> (batch, steps, hidden)
    squeezed = fresh("s")
    nodes.append(helper.make_node("Squeeze", [y, axis], [squeezed]))
    nodes.append(helper.make_node("Transpose", [squeezed], [out], perm=[1, 0, 2]))
    return out


def model_bytes(name, seed, torch=None):
    """The network `name` as ONNX bytes, and how they were made: with `torch` (the module), the
    export of the twin PyTorch initialises after manual_seed(seed), or, where the export fails,
    onnx.helper's graph of the twin's weights; without, onnx.helper's of random_weights(name, seed)."""
    if torch is None:
        return build(name, random_weights(name, seed)).SerializeToString(), "onnx.helper"
    torch.manual_seed(seed)
    model = zoo_models.torch_twin(name).eval()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, f"{name}.onnx")
        try:
            source = export_torch(model, name, path)
            with open(path, "rb") as f:
                return f.read(), source
        except Exception as e:  # fall back to the same weights through onnx.helper
            weights = {k: v.detach().numpy() for k, v in model.state_dict().items()}
            return build(name, weights).SerializeToString(), f"onnx.helper (torch export failed: {str(e)[:300]})"


def export_torch(model, name, path):
    """Writes the torch twin `model` (on the CPU, eval mode) to `path` through torch.onnx; returns
    which exporter succeeded, or raises the last error."""
    import torch

    x = torch.rand((2, *zoo_models.input_shape(name)))
    errors = []
    try:
        torch.onnx.export(
            model, (x,), path, input_names=["x"], output_names=["y"],
            dynamic_axes={"x": {0: "batch"}, "y": {0: "batch"}}, opset_version=OPSET, dynamo=False,
        )
        cap_ir_version(path)
        return "torch.onnx.export (TorchScript)"
    except Exception as e:  # the legacy exporter may be gone in this torch
        errors.append(f"TorchScript exporter: {e}")
    try:
        batch = torch.export.Dim("batch", min=1)
        torch.onnx.export(
            model, (x,), path, input_names=["x"], output_names=["y"],
            dynamic_shapes=({0: batch},), opset_version=OPSET, dynamo=True,
        )
        cap_ir_version(path)
        return "torch.onnx.export (dynamo)"
    except Exception as e:
        errors.append(f"dynamo exporter: {e}")
    raise RuntimeError("; ".join(errors))


def cap_ir_version(path):
    """Rewrites the ONNX file at `path` with at most IR version IR_VERSION (see `build`)."""
    import onnx

    model = onnx.load(path)
    if model.ir_version > IR_VERSION:
        model.ir_version = IR_VERSION
        onnx.save(model, path)
