"""ctypes declarations of client/deltad_client.h, and where the library is
found."""

import ctypes
import ctypes.util
import os
import sys

_LIBRARY_NAME = "libdeltad_client.so"


class Options(ctypes.Structure):
    _fields_ = [
        ("socket_path", ctypes.c_char_p),
        ("gpu", ctypes.c_int32),
        ("requested_budget_bytes", ctypes.c_int64),
        ("requested_host_bytes", ctypes.c_int64),
        ("priority", ctypes.c_uint32),
        ("label", ctypes.c_char_p),
        ("use_daemon", ctypes.c_int32),
        ("fallback_budget_bytes", ctypes.c_int64),
        ("fallback_host_bytes", ctypes.c_int64),
        ("device", ctypes.c_char_p),
        ("sim_memory_bytes", ctypes.c_int64),
        ("sim_d2h_bytes_per_second", ctypes.c_double),
        ("sim_h2d_bytes_per_second", ctypes.c_double),
        ("cuda_device", ctypes.c_int32),
        ("min_budget_bytes", ctypes.c_int64),
        ("admission_wait_ms", ctypes.c_int32),
        ("require_session", ctypes.c_int32),
    ]


class TensorInfo(ctypes.Structure):
    _fields_ = [
        ("id", ctypes.c_uint64),
        ("bytes", ctypes.c_int64),
        ("parents", ctypes.POINTER(ctypes.c_uint64)),
        ("num_parents", ctypes.c_size_t),
        ("compute_cost_ns", ctypes.c_int64),
        ("evict_pinned", ctypes.c_int32),
        ("offload_pinned", ctypes.c_int32),
        ("uncomputable", ctypes.c_int32),
        ("stable_key", ctypes.c_uint64),
    ]


class Stats(ctypes.Structure):
    _fields_ = [
        ("device_bytes", ctypes.c_int64),
        ("peak_device_bytes", ctypes.c_int64),
        ("budget_bytes", ctypes.c_int64),
        ("host_bytes", ctypes.c_int64),
        ("offloaded_bytes", ctypes.c_int64),
        ("reloaded_bytes", ctypes.c_int64),
        ("evictions", ctypes.c_int64),
        ("recomputes", ctypes.c_int64),
        ("recompute_ns", ctypes.c_int64),
        ("stall_ns", ctypes.c_int64),
        ("connected", ctypes.c_int32),
        ("prefetches", ctypes.c_int64),
    ]


class SessionStats(ctypes.Structure):
    _fields_ = [
        ("connected", ctypes.c_int32),
        ("session_id", ctypes.c_uint64),
        ("reconnects", ctypes.c_int64),
        ("sessions_lost", ctypes.c_int64),
        ("attach_failures", ctypes.c_int64),
    ]


class AllocatorUsage(ctypes.Structure):
    _fields_ = [
        ("attached", ctypes.c_int32),
        ("allocated_bytes", ctypes.c_int64),
        ("device_bytes", ctypes.c_int64),
        ("peak_device_bytes", ctypes.c_int64),
        ("budget_bytes", ctypes.c_int64),
        ("blocks", ctypes.c_int64),
        ("reclaims", ctypes.c_int64),
        ("reclaimed_bytes", ctypes.c_int64),
        ("peak_allocated_bytes", ctypes.c_int64),
    ]


# deltad_reclaim_fn: (bytes, ctx) -> bytes freed.
ReclaimFn = ctypes.CFUNCTYPE(ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p)


RecomputeFn = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_uint64,
                               ctypes.c_void_p)


# Where `cmake --install` puts the library under the usual prefixes
# (GNUInstallDirs: lib, or the multiarch lib/<triplet> on Debian).
_INSTALL_DIRS = ("/usr/local/lib", "/usr/lib")


def _candidates():
    """Where the library may be, in the order tried."""
    out = []
    if os.environ.get("DELTAD_CLIENT_LIBRARY"):
        out.append(os.environ["DELTAD_CLIENT_LIBRARY"])
    out.append(os.path.join(os.path.dirname(__file__), _LIBRARY_NAME))
    found = ctypes.util.find_library("deltad_client")
    if found:
        out.append(found)
    out.append(_LIBRARY_NAME)  # the loader's own path
    multiarch = getattr(sys.implementation, "_multiarch", None)
    for d in _INSTALL_DIRS:
        if multiarch:
            out.append(os.path.join(d, multiarch, _LIBRARY_NAME))
        out.append(os.path.join(d, _LIBRARY_NAME))
    return out


def _find_library():
    errors = []
    for path in _candidates():
        if os.path.isabs(path) and not os.path.exists(path):
            errors.append(f"{path}: no such file")
            continue
        try:
            return ctypes.CDLL(path)
        except OSError as e:
            errors.append(f"{path}: {e}")
    raise OSError(
        "cannot load the deltad client library libdeltad_client.so. Install "
        "it with `cmake --install` (it goes to the prefix's library folder), "
        "or point DELTAD_CLIENT_LIBRARY at it (a build tree has it at "
        "build/client/libdeltad_client.so). Tried: " + "; ".join(errors))


def load():
    lib = _find_library()
    lib.deltad_client_options_init.argtypes = [ctypes.POINTER(Options)]
    lib.deltad_client_options_init.restype = None
    lib.deltad_client_connect.argtypes = [
        ctypes.POINTER(Options), ctypes.POINTER(ctypes.c_void_p)]
    lib.deltad_client_connect.restype = ctypes.c_int
    lib.deltad_client_close.argtypes = [ctypes.c_void_p]
    lib.deltad_client_close.restype = None
    lib.deltad_track.argtypes = [
        ctypes.c_void_p, ctypes.POINTER(TensorInfo), RecomputeFn,
        ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p)]
    lib.deltad_track.restype = ctypes.c_int
    lib.deltad_pin.argtypes = [ctypes.c_void_p, ctypes.c_uint64,
                               ctypes.POINTER(ctypes.c_void_p)]
    lib.deltad_pin.restype = ctypes.c_int
    lib.deltad_unpin.argtypes = [ctypes.c_void_p, ctypes.c_uint64]
    lib.deltad_unpin.restype = None
    lib.deltad_free.argtypes = [ctypes.c_void_p, ctypes.c_uint64]
    lib.deltad_free.restype = ctypes.c_int
    lib.deltad_stats.argtypes = [ctypes.c_void_p, ctypes.POINTER(Stats)]
    lib.deltad_stats.restype = ctypes.c_int
    # Absent from libraries built before sessions could be lost and found.
    if hasattr(lib, "deltad_session_stats"):
        lib.deltad_session_stats.argtypes = [ctypes.c_void_p,
                                             ctypes.POINTER(SessionStats)]
        lib.deltad_session_stats.restype = ctypes.c_int
    if hasattr(lib, "deltad_iteration_done"):
        lib.deltad_iteration_done.argtypes = [ctypes.c_void_p]
        lib.deltad_iteration_done.restype = None
    lib.deltad_prefetch.argtypes = [ctypes.c_void_p,
                                    ctypes.POINTER(ctypes.c_uint64),
                                    ctypes.c_size_t]
    lib.deltad_prefetch.restype = None
    lib.deltad_resident.argtypes = [ctypes.c_void_p, ctypes.c_uint64]
    lib.deltad_resident.restype = ctypes.c_int
    lib.deltad_set_compute_stream.argtypes = [ctypes.c_void_p,
                                              ctypes.c_void_p]
    lib.deltad_set_compute_stream.restype = ctypes.c_int
    lib.deltad_last_error.argtypes = []
    lib.deltad_last_error.restype = ctypes.c_char_p
    # The process allocator (deltad.allocator); absent from libraries built
    # before it, which then still serve everything else.
    if hasattr(lib, "deltad_allocator_attach"):
        lib.deltad_allocator_attach.argtypes = [ctypes.c_void_p]
        lib.deltad_allocator_attach.restype = ctypes.c_int
        lib.deltad_allocator_detach.argtypes = []
        lib.deltad_allocator_detach.restype = ctypes.c_int
        lib.deltad_allocator_stats.argtypes = [ctypes.POINTER(AllocatorUsage)]
        lib.deltad_allocator_stats.restype = ctypes.c_int
        lib.deltad_torch_malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int,
                                            ctypes.c_void_p]
        lib.deltad_torch_malloc.restype = ctypes.c_void_p
        lib.deltad_torch_free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t,
                                          ctypes.c_int, ctypes.c_void_p]
        lib.deltad_torch_free.restype = None
        lib.deltad_allocator_set_reclaim.argtypes = [ReclaimFn,
                                                     ctypes.c_void_p]
        lib.deltad_allocator_set_reclaim.restype = ctypes.c_int
        lib.deltad_allocator_reset_peak.argtypes = []
        lib.deltad_allocator_reset_peak.restype = ctypes.c_int
    return lib
