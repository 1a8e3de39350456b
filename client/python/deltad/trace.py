"""Records one training iteration of a PyTorch model as a deltad trace, for
the simulator:

    import deltad.torch
    deltad.torch.record_trace(model, torch.randn(32, 3, 224, 224),
                              "mymodel.trace")

    build/bench/policy_bench --trace_files=mymodel.trace --models=

The file is the project's text trace format (policies/sim/trace_io.h): the
tensors that exist before the iteration (parameters, buffers, inputs) are
constants; every ATen operator that runs in the forward pass, the loss and
the backward pass is an op with the values it reads, the storages it
creates (their bytes), the views it makes (aliases) and the values it
updates in place; a name is released when the last tensor on its storage
dies. Times are the wall time of each operator while recording: on CUDA
the recorder synchronizes before and after every operator, so recording is
slower than training and the times leave out the overlap of the GPU's
queue.

Works with PyTorch 1.13 (Debian's python3-torch) and 2.x. On 1.13 only
CPU backward passes are seen: the autograd engine's CUDA threads there do
not inherit the recorder.
"""

import collections
import os
import re

import torch as _torch

from deltad._trace_recorder import _Recorder, _tensors_in

__all__ = ["record_trace", "TraceSummary"]

TraceSummary = collections.namedtuple(
    "TraceSummary",
    ["path", "name", "ops", "forward_ops", "backward_ops", "values",
     "constants", "peak_bytes", "compute_ns"])
TraceSummary.__doc__ = """What record_trace wrote: the file and trace name,
the number of ops (all, forward, backward), of values (constants, op
outputs, views and in-place versions) and of constants, the peak of live
storage bytes with unlimited memory (as policy_bench computes it, without
workspace) and the sum of op times."""

_TRACE_NAME = re.compile(r"^[A-Za-z0-9_.+-]+$")


def _default_loss(output):
    tensors = [t for t in _tensors_in(output, [])
               if t.is_floating_point() or t.is_complex()]
    if not tensors:
        raise ValueError(
            "record_trace: the model returned no floating-point tensor; "
            "pass loss_fn to make a loss of its output")
    loss = tensors[0].float().sum()
    for t in tensors[1:]:
        loss = loss + t.float().sum()
    return loss


def record_trace(model, example_inputs, path, name=None, loss_fn=None,
                 min_bytes=0):
    """Runs one training iteration of `model` and writes its trace to `path`.

    model: an nn.Module. example_inputs: a tensor or a tuple (list) of
    arguments for model(*inputs). The iteration: the forward pass, the loss
    (loss_fn(output) if given, else the sum of every floating-point tensor
    the model returns, as float32) and loss.backward(). The parameters'
    gradients are set aside during it and put back after, so the model's
    .grad is as before; buffers change as in any training step (batch norm
    statistics, in train mode).

    name: the trace's name in policy_bench's table (letters, digits and
    `_.+-`); default: the model's class and the batch, e.g.
    "sequential-b16". min_bytes: storages smaller than this are left out of
    the trace (their ops are kept). Returns a TraceSummary.
    """
    if not isinstance(model, _torch.nn.Module):
        raise TypeError(
            f"record_trace() takes an nn.Module, got {type(model).__name__}")
    if isinstance(example_inputs, _torch.Tensor):
        inputs = (example_inputs,)
    elif isinstance(example_inputs, (tuple, list)):
        inputs = tuple(example_inputs)
    else:
        raise TypeError(
            "record_trace() takes a tensor or a tuple of inputs, got "
            f"{type(example_inputs).__name__}")
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(
            f"loss_fn must be callable, got {type(loss_fn).__name__}")
    if isinstance(min_bytes, bool) or not isinstance(min_bytes, int):
        raise TypeError(
            f"min_bytes must be an int, got {type(min_bytes).__name__}")
    if min_bytes < 0:
        raise ValueError(f"min_bytes must be >= 0, got {min_bytes}")
    if name is None:
        name = type(model).__name__.lower()
        first = next((t for t in inputs if isinstance(t, _torch.Tensor)),
                     None)
        if first is not None and first.dim() > 0:
            name += f"-b{first.shape[0]}"
        name = re.sub(r"[^A-Za-z0-9_.+-]", "-", name)
    elif not isinstance(name, str) or not _TRACE_NAME.match(name):
        raise ValueError(
            f"bad trace name {name!r}: letters, digits and '_.+-' only")
    path = os.fspath(path)

    params = list(model.parameters())
    tensors = params + [t for t in inputs if isinstance(t, _torch.Tensor)]
    cuda = any(t.is_cuda for t in tensors)
    recorder = _Recorder(min_bytes, cuda)
    for pname, p in model.named_parameters():
        recorder.constant(p, "p." + pname)
    for bname, b in model.named_buffers():
        recorder.constant(b, "b." + bname)
    for i, t in enumerate(inputs):
        if isinstance(t, _torch.Tensor):
            recorder.constant(t, f"in{i}")

    # Pairs, not a dict: tensors are never keys here.
    saved_grads = [(p, p.grad) for p in params]
    for p in params:
        p.grad = None
    try:
        with _torch.autograd.graph.saved_tensors_hooks(recorder.pack,
                                                       recorder.unpack):
            with _torch.enable_grad(), recorder:
                output = model(*inputs)
                loss = (loss_fn(output) if loss_fn is not None
                        else _default_loss(output))
                if not isinstance(loss, _torch.Tensor):
                    raise TypeError(
                        "loss_fn must return a tensor, got "
                        f"{type(loss).__name__}")
                if loss.numel() != 1:
                    raise ValueError(
                        "the loss must be a single value, got shape "
                        f"{tuple(loss.shape)}")
                if not loss.requires_grad:
                    raise ValueError(
                        "the loss does not require grad: the model has no "
                        "trainable parameter on the path to its output")
                recorder.phase = "bwd"
                loss.backward()
            # The output and the loss die here: released after the last op.
            del output, loss
    finally:
        for p, grad in saved_grads:
            p.grad = grad
        del saved_grads
        recorder.finish()

    ops = recorder.ops
    forward = sum(1 for op in ops if op[1] == "fwd")
    values = (len(recorder.constants) +
              sum(len(op[4]) + len(op[5]) + len(op[6]) for op in ops))
    device = "cuda" if cuda else "cpu"
    comment = (f"recorded with deltad.torch.record_trace: torch "
               f"{_torch.__version__} on {device}; op times are wall times "
               f"while recording")
    text = recorder.text(name, comment)
    with open(path, "w") as f:
        f.write(text)
    return TraceSummary(path=path, name=name, ops=len(ops),
                        forward_ops=forward, backward_ops=len(ops) - forward,
                        values=values, constants=len(recorder.constants),
                        peak_bytes=recorder.peak_bytes(),
                        compute_ns=sum(op[2] for op in ops))
