"""The store under random sequences of saves, uses, deaths and budget
changes (deltad.saved on CPU tensors, seeded): every unpack returns the
bytes that were saved, with their strides; the byte counts always equal
what the groups hold (resident on the device, offloaded on the host); and
once every saved tensor is gone, nothing is held. Evicted groups are
rebuilt by a stand-in recorder from a copy kept aside."""

import random
import unittest

import torch

import deltad.saved as saved

SEQUENCES = 400
STEPS = 80


class Plan:
    def __init__(self):
        self.pressure = False
        self.unpack_order = []
        self.groups = 0


class CopyRecorder:
    """Rebuilds an evicted group from a copy of its storage taken when it
    was saved: what a module rerun gives, without a module. Like a rerun,
    a rebuild first reads its sources, earlier groups picked at random,
    through the store (restoring them if they were released), and checks
    their bytes."""

    def __init__(self, rng, store_of):
        self.rng = rng
        self.store_of = store_of
        self.calls = {}
        self.copies = {}  # id(group) -> the storage's bytes
        self.created = {}  # id(group) -> creation count
        self.sources = {}  # id(group) -> the groups its rebuild reads
        self.candidates = []  # groups a new source may be picked from
        self.rebuilds = 0
        self.source_reads = 0

    def claim_pending(self):
        pass  # its groups' sources are drawn in can_rebuild

    def new_group(self, group, copy):
        self.copies[id(group)] = copy
        self.created[id(group)] = len(self.created)
        self.sources.pop(id(group), None)

    def can_rebuild(self, group):
        if id(group) not in self.sources:
            earlier = [g for g in self.candidates if g.state is not None and
                       g is not group and self.created.get(id(g), 1 << 30)
                       < self.created[id(group)]]
            self.sources[id(group)] = tuple(self.rng.sample(
                earlier, min(len(earlier), self.rng.choice([0, 1, 2]))))
        return all(g.state is not None for g in self.sources[id(group)])

    def sources_of(self, group):
        return self.sources[id(group)]

    def rebuild(self, group):
        self.rebuilds += 1
        for source in self.sources[id(group)]:
            flat = self.store_of().storage_of(source)
            expected = self.copies[id(source)]
            assert torch.equal(flat.view(-1)[:expected.numel()], expected), \
                "a source's bytes changed"
            self.source_reads += 1
        return self.copies[id(group)].clone()


class StoreInvariantsTest(unittest.TestCase):

    def check_counts(self, store, live):
        """The counters against the groups of the live saved tensors (no
        group here outlives its members: the recorder reads no sources)."""
        groups = {id(e[0].group): e[0].group for e in live}
        stack = list(groups.values())
        while stack:  # and the groups evicted ones will read
            for source in stack.pop().evicted_sources:
                if id(source) not in groups:
                    groups[id(source)] = source
                    stack.append(source)
        groups = groups.values()
        c = store.counters
        self.assertEqual(c.resident_bytes, sum(
            g.nbytes for g in groups if g.state == saved.RESIDENT))
        self.assertEqual(c.host_bytes, sum(
            g.nbytes for g in groups if g.state == saved.OFFLOADED))
        self.assertEqual(store.alive, len(groups))
        for key, g in store.groups.items():
            self.assertEqual(g.state, saved.RESIDENT)
            # Its bytes: restored and not rebuilt yet, its members, or
            # kept for the evicted groups that read it.
            held = g.flat if g.flat is not None else next(
                (t for t in g.tensors if t is not None), g.retained)
            self.assertEqual(saved._storage(held).data_ptr(), key)

    def run_sequence(self, seed):
        rng = random.Random(seed)
        store = None
        recorder = CopyRecorder(rng, lambda: store)
        choice = rng.choice(["offload", "evict", "mixed"])

        def director(group):  # as deltad.torch's: evict what can be rebuilt
            how = rng.choice(["offload", "evict"]) if choice == "mixed" \
                else choice
            if how == "evict" and not recorder.can_rebuild(group):
                return "offload"
            return how

        store = saved.SavedStore(
            torch.device("cpu"), 1 << 30, director, recorder,
            host_bytes=rng.choice([1 << 30, 64 << 10]),
            prefetch_bytes=rng.choice([0, 16 << 10, 1 << 30]), plan=Plan(),
            on_iteration=lambda: None)
        live = []  # (SavedTensor, expected tensor)
        bases = []  # tensors the test still holds (not releasable)
        for _ in range(STEPS):
            op = rng.random()
            if op < 0.45:
                # Save a new tensor, or a view of one the test holds.
                if bases and rng.random() < 0.3:
                    base = rng.choice(bases)
                    n = base.numel()
                    tensor = rng.choice([
                        lambda b: b[: n // 2],
                        lambda b: b.view(-1, 2).t(),
                        lambda b: b[1::2]])(base)
                else:
                    base = torch.randn(rng.choice([64, 256, 1024, 2048]))
                    tensor = base
                    if rng.random() < 0.5:
                        bases.append(base)
                storage = saved._storage(tensor)
                s = store.pack(tensor, storage.data_ptr(), storage)
                if s.index == 0:  # a new group (ids of dead ones recur)
                    recorder.new_group(s.group, saved._flat(
                        tensor, s.group.nbytes).clone())
                recorder.candidates = [e[0].group for e in live] + [s.group]
                live.append((s, tensor.clone(), tuple(tensor.stride())))
                del tensor, base, s
            elif op < 0.65 and live:
                s, expected, stride = rng.choice(live)
                out = store.unpack(s)
                self.assertTrue(torch.equal(out, expected), f"seed {seed}")
                self.assertEqual(tuple(out.stride()), stride)
                del out, s
            elif op < 0.85 and live:
                live.pop(rng.randrange(len(live)))
            elif op < 0.92 and bases:
                bases.pop(rng.randrange(len(bases)))
            else:
                store.budget = rng.choice([2 << 10, 8 << 10, 32 << 10,
                                           1 << 30])
            self.check_counts(store, live)
        for entry in live:
            self.assertTrue(torch.equal(store.unpack(entry[0]), entry[1]))
        entry = None
        live.clear()
        bases.clear()
        store.close()
        self.check_counts(store, live)
        c = store.counters
        self.assertEqual((c.resident_bytes, c.host_bytes), (0, 0),
                         f"seed {seed}")
        return c, recorder

    def test_random_sequences_keep_bytes_and_counts(self):
        offloads = evictions = reloads = rebuilds = sources = 0
        for seed in range(SEQUENCES):
            c, recorder = self.run_sequence(seed)
            offloads += c.offloads
            evictions += c.evictions
            reloads += c.reloads
            rebuilds += recorder.rebuilds
            sources += recorder.source_reads
        # The sequences did release and restore (else they prove nothing).
        self.assertGreater(sources, 50)
        self.assertGreater(offloads, 100)
        self.assertGreater(evictions, 100)
        self.assertGreater(reloads, 50)
        self.assertGreater(rebuilds, 50)


if __name__ == "__main__":
    unittest.main()
