"""``python -m benchmarks.floor [--ops N] [--rounds R]``: what one op costs, at the least, in a
transform whose values are real tensors.

NOTE [The floor of a tensor-subclass engine]
minifunctorch shows user code a ``torch.Tensor`` subclass (``FuncTensor``) and runs its rules
in Python; torch.func keeps its values in C++ (``BatchedTensor``, ``GradTrackingTensor``) and
runs its batching rules there. An op on a subclass goes through torch's
``__torch_function__`` dispatch into Python, and its result needs a new wrapper tensor
(``_make_wrapper_subclass``), whatever the engine does in between. This script measures that
floor directly: a subclass whose ``__torch_function__`` only unwraps its one argument, calls
torch, and wraps the result (no levels, no rules), with and without a ``TorchFunctionMode``
on the stack (minifunctorch keeps one on while user code runs, for factories and random
calls). Beside it: the plain torch call, torch.func's ``vmap`` and ``grad``, and
minifunctorch's, each per op of S1's elementwise chain on a 10x10 tensor (the time of an
N-op chain minus the 1-op function, over N; benchmarks/cases.py, ``chain``).

The floor says which per-op targets a Python engine with real-tensor values can meet: one
below it cannot be met by speeding up the engine, only by moving the dispatch out of Python.
It prints a table; nothing is written.
"""
import argparse
import time

import torch
import torch.func
from torch.overrides import TorchFunctionMode

import minifunctorch.core as mft

from .cases import chain

_make_wrapper = torch.Tensor._make_wrapper_subclass


class Wrapped(torch.Tensor):
    """The least a subclass-valued engine does per op: unwrap, call torch, wrap."""

    @staticmethod
    def of(tensor):
        # positional, the cheapest call (NOTE [Wrappers made with positional arguments])
        out = _make_wrapper(Wrapped, tensor.size(), None, None, None, tensor.dtype,
                            torch.strided, tensor.device)
        out.inner = tensor
        return out

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return _unwrap_call_wrap(func, args, kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError("the floor handles torch functions only")


def _unwrap_call_wrap(func, args, kwargs):
    args = [a.inner if type(a) is Wrapped else a for a in args]
    out = func(*args, **(kwargs or {}))
    return Wrapped.of(out) if isinstance(out, torch.Tensor) else out


class PassThrough(TorchFunctionMode):
    """A mode that sends calls with a Wrapped argument to it, as minifunctorch's does."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if Wrapped in types:
            return _unwrap_call_wrap(func, args, kwargs)
        return func(*args, **(kwargs or {}))


def _per_call(function, argument, rounds, calls=200):
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            function(argument)
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def _per_op(make, argument, ops, rounds):
    """(time of the ops-op chain - time of the 1-op function) / ops, fastest of ``rounds``."""
    long, short = make(chain(ops)), make(chain(0))
    return (_per_call(long, argument, rounds) - _per_call(short, argument, rounds)) / ops


def _in_mode(f):
    def run(x):
        with PassThrough():
            return f(x)
    return run


def measure(ops=40, rounds=30):
    torch.manual_seed(0)
    x = torch.randn(10, 10)
    wrapped = Wrapped.of(x)
    rows = [
        ("plain torch call", lambda f: f, x),
        ("floor: subclass, unwrap-call-wrap", lambda f: f, wrapped),
        ("floor: subclass + mode on the stack", _in_mode, wrapped),
        ("torch.func.vmap", torch.func.vmap, x),
        ("minifunctorch vmap", mft.vmap, x),
        ("torch.func.grad", torch.func.grad, x),
        ("minifunctorch grad", mft.grad, x),
    ]
    return [(name, _per_op(make, argument, ops, rounds)) for name, make, argument in rows]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ops", type=int, default=40, help="length of the long chain")
    parser.add_argument("--rounds", type=int, default=30, help="fastest of this many rounds")
    options = parser.parse_args(argv)
    torch.set_num_threads(1)
    results = measure(options.ops, options.rounds)
    floor = dict(results)["floor: subclass + mode on the stack"]
    print(f"per op of S1's chain on a 10x10 tensor, 1 thread, fastest of {options.rounds} rounds")
    print(f"{'':40s} {'us/op':>7s} {'/ floor':>8s}")
    for name, seconds in results:
        print(f"{name:40s} {seconds * 1e6:7.2f} {seconds / floor:8.2f}")


if __name__ == "__main__":
    main()
