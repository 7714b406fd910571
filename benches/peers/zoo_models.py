"""The zoo's networks, as layer lists: the twins of `flatnn::models`, by the same names.

A model is an input shape (features; channels, height, width; channels, length for a signal; or
steps, features for a sequence), a list of layers and a loss. Layers are tuples:
    ("dense", out_features, activation)
    ("conv", out_channels, kernel, padding, activation)     square kernel, stride 1
    ("conv1d", out_channels, kernel, padding, activation)   stride 1, dilation 1
    ("maxpool", window)                                      stride = window
    ("maxpool1d", window)                                    stride = window
    ("globalavgpool",)                                       the mean of each channel, a vector
    ("batchnorm", activation)                                BatchNorm1d or 2d (by the input's
                                                             shape), then the activation
    ("residual", [layers], activation)                       y = act(x + body(x)): a Residual
                                                             module holding the body as an
                                                             nn.Sequential named `body`, then the
                                                             activation's module
    ("flatten",)
    ("gru", hidden, "last" | "sequence")                     nn.GRU, batch first, one layer
    ("lstm", hidden, "last" | "sequence")                    nn.LSTM, likewise
    ("gru", hidden, "last" | "sequence")                   nn.GRU, batch first, one layer
    ("lstm", hidden, "last" | "sequence")                  nn.LSTM, likewise
Activations: "identity", "relu", "sigmoid", "tanh", "gelu" (the erf form, PyTorch's nn.GELU()).
Losses: "xent" (softmax cross-entropy on logits, mean over the batch), "mse" (mean over batch and
outputs). PyTorch's nn.Sequential twin counts every module (activations, pools, flatten; global
average pooling is two, nn.AdaptiveAvgPool2d(1) or 1d then nn.Flatten()), so its state_dict names
are the names flatnn's model files use (a residual block's body's: `<i>.body.<j>`).
"""

import math

MODELS = {
    "mlp": ((784,), [("dense", 128, "relu"), ("dense", 64, "relu"), ("dense", 10, "identity")], "xent"),
    "lenet5": (
        (1, 28, 28),
        [
            ("conv", 6, 5, 2, "relu"), ("maxpool", 2), ("conv", 16, 5, 0, "relu"), ("maxpool", 2), ("flatten",),
            ("dense", 120, "relu"), ("dense", 84, "relu"), ("dense", 10, "identity"),
        ],
        "xent",
    ),
    "simplenn": ((100,), [("dense", 200, "relu"), ("dense", 1, "identity")], "mse"),
    "autoencoder": (
        (784,),
        [("dense", 256, "relu"), ("dense", 64, "relu"), ("dense", 256, "relu"), ("dense", 784, "sigmoid")],
        "mse",
    ),
    "gelu_mlp": ((512,), [("dense", 1024, "gelu"), ("dense", 1024, "gelu"), ("dense", 16, "identity")], "xent"),
    "vgg_small": (
        (3, 32, 32),
        [
            ("conv", 16, 3, 1, "relu"), ("conv", 16, 3, 1, "relu"), ("maxpool", 2),
            ("conv", 32, 3, 1, "relu"), ("conv", 32, 3, 1, "relu"), ("maxpool", 2), ("flatten",),
            ("dense", 64, "relu"), ("dense", 10, "identity"),
        ],
        "xent",
    ),
    "resnet_small": (
        (3, 32, 32),
        [("conv", 16, 3, 1, "identity"), ("batchnorm", "relu")]
        + [
            (
                "residual",
                [("conv", 16, 3, 1, "identity"), ("batchnorm", "relu"), ("conv", 16, 3, 1, "identity"), ("batchnorm", "identity")],
                "relu",
            )
        ]
        * 3
        + [("globalavgpool",), ("dense", 10, "identity")],
        "xent",
    ),
    "ts_conv1d": (
        (1, 256),
        [
            ("conv1d", 16, 7, 0, "relu"), ("maxpool1d", 2), ("conv1d", 32, 5, 0, "relu"), ("globalavgpool",),
            ("dense", 4, "identity"),
        ],
        "xent",
    ),
    "gru_seq": ((128, 1), [("gru", 64, "last"), ("dense", 1, "identity")], "mse"),
    "lstm_seq": ((64, 8), [("lstm", 128, "last"), ("dense", 4, "identity")], "xent"),
}

GATES = {"gru": 3, "lstm": 4}


def walk(name):
    """Yields (module path, layer, input shape, output shape) for each layer of model `name`,
    the module index counting as nn.Sequential does (a layer with an activation is two modules);
    a residual block is one layer here (its body: `walk_layers(layer[1], shape, f"{path}.body.")`)."""
    shape, layers, _ = MODELS[name]
    yield from walk_layers(layers, shape)


def walk_layers(layers, shape, prefix=""):
    """`walk` over `layers` from `shape`, the module paths after `prefix`."""
    module = 0
    for layer in layers:
        kind = layer[0]
        if kind == "dense":
            out = (layer[1],)
        elif kind == "conv":
            _, channels, k, pad, _ = layer
            out = (channels, shape[1] + 2 * pad - k + 1, shape[2] + 2 * pad - k + 1)
        elif kind == "conv1d":
            _, channels, k, pad, _ = layer
            out = (channels, shape[1] + 2 * pad - k + 1)
        elif kind == "maxpool":
            w = layer[1]
            out = (shape[0], (shape[1] - w) // w + 1, (shape[2] - w) // w + 1)
        elif kind == "maxpool1d":
            w = layer[1]
            out = (shape[0], (shape[1] - w) // w + 1)
        elif kind == "globalavgpool":
            out = (shape[0],)
        elif kind == "flatten":
            out = (math.prod(shape),)
        elif kind == "batchnorm":
            out = shape
        elif kind in GATES:
            out = (layer[1],) if layer[2] == "last" else (shape[0], layer[1])
        elif kind == "residual":
            body = list(walk_layers(layer[1], shape))
            if body and body[-1][3] != shape:
                raise ValueError(f"residual block {layer!r} turns {shape} into {body[-1][3]}")
            out = shape
        else:
            raise ValueError(f"unknown layer {layer!r}")
        yield f"{prefix}{module}", layer, shape, out
        activated = kind in ("dense", "conv", "conv1d", "batchnorm", "residual") and layer[-1] != "identity"
        module += 2 if activated or kind == "globalavgpool" else 1
        shape = out


def tensors(name):
    """(state_dict name, shape) of every tensor of model `name`'s state dict, in PyTorch's
    layouts: Linear weight (out, in), Conv2d weight (out, in, k, k), Conv1d weight (out, in, k);
    batch norm's weight, bias, running_mean, running_var (C) and num_batches_tracked (a scalar,
    int64); GRU/LSTM weight_ih_l0 (G·hidden, features), weight_hh_l0 (G·hidden, hidden) and their
    biases (G gates: 3 or 4)."""
    shape, layers, _ = MODELS[name]
    return layer_tensors(layers, shape, "", buffers=True)


def parameters(name):
    """`tensors` without the buffers: the trained parameters."""
    shape, layers, _ = MODELS[name]
    return layer_tensors(layers, shape, "", buffers=False)


def layer_tensors(layers, shape, prefix, buffers):
    out = []
    for module, layer, shape, _ in walk_layers(layers, shape, prefix):
        if layer[0] == "dense":
            out += [(f"{module}.weight", (layer[1], shape[0])), (f"{module}.bias", (layer[1],))]
        elif layer[0] == "conv":
            out += [(f"{module}.weight", (layer[1], shape[0], layer[2], layer[2])), (f"{module}.bias", (layer[1],))]
        elif layer[0] == "conv1d":
            out += [(f"{module}.weight", (layer[1], shape[0], layer[2])), (f"{module}.bias", (layer[1],))]
        elif layer[0] == "batchnorm":
            c = shape[0]
            out += [(f"{module}.weight", (c,)), (f"{module}.bias", (c,))]
            if buffers:
                out += [(f"{module}.running_mean", (c,)), (f"{module}.running_var", (c,)), (f"{module}.num_batches_tracked", ())]
        elif layer[0] in GATES:
            rows, hidden = GATES[layer[0]] * layer[1], layer[1]
            out += [
                (f"{module}.weight_ih_l0", (rows, shape[1])),
                (f"{module}.weight_hh_l0", (rows, hidden)),
                (f"{module}.bias_ih_l0", (rows,)),
                (f"{module}.bias_hh_l0", (rows,)),
            ]
        elif layer[0] == "residual":
            out += layer_tensors(layer[1], shape, f"{module}.body.", buffers)
    return out


def param_count(name):
    total = 0
    for _, shape in parameters(name):
        n = 1
        for d in shape:
            n *= d
        total += n
    return total


def input_shape(name):
    return MODELS[name][0]


def output_len(name):
    return list(walk(name))[-1][3][0]


def loss_kind(name):
    return MODELS[name][2]


def recurrent(kind, features, hidden, last):
    """nn.GRU or nn.LSTM (batch first) as a module of an nn.Sequential: a subclass, so that its
    state_dict names are nn.GRU's, whose forward gives the output sequence, or its last step."""
    import torch.nn as nn

    class Recurrent(nn.GRU if kind == "gru" else nn.LSTM):
        def forward(self, x):
            out, _ = super().forward(x)
            return out[:, -1] if last else out

    return Recurrent(features, hidden, batch_first=True)


def torch_twin(name):
    """The model as a torch nn.Sequential (imports torch)."""
    import torch.nn as nn

    shape, layers, _ = MODELS[name]
    return nn.Sequential(*torch_modules(layers, shape))


def torch_residual(body):
    """flatnn's residual block as a torch module: y = x + body(x), the body an nn.Sequential
    named `body` (imports torch)."""
    import torch.nn as nn

    class Residual(nn.Module):
        def __init__(self, *layers):
            super().__init__()
            self.body = nn.Sequential(*layers)

        def forward(self, x):
            return x + self.body(x)

    return Residual(*body)


def torch_modules(layers, shape):
    """The modules of `layers` from `shape`, in nn.Sequential's order (imports torch)."""
    import torch.nn as nn

    acts = {"relu": nn.ReLU, "sigmoid": nn.Sigmoid, "tanh": nn.Tanh, "gelu": nn.GELU}
    modules = []
    for _, layer, shape, _ in walk_layers(layers, shape):
        kind = layer[0]
        if kind == "dense":
            modules.append(nn.Linear(shape[0], layer[1]))
        elif kind == "conv":
            modules.append(nn.Conv2d(shape[0], layer[1], layer[2], padding=layer[3]))
        elif kind == "conv1d":
            modules.append(nn.Conv1d(shape[0], layer[1], layer[2], padding=layer[3]))
        elif kind == "maxpool":
            modules.append(nn.MaxPool2d(layer[1]))
        elif kind == "maxpool1d":
            modules.append(nn.MaxPool1d(layer[1]))
        elif kind == "globalavgpool":
            modules += [nn.AdaptiveAvgPool1d(1) if len(shape) == 2 else nn.AdaptiveAvgPool2d(1), nn.Flatten()]
        elif kind == "batchnorm":
            modules.append(nn.BatchNorm1d(shape[0]) if len(shape) == 1 else nn.BatchNorm2d(shape[0]))
        elif kind in GATES:
            modules.append(recurrent(kind, shape[1], layer[1], layer[2] == "last"))
        elif kind == "residual":
            modules.append(torch_residual(torch_modules(layer[1], shape)))
        else:
            modules.append(nn.Flatten())
        if kind in ("dense", "conv", "conv1d", "batchnorm", "residual") and layer[-1] != "identity":
            modules.append(acts[layer[-1]]())
    return modules
