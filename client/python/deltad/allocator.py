"""deltad as the process's CUDA allocator: one budget for everything the
process allocates on its GPU.

    import deltad.allocator
    deltad.allocator.install(budget_bytes=20 << 30)  # before any CUDA use
    model = Model().cuda()  # its memory now comes from deltad's budget

PyTorch calls the client library's `deltad_torch_malloc` and
`deltad_torch_free` (through `torch.cuda.memory.CUDAPluggableAllocator`) for
its device memory; the library serves it from the daemon's chunks within the
process's budget, releasing the tensors it tracks (saved activations) when
the budget is short. How it plugs in depends on the PyTorch:

- 2.8 and later: a `torch.cuda.MemPool` over the library, with every
  allocation of the device, from every thread (autograd's backward runs on
  threads of its own) and every stream, routed to it. PyTorch's caching
  allocator still splits, rounds and reuses blocks and orders reuse across
  streams with events; the library is asked only for segments.
- 2.0 to 2.7: the library replaces the CUDA allocator
  (`change_current_allocator`): every tensor is one call, with no cache,
  and it must happen before CUDA is first used. A MemPool there routes the
  library's memory to the calling thread only, which backward escapes.
  There an allocation the budget cannot hold first asks the reclaimers
  (add_reclaimer: the saved activations' stores) to release some, and
  one that still fails raises (that PyTorch does not check for NULL).
- older: not supported; `install()` says so.

`DELTAD_DISABLE=1` in the environment makes `install()` do nothing (it
returns None). `DELTAD_ALLOCATOR_ROUTING=global` takes the global swap on
2.8 and later too (before CUDA is first used), where a tensor freed comes
straight back to deltad and an allocation short of room can release saved
activations (add_reclaimer); `mempool` insists on the pool. See
docs/ALLOCATOR.md for what is measured and what is not.
"""

import ctypes
import dataclasses
import os
import threading
import traceback
import weakref

from deltad import _capi
from deltad.client import DEFAULT_SOCKET, Client, _check, _library

_MALLOC = "deltad_torch_malloc"
_MALLOC_OR_RAISE = "deltad_torch_malloc_or_raise"
_FREE = "deltad_torch_free"

_lock = threading.Lock()
_active = None  # the _Installation in force
# Installations undone by uninstall(): their pools may still hold segments
# that tensors use, and freeing those needs the pool, the allocator object
# and the client alive (a pool destroyed first frees with the wrong
# function, pytorch/pytorch#146431). Kept for the process's life.
_retired = []
# Weak references to the bound methods reclaim(nbytes) -> bytes freed that
# the library's reclaim callback asks in turn (add_reclaimer), and that
# callback, kept alive while the library may call it.
_reclaimers = []
_reclaim_callback = None


@dataclasses.dataclass
class AllocatorStats:
    attached: bool           # a client serves the entry points
    allocated_bytes: int     # the attached client's, through the allocator
    device_bytes: int        # its whole: the allocator's and its tensors'
    peak_device_bytes: int
    budget_bytes: int
    blocks: int              # live blocks, of every client
    reclaims: int = 0        # calls of the reclaimers (allocations short
    reclaimed_bytes: int = 0  # of room), and what they freed
    # The most bytes in live blocks at once since reset_peak() (under the
    # global swap, where PyTorch keeps no statistics, PyTorch's peak).
    peak_allocated_bytes: int = 0


@dataclasses.dataclass
class _Installation:
    client: Client
    owns_client: bool
    device: int
    mode: str               # "mempool" or "global"
    allocator: object       # the CUDAPluggableAllocator
    pool: object = None     # the MemPool ("mempool" mode)


# os.environ's own table (bytes keys on POSIX), which its setters keep
# current: read directly, it spares os.environ.get's encoding of the key,
# which costs a block entered every step ~15 us with the caches cold.
_ENVIRON = getattr(os.environ, "_data", None)
_DISABLE_KEY = (os.environ.encodekey("DELTAD_DISABLE")
                if _ENVIRON is not None else None)


def disabled():
    """True when DELTAD_DISABLE turns deltad off (1, true, yes or on)."""
    if _ENVIRON is not None:
        value = _ENVIRON.get(_DISABLE_KEY)
        if value is not None:
            value = os.environ.decodevalue(value)
    else:
        value = os.environ.get("DELTAD_DISABLE")
    # (Unset is the common case, and a block entered every step asks.)
    return value is not None and value.strip().lower() in (
        "1", "true", "yes", "on")


def _routing(torch, asked=None):
    """How this PyTorch can hand all of a device's allocations to deltad:
    "mempool" or "global" (`asked`, or DELTAD_ALLOCATOR_ROUTING, where it
    can; the pool where it can otherwise). RuntimeError when it cannot at
    all, or not as asked."""
    if asked is None:
        asked = os.environ.get("DELTAD_ALLOCATOR_ROUTING", "").strip() or None
    if asked not in (None, "mempool", "global"):
        raise ValueError(
            f"deltad's allocator routing is 'mempool' or 'global', not "
            f"{asked!r} (DELTAD_ALLOCATOR_ROUTING or install(routing=))")
    possible = _possible_routing(torch)
    if asked == "mempool" and possible != "mempool":
        raise RuntimeError(
            f"deltad.allocator.install(): routing 'mempool' needs PyTorch "
            f"2.8 or later (a pool serving every thread); this is "
            f"{torch.__version__}. Leave the routing unset.")
    return asked or possible


def _possible_routing(torch):
    """The routing this PyTorch offers by default (see _routing)."""
    memory = getattr(torch.cuda, "memory", None)
    if memory is None or not hasattr(memory, "CUDAPluggableAllocator"):
        raise RuntimeError(
            f"deltad.allocator.install() needs PyTorch 2.0 or later "
            f"(torch.cuda.memory.CUDAPluggableAllocator); this is "
            f"{torch.__version__}. Upgrade PyTorch, or set DELTAD_DISABLE=1 "
            f"to run without deltad's allocator.")
    c = torch._C
    # _cuda_beginAllocateCurrentThreadToPool came with the release (2.8)
    # whose pools call their own allocator whatever the thread; there,
    # _cuda_beginAllocateToPool (an always-true filter) routes every thread
    # and stream of the device to the pool.
    if (hasattr(torch.cuda, "MemPool")
            and hasattr(c, "_cuda_beginAllocateToPool")
            and hasattr(c, "_cuda_beginAllocateCurrentThreadToPool")
            and hasattr(c, "_cuda_endAllocateToPool")):
        return "mempool"
    return "global"


def _device_index(torch, device, mode):
    """The CUDA device index `device` names (None: the current one).
    Asking PyTorch for the current device initializes CUDA, after which
    PyTorch 2.0-2.7 ("global") can no longer swap its allocator: there,
    before CUDA is up, the current device is CUDA's first, 0."""
    if isinstance(device, int):
        return device
    index = None
    if device is not None:
        d = torch.device(device)
        if d.type != "cuda":
            raise ValueError(
                f"deltad's allocator serves CUDA devices, not {d}")
        index = d.index
    if index is None:
        index = 0 if mode == "global" and not torch.cuda.is_initialized() \
            else torch.cuda.current_device()
    return index


def _check_unused(torch, index, mode):
    """RuntimeError when PyTorch's own allocator already holds memory that
    deltad's budget would not cover (or, for the global swap, when it can
    no longer be replaced)."""
    if not torch.cuda.is_initialized():
        return
    if mode == "global":
        raise RuntimeError(
            f"deltad.allocator.install(): CUDA is already initialized, so "
            f"PyTorch {torch.__version__} can no longer replace its "
            f"allocator (the global swap; on PyTorch 2.8 or later the pool "
            f"needs no swap, unless DELTAD_ALLOCATOR_ROUTING=global asks "
            f"for one). Call install() first thing, before any .cuda(), "
            f"torch.cuda call or CUDA tensor; or set DELTAD_DISABLE=1.")
    held = torch.cuda.memory_allocated(index)
    if held > 0:
        raise RuntimeError(
            f"deltad.allocator.install(): PyTorch's own allocator already "
            f"holds {held} bytes on cuda:{index}, which deltad's budget "
            f"would not cover (one budget per process). Call install() "
            f"before the first CUDA allocation (before model.cuda()), or "
            f"free those tensors first; or set DELTAD_DISABLE=1.")


def install(client=None, budget_bytes=0, socket=DEFAULT_SOCKET, device=None,
            routing=None):
    """Makes the deltad client library this process's CUDA allocator for
    `device` (default: the current one) and returns the deltad.Client that
    serves it, or None when DELTAD_DISABLE=1.

    client: a deltad.Client on the "cuda" device to serve the memory; by
    default one is opened (on `socket`, None for no daemon, asking for
    `budget_bytes`, 0 for a fair share) and owned by the allocator.
    routing: "mempool" or "global" (see the module's docstring); None:
    DELTAD_ALLOCATOR_ROUTING, else the pool where this PyTorch has one.
    Raises RuntimeError with what to do when this PyTorch has no CUDA, is
    too old, or has allocated CUDA memory already, and when an installation
    is in force.
    """
    if disabled():
        return None
    import torch  # here: a process that never installs need not load it

    global _active
    with _lock:
        if _active is not None:
            raise RuntimeError(
                "deltad.allocator.install(): already installed (one "
                "allocator, one budget per process); uninstall() first")
        if not torch.cuda.is_available():
            raise RuntimeError(
                f"deltad.allocator.install(): this PyTorch "
                f"({torch.__version__}, CUDA {torch.version.cuda}) sees no "
                f"usable GPU, and deltad's allocator serves CUDA memory "
                f"only. Run on a GPU with a CUDA build of PyTorch, or set "
                f"DELTAD_DISABLE=1 to go without it.")
        mode = _routing(torch, routing)
        index = _device_index(torch, device, mode)
        _check_unused(torch, index, mode)
        owns = client is None
        if owns:
            client = Client(socket=socket, budget_bytes=budget_bytes,
                            device="cuda", cuda_device=index,
                            label="pytorch allocator")
        lib = _library()
        try:
            _check(lib.deltad_allocator_attach(client._open()))
        except Exception:
            if owns:
                client.close()
            raise
        try:
            # PyTorch 2.0-2.7's pluggable allocator takes a NULL for a
            # block: there a failure raises instead.
            allocator = torch.cuda.memory.CUDAPluggableAllocator(
                lib._name, _MALLOC if mode == "mempool" else _MALLOC_OR_RAISE,
                _FREE)
            installation = _Installation(client, owns, index, mode, allocator)
            if mode == "mempool":
                if torch.cuda.is_initialized():
                    # Cached, unused blocks of PyTorch's own pool: given
                    # back, so that the GPU holds deltad's budget only.
                    torch.cuda.empty_cache()
                _refuse_expandable_segments()
                # A pool belongs to the device current when it is made; a
                # route to another device would make that one a pool of
                # its own, over cudaMalloc.
                with torch.cuda.device(index):
                    installation.pool = torch.cuda.MemPool(
                        allocator.allocator())
                torch._C._cuda_beginAllocateToPool(index,
                                                   installation.pool.id)
                _end_routing_at_exit()
            else:
                torch.cuda.memory.change_current_allocator(allocator)
        except Exception:
            lib.deltad_allocator_detach()
            if owns:
                client.close()
            raise
        _active = installation
        _guard_graph_capture(torch)
        _arm_reclaim()  # (off under a MemPool)
        return client


_capture_begin = None  # CUDAGraph.capture_begin, while guarded


def _guard_graph_capture(torch):
    """Makes a CUDA graph capture raise while deltad serves the process
    (_lock held). A capture's allocations would come from deltad's pool
    (its route matches first, where the graph's own private pool should),
    and eager tensors would then reuse memory every replay writes: silent
    corruption, where refusing says what to do."""
    global _capture_begin
    graph = getattr(torch.cuda, "CUDAGraph", None)
    if graph is None or _capture_begin is not None:
        return
    _capture_begin = graph.capture_begin

    def capture_begin(self, *args, **kwargs):
        raise RuntimeError(
            "CUDA graph capture (torch.cuda.graph, torch.compile with "
            "mode='reduce-overhead') is not supported while deltad's "
            "allocator serves this process: the graph's memory would come "
            "from deltad's pool and be reused under its replays. Run "
            "without deltad.allocator.install() (or python -m deltad.run "
            "--no_allocator), or set DELTAD_DISABLE=1.")
    graph.capture_begin = capture_begin


def _unguard_graph_capture(torch):
    global _capture_begin
    if _capture_begin is not None:
        torch.cuda.CUDAGraph.capture_begin = _capture_begin
        _capture_begin = None


def _refuse_expandable_segments():
    """RuntimeError when PYTORCH_CUDA_ALLOC_CONF, or PYTORCH_ALLOC_CONF
    (its newer name, which PyTorch 2.x reads as well), asks for expandable
    segments, which PyTorch's pools over a pluggable allocator do not
    support (some releases raise at their first allocation)."""
    for var in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        conf = os.environ.get(var, "")
        for item in conf.replace(";", ",").split(","):
            key, _, value = item.partition(":")
            if (key.strip() == "expandable_segments"
                    and value.strip().lower() in ("true", "1")):
                raise RuntimeError(
                    f"deltad.allocator.install(): {var} asks for "
                    f"expandable_segments, which PyTorch's memory pools "
                    f"over deltad's allocator do not support. Drop it from "
                    f"{var} (deltad maps its memory in chunks already), or "
                    f"set DELTAD_DISABLE=1.")


_exit_hook = None


def _end_routing_at_exit():
    """Ends the pool's routing when the interpreter exits (_lock held): a
    pool still in use then trips an assertion in some PyTorch releases'
    MemPool destructor, which aborts the process."""
    global _exit_hook
    if _exit_hook is None:
        import atexit
        _exit_hook = atexit.register(_uninstall_at_exit)


def _uninstall_at_exit():
    try:
        uninstall()
    except Exception:  # noqa: BLE001 (at exit: say it, exit as the script)
        traceback.print_exc()


def uninstall():
    """Ends the routing: new allocations go to PyTorch's own allocator
    again. Memory already served stays valid (the pool and the client are
    kept for it). RuntimeError for a global swap, which PyTorch cannot
    undo; nothing to do when not installed."""
    global _active
    with _lock:
        if _active is None:
            return
        import torch

        if _active.mode != "mempool":
            raise RuntimeError(
                "deltad.allocator.uninstall(): on this PyTorch deltad "
                "replaced the CUDA allocator, which cannot be put back")
        torch._C._cuda_endAllocateToPool(_active.device, _active.pool.id)
        if hasattr(torch._C, "_cuda_releasePool"):
            torch._C._cuda_releasePool(_active.device, _active.pool.id)
        _library().deltad_allocator_detach()
        _retired.append(_active)
        _active = None
        _unguard_graph_capture(torch)
        _arm_reclaim()


def mode():
    """"mempool" or "global" while installed, else None."""
    with _lock:
        return None if _active is None else _active.mode


def stats():
    """What the allocator holds (cheap: one call, no daemon)."""
    lib = _library()
    u = _capi.AllocatorUsage()
    _check(lib.deltad_allocator_stats(ctypes.byref(u)))
    return AllocatorStats(
        attached=bool(u.attached), allocated_bytes=u.allocated_bytes,
        device_bytes=u.device_bytes, peak_device_bytes=u.peak_device_bytes,
        budget_bytes=u.budget_bytes, blocks=u.blocks, reclaims=u.reclaims,
        reclaimed_bytes=u.reclaimed_bytes,
        peak_allocated_bytes=u.peak_allocated_bytes)


def reset_peak():
    """Restarts stats().peak_allocated_bytes from what is allocated now."""
    _check(_library().deltad_allocator_reset_peak())


def add_reclaimer(method):
    """Registers `method` (a bound method: held weakly, dropped with its
    object), which deltad's allocator calls as method(nbytes) on the
    allocating thread when the budget cannot hold an allocation; it frees
    device memory (by letting tensors go) and returns how much. Useful only
    where freed tensors come straight back to deltad: under the global
    swap ("global" mode), not under a MemPool, whose cache keeps them."""
    global _reclaim_callback
    with _lock:
        if _active is not None and _active.mode == "mempool":
            # PyTorch's caching allocator calls deltad's under its device
            # lock: Python there would take the GIL under it, and what it
            # freed would stay in the pool's cache anyway.
            raise RuntimeError(
                "deltad.allocator.add_reclaimer(): not under a MemPool "
                "(the global swap only: DELTAD_ALLOCATOR_ROUTING=global)")
        _reclaimers[:] = [r for r in _reclaimers if r() is not None]
        _reclaimers.append(weakref.WeakMethod(method))
        if _reclaim_callback is None:
            # Never freed: a thread may be inside it when it is unset.
            _reclaim_callback = _capi.ReclaimFn(_reclaim)
        _arm_reclaim()


def remove_reclaimer(method):
    """Undoes add_reclaimer(method); nothing if it is not registered."""
    with _lock:
        _reclaimers[:] = [r for r in _reclaimers
                          if r() is not None and r() != method]
        _arm_reclaim()


def _arm_reclaim():
    """Sets the library's callback where reclaimers may run, unsets it
    elsewhere (_lock held)."""
    if _reclaim_callback is None:
        return
    armed = bool(_reclaimers) and (_active is None or
                                   _active.mode != "mempool")
    _check(_library().deltad_allocator_set_reclaim(
        _reclaim_callback if armed else _capi.ReclaimFn(), None))


def _reclaim(nbytes, _ctx):
    """The library's reclaim callback: asks the reclaimers in turn until
    `nbytes` are freed. It must not raise into C: a reclaimer that fails
    is reported here, and the allocation fails as it would without it."""
    freed = 0
    for ref in list(_reclaimers):  # (no lock: it may run inside install)
        method = ref()
        if method is None:
            continue
        try:
            freed += max(int(method(nbytes - freed)), 0)
        except KeyboardInterrupt:
            # Raised into C it would be printed and lost: the main thread
            # gets it back once the allocation has returned.
            import _thread
            _thread.interrupt_main()
            break
        except Exception:  # noqa: BLE001 (raising into C would abort)
            traceback.print_exc()
        if freed >= nbytes:
            break
    return freed


def installed_client(device):
    """The deltad.Client serving the installed allocator on CUDA device
    index `device`, else None: a managed block on that GPU uses its session
    instead of opening one."""
    with _lock:
        if _active is None or _active.device != device:
            return None
        return _active.client
