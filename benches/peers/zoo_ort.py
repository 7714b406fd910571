"""ONNX Runtime on the CPU: one session per model and thread count, graph optimisations on.

`infer`: inputs and outputs bound once (IOBinding over OrtValues made once), so a call is the run
alone, as flatnn's `forward` on resident inputs. `latency`: `session.run` from a host array,
outputs returned as a new array: what ONNX Runtime always does.
"""

import numpy as np
import onnxruntime as ort


def session(model_bytes, threads, profile_prefix=None, flush_subnormals=False):
    """A session on `threads` threads; with `profile_prefix`, profiling every node of every run
    into a JSON file of that prefix (`end_profiling` closes it and gives its path); with
    `flush_subnormals`, flush-to-zero and denormals-are-zero on its threads."""
    options = ort.SessionOptions()
    if flush_subnormals:
        options.add_session_config_entry("session.set_denormal_as_zero", "1")
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    if profile_prefix is not None:
        options.enable_profiling = True
        options.profile_file_prefix = profile_prefix
    return ort.InferenceSession(model_bytes, options, providers=["CPUExecutionProvider"])


def infer_call(sess, x, outputs):
    binding = sess.io_binding()
    x_value = ort.OrtValue.ortvalue_from_numpy(x)
    y_value = ort.OrtValue.ortvalue_from_shape_and_type([x.shape[0], outputs], np.float32)
    binding.bind_ortvalue_input("x", x_value)
    binding.bind_ortvalue_output("y", y_value)

    def call(_end):
        sess.run_with_iobinding(binding)

    call.keep = (x_value, y_value)  # the bound values must outlive the binding
    return call


def latency_call(sess, x):
    def call(_end):
        sess.run(["y"], {"x": x})

    return call


def run(sess, x):
    return sess.run(["y"], {"x": x})[0]
