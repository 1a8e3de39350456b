"""deltad for PyTorch, in two lines:

    import deltad.torch
    with deltad.torch.managed(model, budget_bytes=2 << 30):
        loss = model(x).sum(); loss.backward()

Inside the block every activation autograd saves for backward (above
`min_bytes`) is handed to the deltad client: it lives in the client's device
memory, within the budget, and the daemon's policy (or the same policy
in-process when no daemon answers) offloads it to host memory when the
budget is short; backward gets it back (reloaded) when it unpacks it.
Parameters and small tensors stay with PyTorch.

This version manages CPU tensors with the client's simulated device and
offloads only: eviction with recompute of a block's forward, CUDA tensors
and prefetch in backward order are not built yet.
"""

import contextlib
import ctypes
import itertools
import threading

import torch as _torch

from deltad.client import DEFAULT_SOCKET, Client


class _Saved:
    """What autograd keeps instead of a saved tensor: the client's id for
    its bytes. The bytes are freed with the last reference to it."""

    __slots__ = ("client", "tensor_id", "shape", "dtype", "__weakref__")

    def __init__(self, client, tensor_id, shape, dtype):
        self.client = client
        self.tensor_id = tensor_id
        self.shape = shape
        self.dtype = dtype

    def __del__(self):
        try:
            self.client.free(self.tensor_id)
        except Exception:  # the client may be closed already at exit
            pass


class Manager:
    """The hooks of one `managed` block and the client behind them."""

    def __init__(self, client, min_bytes):
        self.client = client
        self.min_bytes = min_bytes
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._final_stats = None
        self.managed_tensors = 0

    def pack(self, tensor):
        nbytes = tensor.numel() * tensor.element_size()
        # Parameters (leaves that need grad) are kept anyway; small tensors
        # are not worth a call; other devices are not ours (yet).
        if (nbytes < self.min_bytes or tensor.device.type != "cpu" or
                (tensor.is_leaf and tensor.requires_grad) or
                tensor.is_sparse):
            return tensor
        with self._lock:
            tensor_id = next(self._ids)
            self.managed_tensors += 1
        source = tensor.contiguous()
        address = self.client.track(tensor_id, nbytes)
        try:
            ctypes.memmove(address, source.data_ptr(), nbytes)
        finally:
            self.client.unpin(tensor_id)
        return _Saved(self.client, tensor_id, tensor.shape, tensor.dtype)

    def unpack(self, saved):
        if isinstance(saved, _torch.Tensor):
            return saved
        out = _torch.empty(saved.shape, dtype=saved.dtype)
        address = self.client.pin(saved.tensor_id)  # reloaded if offloaded
        try:
            ctypes.memmove(out.data_ptr(), address,
                           out.numel() * out.element_size())
        finally:
            self.client.unpin(saved.tensor_id)
        return out

    def stats(self):
        """The client's ClientStats; after the block, as it ended."""
        if self._final_stats is not None:
            return self._final_stats
        return self.client.stats()

    def _close(self):
        self._final_stats = self.client.stats()
        self.client.close()


@contextlib.contextmanager
def managed(model=None, budget_bytes=1 << 30, socket=DEFAULT_SOCKET,
            min_bytes=64 << 10, host_bytes=0, label="pytorch", client=None):
    """Hands the activations autograd saves inside the block to deltad.

    model: the nn.Module trained in the block (checked to be on the CPU).
    budget_bytes: device memory for saved activations; asked of the daemon,
    and the budget when no daemon answers. socket: the daemon's; None for
    the in-process policy only. client: an open deltad.Client to use
    instead of a new one (kept open at the end).
    Yields the Manager, whose stats() says what the client did.
    """
    if model is not None:
        if not isinstance(model, _torch.nn.Module):
            raise TypeError(
                f"managed() takes an nn.Module, got {type(model).__name__}")
        devices = {p.device.type for p in model.parameters()}
        if devices - {"cpu"}:
            raise NotImplementedError(
                f"deltad.torch manages CPU models in this version; the model "
                f"has parameters on {sorted(devices - {'cpu'})}")
    if budget_bytes <= 0:
        raise ValueError(f"budget_bytes must be positive, got {budget_bytes}")
    own = client is None
    if own:
        client = Client(socket=socket, budget_bytes=budget_bytes,
                        host_bytes=host_bytes, label=label)
    manager = Manager(client, min_bytes)
    try:
        with _torch.autograd.graph.saved_tensors_hooks(manager.pack,
                                                       manager.unpack):
            yield manager
    finally:
        if own:
            # A graph that outlives the block (backward after it) cannot be
            # unpacked any more: its unpack raises DeltadError rather than
            # return bytes that are gone.
            manager._close()
