"""The recorder behind deltad.trace.record_trace: a TorchDispatchMode that
sees every ATen operator of one training iteration and keeps, per op, the
values it reads, the storages it creates (their bytes), the views it makes
and the values it updates in place, then writes them in the project's text
trace format (policies/sim/trace_io.h).
"""

import collections
import re
import threading
import time
import weakref

import torch as _torch
from torch.utils._python_dispatch import TorchDispatchMode


def _untyped_storage(t):
    # 2.x: untyped_storage(); 1.13: _storage() (an UntypedStorage), else
    # the TypedStorage's own.
    get = getattr(t, "untyped_storage", None)
    if get is not None:
        return get()
    get = getattr(t, "_storage", None)
    if get is not None:
        return get()
    s = t.storage()
    return getattr(s, "_storage", s)


def _storage_info(t):
    """(key, bytes) of t's storage; None for a tensor without one (sparse,
    nested, some subclasses). The key is the address of the storage's C++
    object, unique while the storage lives."""
    try:
        s = _untyped_storage(t)
        return int(s._cdata), int(s.nbytes())
    except Exception:  # no storage to speak of: not recorded
        return None


def _tensors_in(value, out):
    """Appends the tensors in value (a tensor, or lists, tuples and dicts of
    them, at any depth) to out."""
    if isinstance(value, _torch.Tensor):
        out.append(value)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _tensors_in(v, out)
    elif isinstance(value, dict):
        for v in value.values():
            _tensors_in(v, out)
    return out


def _op_name(func):
    name = str(func)  # "aten.add.Tensor", "aten.convolution.default"
    if name.endswith(".default"):
        name = name[:-len(".default")]
    return re.sub(r"[\s#,=]", "_", name)


_SAME_VALUE_OPS = ("aten.detach.default", "aten.alias.default",
                   "aten.lift_fresh.default")


def _as_tensor(func, args, result):
    """The tensor an operator returned as a Python number. Calling an
    operator from Python turns a wrapped number (a 0-dim tensor autograd
    made of a Python scalar) into a number, which PyTorch 1.13 then refuses
    as the operator's result (autograd detaches the wrapped numbers it
    saves, through the recorder, when a pack hook is set)."""
    schema = getattr(func, "_schema", None)
    returns = schema.returns if schema is not None else ()
    if len(returns) != 1 or str(returns[0].type) != "Tensor":
        return result
    first = args[0] if args and isinstance(args[0], _torch.Tensor) else None
    if first is not None and str(func) in _SAME_VALUE_OPS:
        return first
    if first is not None:
        return _torch.tensor(result, dtype=first.dtype, device=first.device)
    return _torch.tensor(result)


class _Storage:
    __slots__ = ("key", "bytes", "names", "holders")

    def __init__(self, key, nbytes):
        self.key = key
        self.bytes = nbytes
        self.names = []  # live trace names on it; empty when too small
        self.holders = 0  # live tracked tensors on it


class _Tracked:
    __slots__ = ("storage", "name", "finalizer")

    def __init__(self, storage, name):
        self.storage = storage
        self.name = name
        self.finalizer = None


class _Recorder(TorchDispatchMode):
    """Turns the operators it sees into trace records.

    Tensors are tracked by id() with a weakref finalizer each (never as
    dict keys), and grouped by storage: a name is released when the last
    tracked tensor on its storage dies. Autograd's saved tensors are kept by
    the pack hook as the tensors themselves, so that the storages they hold
    stay tracked until backward lets them go; a tensor first seen in an
    operator that lies on a tracked storage (autograd unpacks a saved tensor
    as a new tensor object) stands for that storage's first name, and one on
    an unknown storage is a constant (it existed before, or was made where
    no operator shows it)."""

    def __init__(self, min_bytes, cuda):
        super().__init__()
        self.phase = "fwd"
        self._min_bytes = min_bytes
        self._cuda = cuda
        self._lock = threading.RLock()
        self._tensors = {}  # id(tensor) -> _Tracked
        self._storages = {}  # storage key -> _Storage
        self._names = set()
        self.constants = []  # (name, bytes)
        self.initial_releases = []
        # [name, phase, time_ns, ins, outs, muts, aliases, releases]
        self.ops = []
        self._pending = []  # names released since the last op was recorded
        self._dead = collections.deque()  # ids of tracked tensors that died

    # Names and tracking.

    def _fresh(self, prefix):
        name = f"{prefix}{len(self._names)}"
        while name in self._names:
            name += "_"
        self._names.add(name)
        return name

    def _track(self, t, storage, name):
        entry = _Tracked(storage, name)
        try:
            entry.finalizer = weakref.finalize(t, self._drop, id(t))
        except TypeError:  # not weakly referenceable: its lifetime is unknown
            return
        entry.finalizer.atexit = False
        self._tensors[id(t)] = entry
        storage.holders += 1

    def _drop(self, tensor_id):
        # A finalizer: it may run anywhere, in the middle of the recorder's
        # own work too, so it only notes the death; _reap acts on it before
        # the next look-up by id (which the dead tensor's id may be reused
        # for after it).
        self._dead.append(tensor_id)

    def _reap(self):
        while self._dead:
            entry = self._tensors.pop(self._dead.popleft(), None)
            if entry is None:
                continue
            st = entry.storage
            st.holders -= 1
            if st.holders > 0:
                continue
            self._pending.extend(st.names)
            st.names = []
            if self._storages.get(st.key) is st:
                del self._storages[st.key]

    def _new_storage(self, key, nbytes):
        st = _Storage(key, nbytes)
        self._storages[key] = st
        return st

    def constant(self, t, name):
        """Registers t, which exists before the iteration, as a constant
        named after `name` (made unique and safe)."""
        with self._lock:
            self._reap()
            if id(t) in self._tensors:
                return
            info = _storage_info(t)
            if info is None:
                return
            key, nbytes = info
            st = self._storages.get(key)
            if st is None:
                st = self._new_storage(key, nbytes)
                if nbytes >= self._min_bytes:
                    name = re.sub(r"[^A-Za-z0-9_.+-]", "_", name)
                    if name in self._names:
                        name = self._fresh(name + "_")
                    self._names.add(name)
                    st.names.append(name)
                    self.constants.append((name, nbytes))
            self._track(t, st, st.names[0] if st.names else None)

    def name_of(self, t):
        """The live name t stands for (tracking it if new); None when it is
        not recorded (too small, or without a storage)."""
        self._reap()
        entry = self._tensors.get(id(t))
        if entry is not None:
            return entry.name
        info = _storage_info(t)
        if info is None:
            return None
        key, nbytes = info
        st = self._storages.get(key)
        if st is None:
            st = self._new_storage(key, nbytes)
            if nbytes >= self._min_bytes:
                name = self._fresh("c")
                st.names.append(name)
                self.constants.append((name, nbytes))
        name = st.names[0] if st.names else None
        self._track(t, st, name)
        return name

    def _flush(self):
        if not self._pending:
            return
        released, self._pending = self._pending, []
        if self.ops:
            self.ops[-1][7].extend(released)
        else:
            self.initial_releases.extend(released)

    # Saved tensors: kept as themselves, so their storages stay tracked.

    def pack(self, t):
        with self._lock:
            self.name_of(t)
        return t

    @staticmethod
    def unpack(t):
        return t

    # Operators.

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        with self._lock:
            self._reap()
            self._flush()
            # Arguments the schema marks as written (Tensor(a!)): updated
            # in place. Those passed by keyword (out=) are not read.
            mutated = []
            out_args = set()
            schema = getattr(func, "_schema", None)
            for i, arg in enumerate(schema.arguments if schema else ()):
                info = arg.alias_info
                if info is None or not info.is_write:
                    continue
                if arg.name in kwargs:
                    _tensors_in(kwargs[arg.name], mutated)
                    out_args.add(arg.name)
                elif i < len(args) and not arg.kwarg_only:
                    _tensors_in(args[i], mutated)
            ins = []
            by_storage = {}  # storage key -> name of an input on it
            for value in args:
                for t in _tensors_in(value, []):
                    self._note_input(t, ins, by_storage)
            for key, value in kwargs.items():
                if key not in out_args:
                    for t in _tensors_in(value, []):
                        self._note_input(t, ins, by_storage)
            muts = []
            for t in mutated:
                name = self.name_of(t)
                if name is not None and name not in muts:
                    muts.append(name)
                info = _storage_info(t)
                if info is not None and name is not None:
                    by_storage.setdefault(info[0], name)
            input_ids = {id(t) for t in _tensors_in(args, [])}
            input_ids.update(id(t) for t in _tensors_in(kwargs, []))
            phase = self.phase

        if self._cuda:
            _torch.cuda.synchronize()
        start = time.perf_counter_ns()
        result = func(*args, **kwargs)
        if self._cuda:
            _torch.cuda.synchronize()
        elapsed = time.perf_counter_ns() - start
        if isinstance(result, (bool, int, float, complex)):
            result = _as_tensor(func, args, result)

        with self._lock:
            self._reap()
            outs = []
            aliases = []
            resized = []
            for t in mutated:
                self._check_resized(t, muts, outs, resized)
            for t in _tensors_in(result, []):
                if id(t) in input_ids or id(t) in self._tensors:
                    continue  # an argument given back (in place, out=)
                info = _storage_info(t)
                if info is None:
                    continue
                key, nbytes = info
                st = self._storages.get(key)
                name = None
                if st is None:
                    st = self._new_storage(key, nbytes)
                    if nbytes >= self._min_bytes:
                        name = self._fresh("t")
                        st.names.append(name)
                        outs.append((name, nbytes))
                elif st.names:
                    # A view of a live storage.
                    base = by_storage.get(key, st.names[0])
                    name = self._fresh("t")
                    st.names.append(name)
                    aliases.append((name, base))
                self._track(t, st, name)
            self.ops.append([_op_name(func), phase, elapsed, ins, outs, muts,
                             aliases, []])
            self._pending.extend(resized)
        return result

    def _check_resized(self, t, muts, outs, resized):
        """An argument written with a new size (out= given a tensor of
        another size resizes its storage) is not an update: its storage
        gets a new name, as a new output, and its old names go."""
        entry = self._tensors.get(id(t))
        info = _storage_info(t)
        if entry is None or info is None:
            return
        st = entry.storage
        key, nbytes = info
        if key != st.key or nbytes == st.bytes:
            return  # an update in place (or a new storage: not followed)
        for old in st.names:
            if old in muts:
                muts.remove(old)
        resized.extend(st.names)
        st.bytes = nbytes
        st.names = []
        name = None
        if nbytes >= self._min_bytes:
            name = self._fresh("t")
            st.names.append(name)
            outs.append((name, nbytes))
        for other in list(self._tensors.values()):
            if other.storage is st:
                other.name = name

    def _note_input(self, t, ins, by_storage):
        name = self.name_of(t)
        if name is None:
            return
        if name not in ins:
            ins.append(name)
        info = _storage_info(t)
        if info is not None:
            by_storage.setdefault(info[0], name)

    def finish(self):
        """Records the releases still pending and stops tracking."""
        with self._lock:
            self._reap()
            self._flush()
            entries = list(self._tensors.values())
            self._tensors.clear()
            self._storages.clear()
        for entry in entries:
            entry.finalizer.detach()

    # Output.

    def peak_bytes(self):
        """The most live storage bytes at once, as policies/sim/program.cc
        computes it: an in-place update is a new storage that takes over
        the old one's memory when the old one loses its last name."""
        bytes_of = []
        names_on = []
        storage_of = {}

        def new(nbytes):
            bytes_of.append(nbytes)
            names_on.append(1)
            return len(bytes_of) - 1

        def release(name, frees):
            s = storage_of.pop(name, None)
            if s is None:
                return
            names_on[s] -= 1
            if names_on[s] == 0:
                frees.append(s)

        live = 0
        for name, nbytes in self.constants:
            storage_of[name] = new(nbytes)
            live += nbytes
        frees = []
        for name in self.initial_releases:
            release(name, frees)
        live -= sum(bytes_of[s] for s in frees)
        peak = live
        for _, _, _, _, outs, muts, aliases, releases in self.ops:
            frees = []
            creates = []
            in_place = []
            for name, nbytes in outs:
                storage_of[name] = new(nbytes)
                creates.append(storage_of[name])
            for name in muts:
                old = storage_of[name]
                s = new(bytes_of[old])
                creates.append(s)
                in_place.append((s, old))
                names_on[old] -= 1
                if names_on[old] == 0:
                    frees.append(old)
                storage_of[name] = s
            for name, base in aliases:
                storage_of[name] = storage_of[base]
                names_on[storage_of[name]] += 1
            for name in releases:
                release(name, frees)
            reused = {s for s, old in in_place if old in frees}
            live += sum(bytes_of[s] for s in creates if s not in reused)
            peak = max(peak, live)
            live -= sum(bytes_of[s] for s in frees)
            live += sum(bytes_of[s] for s in reused)
        return peak

    def text(self, name, comment):
        lines = ["deltad-trace 1", f"name {name}", f"# {comment}"]
        lines += [f"const {n} {b}" for n, b in self.constants]
        if self.initial_releases:
            lines.append("release " + ",".join(self.initial_releases))
        for op, phase, ns, ins, outs, muts, aliases, releases in self.ops:
            words = ["op", op, phase, str(ns)]
            if ins:
                words.append("in=" + ",".join(ins))
            # out before mut before alias: a view may be of either.
            if outs:
                words.append("out=" + ",".join(f"{n}:{b}" for n, b in outs))
            if muts:
                words.append("mut=" + ",".join(muts))
            if aliases:
                words.append(
                    "alias=" + ",".join(f"{n}:{b}" for n, b in aliases))
            lines.append(" ".join(words))
            if releases:
                lines.append("release " + ",".join(releases))
        return "\n".join(lines) + "\n"
