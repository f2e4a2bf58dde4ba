"""PyTorch's own nn module database (``module_db``) under grad, against torch.func.

A student's model is built from these modules. For each ModuleInfo (float32, CPU, training
mode), its first module inputs: the module built with the sample's constructor arguments,
then the gradient of a weighted sum of its floating outputs with respect to its parameters
(for a module without parameters, its floating inputs), through ``functional_call``, with
buffers passed as a second dict. Every module that
torch.func differentiates must give torch.func's gradients here, not a refusal.
Lazy modules (their parameters exist only after a first call) are skipped.
"""
import warnings

import optree
import pytest
import torch
import torch.func as tf

pytest.importorskip("expecttest", reason="torch.testing._internal needs expecttest: "
                    "pip install -e '.[test]'")
from torch.testing._internal.common_modules import module_db  # noqa: E402

import minifunctorch.core as mf  # noqa: E402

INPUTS = 2  # per module


def _floats(out):
    return [o for o in optree.tree_leaves(out, none_is_leaf=True)
            if isinstance(o, torch.Tensor) and o.is_floating_point()]


def _weighted(out):
    return sum((o * torch.linspace(-1.0, 1.0, o.numel()).reshape(o.shape)).sum()
               for o in _floats(out))


pytestmark = pytest.mark.usefixtures("one_thread")  # (conftest.py)


def _module_inputs(info):
    """The ModuleInfo's first module inputs (float32, CPU, training mode)."""
    if "Lazy" in info.module_cls.__name__:
        pytest.skip("a lazy module has its parameters only after a first call")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        inputs = info.module_inputs_func(info, device="cpu", dtype=torch.float32,
                                         requires_grad=False, training=True)
    return inputs[:INPUTS]


@pytest.mark.parametrize("info", module_db, ids=[i.formatted_name for i in module_db])
def test_parameter_gradients_match_torch_func(info):
    inputs = _module_inputs(info)
    compared, refused_by_torch_func = 0, []
    for sample in inputs:
        if sample.forward_input is None:
            continue
        torch.manual_seed(0)
        module = info.module_cls(*sample.constructor_input.args,
                                 **sample.constructor_input.kwargs).train()
        params = {n: p.detach() for n, p in module.named_parameters()}
        buffers = dict(module.named_buffers())
        args, kwargs = sample.forward_input.args, sample.forward_input.kwargs
        # the parameters, or for a module without any, its floating tensor inputs
        inputs_at = [i for i, a in enumerate(args)
                     if isinstance(a, torch.Tensor) and a.is_floating_point()]
        if not params and not inputs_at:
            continue
        of_inputs = not params

        def loss(api):
            def f(p):
                torch.manual_seed(1)  # (dropout inside draws the same numbers for both)
                state = {n: b.clone() for n, b in buffers.items()}
                call_args = list(args)
                if of_inputs:
                    for i, x in zip(inputs_at, p):
                        call_args[i] = x
                    p = {}
                return _weighted(api.functional_call(module, (p, state), tuple(call_args),
                                                     kwargs))
            return f
        if of_inputs:
            params = tuple(args[i] for i in inputs_at)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                theirs = tf.grad(loss(tf))(params)
            except Exception as error:  # noqa: BLE001 - torch.func refuses this input
                refused_by_torch_func.append(f"{type(error).__name__}: {error}"[:120])
                continue
            ours = mf.grad(loss(mf))(params)
        for name in (theirs if isinstance(theirs, dict) else range(len(theirs))):
            torch.testing.assert_close(ours[name], theirs[name], rtol=1e-3, atol=1e-4,
                                       equal_nan=True,  # (LPPool's and KLDiv's own NaNs)
                                       msg=lambda m: f"{info.formatted_name}, {name}: {m}")
        compared += 1
    if refused_by_torch_func and not compared:
        pytest.skip(f"torch.func refuses: {refused_by_torch_func[0]}")
    if not compared:
        pytest.skip("no parameters and no floating input")


@pytest.mark.parametrize("info", module_db, ids=[i.formatted_name for i in module_db])
def test_per_sample_gradients_match_a_loop_of_torch_func_grads(info):
    """vmap(grad) over two examples of each input (the sample and a scaled copy) against
    torch.func's grad on each example; where the engine refuses, torch.func's vmap refuses
    too (batch norm updating unbatched running statistics)."""
    inputs = _module_inputs(info)
    compared = 0
    for sample in inputs:
        if sample.forward_input is None or sample.forward_input.kwargs:
            continue
        args = sample.forward_input.args
        if not args or not all(isinstance(a, torch.Tensor) and a.is_floating_point()
                               for a in args):
            continue
        torch.manual_seed(0)
        module = info.module_cls(*sample.constructor_input.args,
                                 **sample.constructor_input.kwargs).train()
        params = {n: p.detach() for n, p in module.named_parameters()}
        if not params:
            continue
        buffers = dict(module.named_buffers())
        stacked = [torch.stack([a, a * 0.9 + 0.05]) for a in args]

        def loss(api):
            def f(p, *xs):
                torch.manual_seed(1)
                state = {n: b.clone() for n, b in buffers.items()}
                return _weighted(api.functional_call(module, (p, state), xs))
            return f
        in_dims = (None,) + (0,) * len(args)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                theirs = [tf.grad(loss(tf))(params, *[s[i] for s in stacked]) for i in range(2)]
            except Exception:  # noqa: BLE001 - torch.func refuses an example
                continue
            try:
                ours = mf.vmap(mf.grad(loss(mf)), in_dims=in_dims)(params, *stacked)
            except mf.TransformError as error:
                with pytest.raises(Exception):  # noqa: PT011 - any refusal of torch.func's
                    tf.vmap(tf.grad(loss(tf)), in_dims=in_dims)(params, *stacked)
                assert "Fix:" in str(error)
                compared += 1
                continue
        for i in range(2):
            for name in theirs[i]:
                torch.testing.assert_close(
                    ours[name][i], theirs[i][name], rtol=1e-3, atol=1e-4, equal_nan=True,
                    msg=lambda m: f"{info.formatted_name}, example {i}, {name}: {m}")
        compared += 1
    if not compared:
        pytest.skip("no module input with parameters and floating tensor arguments")
