"""The client library from Python: one session with deltad (or the
in-process policy when no daemon answers) for this process's tensors."""

import ctypes
import dataclasses
import os
import threading

from deltad import _capi

_lib = None
_lib_lock = threading.Lock()

DEFAULT_SOCKET = "/run/deltad/deltad.sock"  # as the C++ ClientOptions


def _library():
    global _lib
    with _lib_lock:
        if _lib is None:
            _lib = _capi.load()
        return _lib


# absl/gRPC status codes the C API returns, for messages.
_CODES = {3: "INVALID_ARGUMENT", 5: "NOT_FOUND", 6: "ALREADY_EXISTS",
          8: "RESOURCE_EXHAUSTED", 9: "FAILED_PRECONDITION", 12:
          "UNIMPLEMENTED", 13: "INTERNAL", 14: "UNAVAILABLE", 15: "DATA_LOSS"}


class DeltadError(RuntimeError):
    """A call of the client library failed; `code` is the status code."""

    def __init__(self, code, message):
        super().__init__(f"{_CODES.get(code, code)}: {message}")
        self.code = code


def _check(rc):
    if rc != 0:
        raise DeltadError(rc, _library().deltad_last_error().decode())


@dataclasses.dataclass
class ClientStats:
    device_bytes: int
    peak_device_bytes: int
    budget_bytes: int
    host_bytes: int
    offloaded_bytes: int
    reloaded_bytes: int
    evictions: int
    recomputes: int
    recompute_ns: int
    stall_ns: int
    connected: bool
    prefetches: int


@dataclasses.dataclass
class SessionStats:
    """The client's sessions with the daemon: a session the daemon lost
    (stalled, killed, a broken stream) is ended on both sides and a new one
    opened in the background, everything held reported again."""
    connected: bool
    session_id: int       # the last session opened; 0: none yet
    reconnects: int       # sessions opened after the first
    sessions_lost: int    # ended without this process closing them
    attach_failures: int  # attempts that opened no session


class Client:
    """A session's tensors: `track` gives device memory for a new tensor
    (returned pinned), `pin`/`unpin` bracket each use, `free` drops it.
    Addresses are ints. Thread safe, as the C API is.

    socket: the daemon's socket; None for the in-process policy only.
    budget_bytes: asked of the daemon (0: a fair share); also the budget
    while no daemon is reachable (then it must be positive).
    device: "sim", the client library's simulated device (memory of this
    process standing in for the GPU's, `device_memory_bytes` of it, copies
    at `link_bytes_per_second`, 0 for memcpy speed), or "cuda", the GPU
    `cuda_device` (addresses are then device pointers). `gpu` is the
    daemon's index of the GPU (default: 0).

    min_budget_bytes: what the job cannot run without; the daemon never
    cuts its budget below it (nor below the peak of its last iteration,
    see iteration_done) to admit another job, and refuses this session if
    it cannot keep it beside the running jobs' floors. admission_wait_s:
    how long to ask a refusing daemon again before going on.
    require_session: fail closed, raising DeltadError when no session could
    be opened instead of training on in-process decisions (default: the
    environment variable DELTAD_REQUIRE_SESSION=1).
    """

    def __init__(self, socket=DEFAULT_SOCKET, budget_bytes=0,
                 host_bytes=0, gpu=None, label="python", priority=None,
                 fallback_budget_bytes=None, fallback_host_bytes=None,
                 device_memory_bytes=80 << 30, link_bytes_per_second=0.0,
                 device="sim", cuda_device=0, min_budget_bytes=0,
                 admission_wait_s=0.0, require_session=None):
        self._handle = None  # until connected: close() has nothing to do
        lib = _library()
        o = _capi.Options()
        # The library's defaults; only what is given here changes them.
        lib.deltad_client_options_init(ctypes.byref(o))
        # Kept referenced: ctypes must not free them before connect reads
        # them.
        self._strings = [s.encode() for s in (socket or "", label or "",
                                              device)]
        o.socket_path = self._strings[0]
        o.device = self._strings[2]
        o.cuda_device = cuda_device
        o.use_daemon = 1 if socket else 0
        o.requested_budget_bytes = budget_bytes
        o.requested_host_bytes = host_bytes
        o.label = self._strings[1]
        if gpu is not None:
            o.gpu = gpu
        if priority is not None:
            o.priority = priority
        if fallback_budget_bytes is not None:
            o.fallback_budget_bytes = fallback_budget_bytes
        elif budget_bytes:
            o.fallback_budget_bytes = budget_bytes
        if fallback_host_bytes is not None:
            o.fallback_host_bytes = fallback_host_bytes
        o.min_budget_bytes = min_budget_bytes
        o.admission_wait_ms = int(admission_wait_s * 1000)
        if require_session is None:
            require_session = os.environ.get("DELTAD_REQUIRE_SESSION") == "1"
        o.require_session = int(bool(require_session))
        o.sim_memory_bytes = device_memory_bytes
        # <= 0 copies at memcpy speed: this is the CPU.
        o.sim_d2h_bytes_per_second = link_bytes_per_second
        o.sim_h2d_bytes_per_second = link_bytes_per_second
        handle = ctypes.c_void_p()
        _check(lib.deltad_client_connect(ctypes.byref(o),
                                         ctypes.byref(handle)))
        self._lib = lib
        self._handle = handle
        # One C callback for every tensor, which looks the tensor's own up.
        # They stay until close: the library keeps a freed tensor's record
        # while a descendant may need it rebuilt, and may call back then.
        self._recomputes = {}
        self._trampoline = _capi.RecomputeFn(self._recompute)
        self._failed = threading.local()

    def _recompute(self, _user, tensor_id, out):
        try:
            self._recomputes[tensor_id](tensor_id, out)
            return 0
        except Exception as e:  # reported to the library as a failure
            # ... and kept, so that the pin that needed it raises with it.
            self._failed.error = e
            return 1

    def _check_call(self, rc):
        """_check, chaining a recompute callback's exception when one made
        the call fail."""
        cause = getattr(self._failed, "error", None)
        self._failed.error = None
        if rc != 0 and cause is not None:
            raise DeltadError(rc, _library().deltad_last_error().decode()
                              + f" ({type(cause).__name__}: {cause})") \
                from cause
        _check(rc)

    def close(self):
        if self._handle:
            self._lib.deltad_client_close(self._handle)
            self._handle = None
            self._recomputes.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        self.close()

    def track(self, tensor_id, nbytes, parents=(), compute_cost_ns=0,
              recompute=None, evict_pinned=False, offload_pinned=False,
              stable_key=0):
        """Device memory for a new tensor, pinned. `recompute(id, address)`
        rebuilds it (returns nothing, raises on failure); without one the
        tensor is only ever offloaded."""
        self._open()
        info = _capi.TensorInfo()
        info.id = tensor_id
        info.bytes = nbytes
        parent_array = (ctypes.c_uint64 * len(parents))(*parents)
        info.parents = parent_array
        info.num_parents = len(parents)
        info.compute_cost_ns = compute_cost_ns
        info.evict_pinned = int(evict_pinned)
        info.offload_pinned = int(offload_pinned)
        info.uncomputable = int(recompute is None)
        info.stable_key = stable_key
        callback = _capi.RecomputeFn()  # NULL: not recomputable
        if recompute is not None:
            self._recomputes[tensor_id] = recompute
            callback = self._trampoline
        out = ctypes.c_void_p()
        self._check_call(self._lib.deltad_track(
            self._handle, ctypes.byref(info), callback, None,
            ctypes.byref(out)))
        return out.value

    def iteration_done(self):
        """A training iteration completed: the most device memory held
        during it goes to the daemon (streamed, no round trip), which keeps
        it as this job's floor until the next one."""
        self._lib.deltad_iteration_done(self._open())

    def _open(self):
        if not self._handle:
            raise DeltadError(9, "the deltad client is closed")
        return self._handle

    def pin(self, tensor_id):
        self._open()
        out = ctypes.c_void_p()
        self._check_call(self._lib.deltad_pin(self._handle, tensor_id,
                                              ctypes.byref(out)))
        return out.value

    def unpin(self, tensor_id):
        self._lib.deltad_unpin(self._open(), tensor_id)

    def free(self, tensor_id, forget_recompute=False):
        """Drops the tensor. Its recompute callback stays until close (the
        library may rebuild a freed tensor for a descendant's recompute)
        unless `forget_recompute`, for a caller that keeps parents alive
        while their descendants live."""
        self._open()
        if forget_recompute:
            self._recomputes.pop(tensor_id, None)
        _check(self._lib.deltad_free(self._handle, tensor_id))

    def prefetch(self, tensor_ids):
        """Reload these offloaded tensors ahead of use, in this order, as
        far as the budget allows (a hint)."""
        ids = list(tensor_ids)
        if ids:
            array = (ctypes.c_uint64 * len(ids))(*ids)
            self._lib.deltad_prefetch(self._open(), array, len(ids))

    def resident(self, tensor_id):
        """Whether the tensor's bytes are on the device now."""
        return bool(self._lib.deltad_resident(self._open(), tensor_id))

    def set_compute_stream(self, stream):
        """The cudaStream_t (an int) the framework computes on ("cuda"
        device only)."""
        _check(self._lib.deltad_set_compute_stream(self._open(),
                                                   ctypes.c_void_p(stream)))

    def stats(self):
        self._open()
        s = _capi.Stats()
        _check(self._lib.deltad_stats(self._handle, ctypes.byref(s)))
        values = {f: getattr(s, f) for f, _ in s._fields_}
        values["connected"] = bool(values["connected"])
        return ClientStats(**values)

    def session_stats(self):
        """SessionStats: how the sessions with the daemon went."""
        self._open()
        s = _capi.SessionStats()
        _check(self._lib.deltad_session_stats(self._handle, ctypes.byref(s)))
        values = {f: getattr(s, f) for f, _ in s._fields_}
        values["connected"] = bool(values["connected"])
        return SessionStats(**values)
