"""The zoo's networks, as layer lists: the twins of `flatnn::models`, by the same names.

A model is an input shape (features; or channels, height, width; or steps, features), a list of
layers and a loss. Layers are tuples:
    ("dense", out_features, activation)
    ("conv", out_channels, kernel, padding, activation)   square kernel, stride 1
    ("maxpool", window)                                    stride = window
    ("flatten",)
    ("gru", hidden, "last" | "sequence")                   nn.GRU, batch first, one layer
    ("lstm", hidden, "last" | "sequence")                  nn.LSTM, likewise
Activations: "identity", "relu", "sigmoid", "tanh", "gelu" (the erf form, PyTorch's nn.GELU()).
Losses: "xent" (softmax cross-entropy on logits, mean over the batch), "mse" (mean over batch and
outputs). PyTorch's nn.Sequential twin counts every module (activations, pools, flatten), so its
state_dict names are the names flatnn's model files use.
"""

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
    "gru_seq": ((128, 1), [("gru", 64, "last"), ("dense", 1, "identity")], "mse"),
    "lstm_seq": ((64, 8), [("lstm", 128, "last"), ("dense", 4, "identity")], "xent"),
}

GATES = {"gru": 3, "lstm": 4}


def walk(name):
    """Yields (module index, layer, input shape, output shape) for each layer of model `name`,
    the module index counting as nn.Sequential does (a layer with an activation is two modules)."""
    shape, layers, _ = MODELS[name]
    module = 0
    for layer in layers:
        kind = layer[0]
        if kind == "dense":
            out = (layer[1],)
        elif kind == "conv":
            _, channels, k, pad, _ = layer
            out = (channels, shape[1] + 2 * pad - k + 1, shape[2] + 2 * pad - k + 1)
        elif kind == "maxpool":
            w = layer[1]
            out = (shape[0], (shape[1] - w) // w + 1, (shape[2] - w) // w + 1)
        elif kind == "flatten":
            out = (shape[0] * shape[1] * shape[2],)
        elif kind in GATES:
            out = (layer[1],) if layer[2] == "last" else (shape[0], layer[1])
        else:
            raise ValueError(f"unknown layer {layer!r} in {name}")
        yield module, layer, shape, out
        module += 2 if kind in ("dense", "conv") and layer[-1] != "identity" else 1
        shape = out


def tensors(name):
    """(state_dict name, shape) of every parameter tensor of model `name`, in PyTorch's layouts:
    Linear weight (out, in), Conv2d weight (out, in, k, k), GRU/LSTM weight_ih_l0 (G·hidden,
    features), weight_hh_l0 (G·hidden, hidden) and their biases (G gates: 3 or 4)."""
    out = []
    for module, layer, shape, _ in walk(name):
        if layer[0] == "dense":
            out += [(f"{module}.weight", (layer[1], shape[0])), (f"{module}.bias", (layer[1],))]
        elif layer[0] == "conv":
            out += [(f"{module}.weight", (layer[1], shape[0], layer[2], layer[2])), (f"{module}.bias", (layer[1],))]
        elif layer[0] in GATES:
            rows, hidden = GATES[layer[0]] * layer[1], layer[1]
            out += [
                (f"{module}.weight_ih_l0", (rows, shape[1])),
                (f"{module}.weight_hh_l0", (rows, hidden)),
                (f"{module}.bias_ih_l0", (rows,)),
                (f"{module}.bias_hh_l0", (rows,)),
            ]
    return out


def param_count(name):
    total = 0
    for _, shape in tensors(name):
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

    acts = {"relu": nn.ReLU, "sigmoid": nn.Sigmoid, "tanh": nn.Tanh, "gelu": nn.GELU}
    modules = []
    for _, layer, shape, _ in walk(name):
        kind = layer[0]
        if kind == "dense":
            modules.append(nn.Linear(shape[0], layer[1]))
        elif kind == "conv":
            modules.append(nn.Conv2d(shape[0], layer[1], layer[2], padding=layer[3]))
        elif kind == "maxpool":
            modules.append(nn.MaxPool2d(layer[1]))
        elif kind in GATES:
            modules.append(recurrent(kind, shape[1], layer[1], layer[2] == "last"))
        else:
            modules.append(nn.Flatten())
        if kind in ("dense", "conv") and layer[-1] != "identity":
            modules.append(acts[layer[-1]]())
    return nn.Sequential(*modules)
