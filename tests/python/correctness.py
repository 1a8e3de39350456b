"""What the correctness tests share (test_torch_correctness.py says what
they check): the budgets of the modes, the device, and `run`, which
trains a case unmanaged or in one managed block and keeps what to compare.
Imported before torch by the tests: it sets cuBLAS's workspace first."""

import os

# cuBLAS is deterministic only with a fixed workspace, read when CUDA
# starts: set before torch is imported (a value already set is kept).
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import contextlib  # noqa: E402
import gc  # noqa: E402

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

import deltad.torch  # noqa: E402

SMALL_BUDGET = 1 << 10  # below most single saved storages of the cases

FITS = dict(budget_bytes=1 << 30, policy="auto")
OFFLOAD = dict(budget_bytes=SMALL_BUDGET, policy="offload")
RECOMPUTE = dict(budget_bytes=SMALL_BUDGET, policy="recompute")
MODES = {"fits": FITS, "offload": OFFLOAD, "recompute": RECOMPUTE}

CPU = torch.device("cpu")
CUDA = torch.cuda.is_available()
NO_CUDA = (f"no CUDA device: PyTorch {torch.__version__} "
           + (f"(CUDA {torch.version.cuda}) sees no GPU"
              if torch.version.cuda else "is built without CUDA")
           + "; the cases ran on the CPU only")
# What PyTorch's message says of an op without a deterministic
# implementation under torch.use_deterministic_algorithms(True).
NOT_DETERMINISTIC = "does not have a deterministic implementation"

def _device_of(model):
    for t in model.parameters():
        return t.device
    return CPU


def _managed(model, **options):
    """deltad.torch.managed with the tests' defaults. On CUDA the budget
    is the whole process's: what the process holds now (the model, its
    inputs) is added to the budget asked for, and nothing is reserved for
    temporaries, so that a budget means about as much saved activations
    as on the CPU."""
    options = dict(options)
    options.setdefault("socket", None)
    options.setdefault("min_bytes", 1)
    device = _device_of(model)
    if device.type == "cuda":
        gc.collect()  # no earlier run's garbage counted in, then freed
        options["budget_bytes"] += torch.cuda.memory_allocated(device)
        options.setdefault("reserve_bytes", 0)
    return deltad.torch.managed(model, **options)


def _keep(tensor):
    """A copy of `tensor` to compare. From the GPU into pinned host memory
    without waiting (valid after the synchronize that ends every run), so
    that the test neither synchronizes inside the block nor lets its
    copies grow the device memory the block's budget is measured against."""
    tensor = tensor.detach()
    if not tensor.is_cuda:
        return tensor.clone()
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    return host


def _final_state(model, device):
    """The model's parameters and buffers, and draws from the random number
    generators (CPU, and the GPU's on CUDA), which must be where the
    unmanaged run left them (a recompute replays dropout's draws, then
    restores the states). On CUDA, synchronizes: everything kept is read
    only after the GPU has run every step."""
    after = [torch.rand(4)]
    if device.type == "cuda":
        after.append(torch.rand(4, device=device))
    state = [_keep(p) for p in model.parameters()]
    state += [_keep(b) for b in model.buffers()] + [_keep(a) for a in after]
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return state


def run(make_model, make_inputs, step, options=None, iterations=1, lr=0.1,
        seed=0, device=CPU, on_step=None):
    """Builds the model and inputs from `seed` (on the CPU, then moved to
    `device`), then runs `iterations` steps of SGD, managed with `options`
    (None: unmanaged) in ONE block around the loop, as a training script
    does. step(model, x) runs forward and backward and returns the tensors
    to compare (losses, outputs); on_step(manager), if given, runs after
    each step.

    Returns (per-step [returned tensors + gradients], final parameters,
    buffers and RNG draws, the manager's stats or None)."""
    torch.manual_seed(seed)
    model = make_model().to(device)
    inputs = [make_inputs().to(device) for _ in range(iterations)]
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    # Dropout draws from here on: the same in every run.
    torch.manual_seed(seed + 1)
    block = (contextlib.nullcontext() if options is None
             else _managed(model, **options))
    steps = []
    with block as manager:
        for x in inputs:
            optimizer.zero_grad(set_to_none=True)
            returned = step(model, x)
            grads = [_keep(p.grad) if p.grad is not None else None
                     for p in model.parameters()]
            steps.append([_keep(t) for t in returned] + grads)
            optimizer.step()
            if on_step is not None:
                on_step(manager)
    state = _final_state(model, device)
    return steps, state, (manager.stats() if manager is not None else None)


def assert_same_training(test, expected, got):
    """`run`'s answers unmanaged and managed: every step's returned tensors
    and gradients, and the final state, bit for bit."""
    for e, g in zip(expected[0], got[0]):
        for a, b in zip(e, g):
            if a is not None or b is not None:
                test.assertTrue(torch.equal(a, b))
    for a, b in zip(expected[1], got[1]):
        test.assertTrue(torch.equal(a, b))


def simple_step(model, x):
    loss = model(x).square().mean()
    loss.backward()
    return [loss]


def mlp():
    return nn.Sequential(nn.Linear(32, 64), nn.BatchNorm1d(64), nn.GELU(),
                         nn.Dropout(0.2), nn.Linear(64, 64), nn.ReLU(),
                         nn.Linear(64, 8))
