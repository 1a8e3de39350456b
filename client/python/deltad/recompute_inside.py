"""Recompute of what a module's ops save inside its forward and the module
does not return (attention probabilities, a residual sum inside a block):
such a storage belongs to the innermost recorded call that was running
when it was first saved, and a rerun of that call finds it again by the
order of what its ops save (docs/PYTORCH.md, "Tensors saved inside a
module"). A mixin of deltad.recompute.Recorder, whose state it uses.
"""

import torch as _torch

from deltad.saved import EVICTED, RESIDENT, _storage


class _NotRecomputable(Exception):
    pass


def _meta(tensor):
    return (tensor.shape, tensor.stride(), tensor.storage_offset(),
            tensor.dtype)


class Intermediate:
    """A saved storage that a recorded call's ops made and saved but the
    call did not return (attention probabilities inside an attention
    module, a residual sum inside a block): rebuilt by running the call
    again up to the `ordinal`-th tensor its ops save that the store would
    keep (counted from 0), the same ops saving in the same order. In a
    group's `call`, where a Call would be."""

    __slots__ = ("call", "ordinal", "meta", "nbytes", "out_version")

    def __init__(self, call, ordinal, meta, nbytes, version):
        self.call = call
        self.ordinal = ordinal
        self.meta = meta  # the first saved member's, checked at a rebuild
        self.nbytes = nbytes
        self.out_version = version  # the members' version when recorded

    def cost_ns(self):
        return self.call.cost_ns()

    def sources(self):
        return self.call.sources()


class _Captured(Exception):
    """Ends a rerun once it saved the storage it was run for. (PyTorch may
    raise it again as a RuntimeError: the capture is what tells.)"""


class Intermediates:
    """Recorder's claims of intermediates, their check and their rebuild
    (see the module's description)."""

    def claim_pending(self):
        """Claims the intermediates of the calls this thread is running,
        innermost first: the store is about to release, and a group that
        a call running now made can then be evicted instead of copied.
        Each call's groups are looked at once: a frame (see _record) then
        starts at the first group not looked at."""
        for frame in reversed(getattr(self.local, "pending", ())):
            scanned = self._claim_intermediates(*frame)
            if scanned is not None:
                frame[5], frame[6] = scanned

    def _claim_intermediates(self, module, call, args, kwargs, before,
                             groups, first, final=False):
        """Makes the groups saved while `call` ran, that no call returned
        (nor an inner call claimed), rebuildable by running `call` again
        (Intermediate). `groups`, `first`: the store's groups and how many
        it had as the call began (call.packs, its count of packs then);
        `before`: the call's tensor arguments and their versions then;
        `final`: the call returned.

        A rerun finds them by the order of what it saves, so it must save
        what the call saved: the first time a module is called with these
        shapes, its claims wait until it returns and are checked by a
        rerun then (_verify); a module whose rerun saves otherwise (a path
        taken by identity, state or chance) claims nothing."""
        store = self.store
        if store.by_position is not groups:
            # A new iteration began inside the call: every group of it was
            # made by the call.
            groups, first = store.by_position, 0
        if len(groups) <= first:
            return
        shapes = tuple(tuple(t.shape) for t, _ in before)
        verdicts = self.verified.get(module)
        verdict = verdicts.get(shapes) if verdicts is not None else None
        if verdict is False or (verdict is None and not final):
            return
        if any(t._version != version for t, version in before):
            return  # changed an argument in place: a rerun would not see it
        if call.args is None:
            # Its output not recorded (not a tensor, small, an inner
            # call's; or the call still runs): its arguments' sources are
            # what a rerun reads.
            try:
                call.kwargs = {k: self._source(v) for k, v in kwargs.items()}
                sources = tuple(self._source(a) for a in args)
            except _NotRecomputable:
                return
            call.args = sources
            call.depth = 1 + max((v[1].depth for v in call.sources()
                                  if v[0] == "call"), default=0)
            call.out_meta = call.out_nbytes = call.out_version = None
        if call.depth > self.max_depth:
            return
        if getattr(call, "grads", None) is None:
            # The rerun's copies of the arguments need grad where these
            # did, so that its ops save what these saved, in that order.
            call.grads = tuple(isinstance(a, _torch.Tensor) and
                               a.requires_grad for a in args)
            call.kwarg_grads = {k: isinstance(v, _torch.Tensor) and
                                v.requires_grad for k, v in kwargs.items()}
        # Its arguments' storages, saved first inside it (a LayerNorm's
        # input), are not its to rebuild: the rerun reads them.
        arguments = {_storage(t).data_ptr() for t, _ in before}
        packs = call.packs
        claims = []
        scanned = (groups, len(groups))
        with store.lock:
            for group in groups[first:]:
                if group.call is None and group.live and \
                        group.first_pack > packs and \
                        group.key not in arguments:
                    member = _recorded_member(group)
                    if member is not None:
                        meta, version = member
                        group.call = Intermediate(
                            call, group.first_pack - packs - 1, meta,
                            group.nbytes, version)
                        claims.append(group)
        if verdict is None and claims:
            if not all(v[0] == "value" or (v[0] == "group" and
                                           v[1].state == RESIDENT)
                       for v in call.sources()):
                # Checked by a later call whose rerun reads only what is
                # at hand: restoring (or rerunning) its arguments to check
                # would cost what releasing saved.
                with store.lock:
                    for group in claims:
                        group.call = None
                return
            verdict = self._verify(call, [g.call for g in claims])
            if verdicts is None:
                verdicts = self.verified[module] = {}
            verdicts[shapes] = verdict
            if not verdict:
                with store.lock:
                    for group in claims:
                        if isinstance(group.call, Intermediate):
                            group.call = None
        return scanned

    def _verify(self, call, intermediates):
        """Whether a rerun of `call` saves each of `intermediates` where
        it was saved (its place among what the store would keep, with its
        layout and size)."""
        saved = []

        def pack(tensor):
            if self._would_group(tensor) is not None:
                saved.append((_meta(tensor), _storage(tensor).nbytes()))
            return None
        try:
            self._run(call, pack=pack)
        except Exception:  # noqa: BLE001 (a rerun that fails verifies nothing)
            return False
        return all(i.ordinal < len(saved) and
                   saved[i.ordinal] == (i.meta, i.nbytes)
                   for i in intermediates)

    def _would_group(self, tensor):
        """Whether the store's hooks would keep `tensor` in a group (as
        _savedcore's pack decides), its storage's address if so."""
        if tensor.layout != _torch.strided or tensor.device != self.device:
            return None
        if tensor.numel() * tensor.element_size() < self.min_bytes:
            return None
        fixed = self.fixed
        if fixed is None:
            if tensor.requires_grad and tensor.is_leaf:
                return None
            base = tensor._base
            if base is not None and base.is_leaf and base.requires_grad:
                return None
        key = _storage(tensor).data_ptr()
        if fixed is not None and key in fixed:
            return None
        return key

    def _rebuild_intermediate(self, inter):
        # What the call saved before this one and is evicted (its other
        # intermediates, its inner calls' outputs) comes back from the
        # same rerun: backward reads it next. Its place among what the
        # rerun saves is where the call's count of packs put it.
        store = self.store
        begin = inter.call.packs
        alongside = {}
        for group in store.by_position:
            ordinal = group.first_pack - begin - 1
            if 0 <= ordinal < inter.ordinal and group.state == EVICTED and \
                    group.live:
                alongside[ordinal] = group
        extras = {}
        out = self._run(inter.call, capture=inter,
                        alongside=(alongside, extras))
        shape, stride, offset, dtype = inter.meta
        if (out is None or tuple(out.shape) != tuple(shape) or
                out.stride() != stride or out.storage_offset() != offset or
                out.dtype != dtype or _storage(out).nbytes() != inter.nbytes):
            got = ("nothing" if out is None else
                   f"{tuple(out.shape)} {out.dtype} strides {out.stride()}")
            raise RuntimeError(
                f"deltad: recomputing a tensor saved inside "
                f"{type(inter.call.module).__name__} gave {got}, not "
                f"{tuple(shape)} {dtype} strides {stride} (its forward saved "
                f"other tensors the second time); use policy='offload' for "
                f"this model")
        # Latest first: backward reads what the call saved in reverse, so
        # where the budget holds only some, those are the ones read next
        # (the earliest, kept instead, would leave each one between to a
        # rerun of its own).
        for ordinal in sorted(extras, reverse=True):
            tensor = extras[ordinal]
            group = alongside[ordinal]
            member = _recorded_member(group)
            if member is not None and (_meta(tensor),
                                       _storage(tensor).nbytes()) == \
                    (member[0], group.nbytes):
                # (The room the store made is for `out`, added after.)
                store.rebuilt_alongside(group, tensor, reserve=inter.nbytes)
        return out

    def _capturing(self, inter, alongside):
        """A pack hook for a rerun of `inter.call` that ends it once it
        saves the tensor `inter` stands for: the ordinal-th of those the
        store would keep. Those at the ordinals of `alongside` (a dict of
        ordinals, and one the hook fills with the tensors saved there) are
        kept too; the rest is dropped, as a rebuild's."""
        count = [0]
        captured = []
        wanted, kept = alongside if alongside is not None else ({}, {})

        def pack(tensor):
            if self._would_group(tensor) is None:
                return None
            if count[0] == inter.ordinal:
                captured.append(tensor.detach())
                raise _Captured()
            if count[0] in wanted:
                kept[count[0]] = tensor.detach()
            count[0] += 1
            return None
        return pack, captured


def _needing_grad(values, grads):
    """Makes the rerun's copies need grad where the call's arguments did."""
    for value, grad in zip(values, grads):
        if grad and isinstance(value, _torch.Tensor) and \
                not value.requires_grad and value.is_leaf:
            value.requires_grad_()


def _recorded_member(group):
    """(meta, version) of a group's first member: from the tensor while
    resident, from what its release kept once released; None if neither."""
    for t in group.tensors:
        if t is not None:
            return _meta(t), t._version
    metas, versions = group.metas, group.versions
    for i, meta in enumerate(metas or ()):
        if meta is not None and versions and i < len(versions) and \
                versions[i] is not None:
            return meta, versions[i]
    return None
