"""functorch's module API, kept for old tutorials: make_functional,
make_functional_with_buffers, combine_state_for_ensemble.

These are deprecated spellings. functorch (before torch.func) turned a module into a pair
``(func, params)``; torch.func leaves the module alone and passes its tensors by name:

    func, params = make_functional(model)           ->  params = dict(model.named_parameters())
    func(params, x)                                 ->  functional_call(model, params, (x,))
    func, params, buffers = combine_state_for_ensemble(models)
                                                    ->  params, buffers = stack_module_state(models)

New code should use ``functional_call`` and ``stack_module_state`` (modules.py); the functions
here exist so that programs written for functorch run unchanged, with the same return values
as torch._functorch.make_functional's.

NOTE [A stateless copy, called through functional_call]
functorch's ``make_functional`` deep-copies the model, takes the copy's parameters out as a
tuple (new leaves, ``requires_grad`` as in the model) and leaves placeholders on the ``meta``
device in their place, so the returned ``func`` (an nn.Module with the stateless copy as
``func.stateless_model``) holds no second set of weights and cannot run without being given
them. A tensor used under several names (tied weights) is returned once, under its first name
in ``named_parameters()``, and the copy keeps one placeholder for all its names. Calling
``func(params, *args)`` is then exactly ``functional_call(stateless_model, {first name:
tensor}, args)``: ``tie_weights=True`` puts each tensor back under all of its names, and the
swap is undone afterwards. functorch swaps the tensors itself; here the swap is
functional_call's, so both APIs share one implementation and its checks.
"""
import copy

import torch

from .modules import ModuleArgumentError, ModuleStateError, _check_ensemble, _stack, \
    functional_call


def _strip_state(model, named, placeholder):
    """Replace each tensor that ``named`` lists in ``model`` by a meta placeholder (one per
    distinct tensor); return (tensors, their first names, {first name: all of its names})."""
    first_name, names_map = {}, {}
    # listed before any replacement: a submodule reached under two names (self.b = self.a)
    # would otherwise show its placeholders the second time, as new tensors
    for name, tensor in list(named(remove_duplicate=False)):
        key = id(tensor)
        if key not in first_name:
            first_name[key] = (name, tensor, placeholder(torch.empty_like(tensor, device="meta")))
            names_map[name] = []
        first, _, stand_in = first_name[key]
        names_map[first].append(name)
        owner_name, _, attribute = name.rpartition(".")
        owner = model.get_submodule(owner_name)
        table = owner._parameters if attribute in owner._parameters else owner._buffers
        table[attribute] = stand_in
    tensors = tuple(tensor for _, tensor, _ in first_name.values())
    names = tuple(name for name, _, _ in first_name.values())
    return tensors, names, names_map


def _by_name(names, tensors, what, call):
    tensors = tuple(tensors)
    if len(tensors) != len(names):
        raise ModuleArgumentError(
            f"{call}: expected {len(names)} {what} (for {list(names)}), got {len(tensors)}. "
            f"Fix: pass the {what} tuple that make_functional returned, in its order.")
    return dict(zip(names, tensors))


class FunctionalModule(torch.nn.Module):
    """What ``make_functional`` returns: ``func(params, *args, **kwargs)`` runs the model with
    ``params`` (a sequence, in the order of ``func.param_names``)."""

    def __init__(self, stateless_model, param_names, names_map):
        super().__init__()
        self.stateless_model = stateless_model
        self.param_names = param_names
        self.names_map = names_map

    def forward(self, params, *args, **kwargs):
        call = f"make_functional(<{type(self.stateless_model).__name__}>)[0](params, ...)"
        tensors = _by_name(self.param_names, params, "parameters", call)
        return functional_call(self.stateless_model, tensors, args, kwargs)


class FunctionalModuleWithBuffers(torch.nn.Module):
    """What ``make_functional_with_buffers`` returns: ``func(params, buffers, *args,
    **kwargs)``, in the orders of ``func.param_names`` and ``func.buffer_names``."""

    def __init__(self, stateless_model, param_names, buffer_names, param_names_map,
                 buffer_names_map):
        super().__init__()
        self.stateless_model = stateless_model
        self.param_names = param_names
        self.buffer_names = buffer_names
        self.all_names_map = {**param_names_map, **buffer_names_map}

    def forward(self, params, buffers, *args, **kwargs):
        call = (f"make_functional_with_buffers(<{type(self.stateless_model).__name__}>)[0]"
                "(params, buffers, ...)")
        tensors = _by_name(self.param_names, params, "parameters", call)
        tensors.update(_by_name(self.buffer_names, buffers, "buffers", call))
        return functional_call(self.stateless_model, tensors, args, kwargs)


def _stateless_copy(model, disable_autograd_tracking, with_buffers):
    stateless = copy.deepcopy(model)
    params, param_names, param_map = _strip_state(
        stateless, stateless.named_parameters, torch.nn.Parameter)
    if disable_autograd_tracking:
        for param in params:
            param.requires_grad_(False)
    if not with_buffers:
        return stateless, params, param_names, param_map
    buffers, buffer_names, buffer_map = _strip_state(
        stateless, stateless.named_buffers, lambda t: t)
    return stateless, params, param_names, param_map, buffers, buffer_names, buffer_map


def make_functional(model, disable_autograd_tracking=False):
    """functorch's ``make_functional(model) -> (func, params)`` (deprecated spelling: use
    ``functional_call(model, dict(model.named_parameters()), args)``).

    ``params`` is a tuple of new leaf tensors (a copy of the model's, which stays untouched),
    requiring grad as the model's do, or none of them with ``disable_autograd_tracking=True``;
    ``func(params, *args, **kwargs)`` runs the model with them. A model with buffers is
    refused, as in functorch: use make_functional_with_buffers.

    >>> import torch
    >>> from minifunctorch.core import grad
    >>> from minifunctorch.core.compat import make_functional
    >>> model = torch.nn.Linear(2, 1)
    >>> func, params = make_functional(model)
    >>> [tuple(p.shape) for p in params], params[0].requires_grad
    ([(1, 2), (1,)], True)
    >>> x = torch.tensor([[1.0, 2.0]])
    >>> torch.allclose(func(params, x), model(x))
    True
    >>> grad(lambda params: func(params, x).sum())(params)[0]
    tensor([[1., 2.]])

    NOTE [A stateless copy, called through functional_call].
    """
    if any(True for _ in model.buffers()):
        raise ModuleStateError(
            "make_functional(model): `model` has buffers. Please use "
            f"make_functional_with_buffers(model) instead. The {type(model).__name__} has the "
            f"buffers {[name for name, _ in model.named_buffers()]}. Fix: func, params, "
            "buffers = make_functional_with_buffers(model), or better, functional_call(model, "
            "(params, buffers), args).")
    stateless, params, names, names_map = _stateless_copy(
        model, disable_autograd_tracking, with_buffers=False)
    return FunctionalModule(stateless, names, names_map), params


def make_functional_with_buffers(model, disable_autograd_tracking=False):
    """functorch's ``make_functional_with_buffers(model) -> (func, params, buffers)``
    (deprecated spelling: use ``functional_call(model, (params, buffers), args)`` with the
    dicts of ``named_parameters()`` and ``named_buffers()``).

    Like make_functional, plus ``buffers``, a tuple of copies of the model's buffers;
    ``func(params, buffers, *args, **kwargs)`` runs the model with both.

    >>> import torch
    >>> from minifunctorch.core.compat import make_functional_with_buffers
    >>> model = torch.nn.BatchNorm1d(2).eval()
    >>> func, params, buffers = make_functional_with_buffers(model)
    >>> len(params), [tuple(b.shape) for b in buffers]
    (2, [(2,), (2,), ()])
    >>> func(params, buffers, torch.ones(1, 2))
    tensor([[1.0000, 1.0000]], grad_fn=<NativeBatchNormBackward0>)
    """
    stateless, params, param_names, param_map, buffers, buffer_names, buffer_map = \
        _stateless_copy(model, disable_autograd_tracking, with_buffers=True)
    func = FunctionalModuleWithBuffers(stateless, param_names, buffer_names, param_map,
                                       buffer_map)
    return func, params, buffers


def combine_state_for_ensemble(models):
    """functorch's ``combine_state_for_ensemble(models) -> (func, params, buffers)``
    (deprecated spelling: use ``stack_module_state(models)`` and ``functional_call``).

    ``params`` and ``buffers`` are tuples of the models' tensors stacked along a new dim 0
    and detached (they do not require grad, as in functorch); ``func`` is
    ``make_functional_with_buffers(models[0])[0]``, to be called under ``vmap``.

    >>> import torch
    >>> from minifunctorch.core import vmap
    >>> from minifunctorch.core.compat import combine_state_for_ensemble
    >>> models = [torch.nn.Linear(3, 2) for _ in range(4)]
    >>> func, params, buffers = combine_state_for_ensemble(models)
    >>> [tuple(p.shape) for p in params], buffers
    ([(4, 2, 3), (4, 2)], ())
    >>> vmap(func, in_dims=(0, 0, None))(params, buffers, torch.ones(5, 3)).shape
    torch.Size([4, 5, 2])
    """
    models = list(models)
    call = _check_ensemble(models, "combine_state_for_ensemble")
    func, _, _ = make_functional_with_buffers(models[0])
    params = _stack(models, lambda m: m.named_parameters(), call, leaves=False)
    buffers = _stack(models, lambda m: m.named_buffers(), call, leaves=False)
    return func, tuple(params.values()), tuple(buffers.values())
