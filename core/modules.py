"""Module utilities: call an nn.Module with other tensors, and stack an ensemble's state.

``functional_call`` turns a module into a function of its parameters and buffers, which is
what the transforms need: ``grad`` differentiates with respect to arguments, ``vmap`` maps
over arguments, and a module keeps its state in attributes. ``stack_module_state`` prepares
an ensemble for ``vmap``; ``replace_all_batch_norm_modules_`` removes the running statistics
that batch norm would otherwise update in place under ``vmap``.

NOTE [functional_call reuses torch.func's swap]
torch.func.functional_call swaps the given tensors into the module's ``_parameters`` and
``_buffers`` tables (``_reparametrize_module`` in torch.nn.utils.stateless), calls the module,
and swaps the originals back in a ``finally``. It never looks inside the tensors: it needs
only ``isinstance(t, torch.Tensor)`` and identity, and a FuncTensor (tensor.py) is a real
torch.Tensor. So torch's own swap runs unchanged under this engine's transforms
(tests/test_modules.py checks it under grad, vjp, jvp and vmap against torch.func), and
reusing it gives torch.func's exact semantics: tied weights (``tie_weights``), keys the module
does not have (``strict``), a tuple of dicts, and buffers that the module reassigns written
back into the caller's dict. Its common case, where the swap is a few dict assignments, is
written out for speed (NOTE [The common swap, written out]).
Two differences, both on purpose:
- The checks come first, here, so that a misuse raises this engine's errors: they derive
  from the builtin exception torch.func raises (ValueError, RuntimeError, AttributeError,
  TypeError), begin with torch.func's wording, then name the call and the fix.
- The originals are put back in the reverse order of the swap (torch's ``stack_weights=True``
  option). torch.func restores in the same order, which is wrong when one submodule is
  reachable under two names (``self.b = self.a``): with tie_weights, ``a.weight`` and
  ``b.weight`` are the same slot, the second swap records the first's new tensor as the
  "original", and the module keeps the caller's tensor after the call (pytorch/pytorch
  issue 164759). Under a transform that tensor would be a value of a finished level left
  inside the user's module. In reverse order each slot gets back what it held.
"""
import contextlib
from collections.abc import Sequence

import torch
from torch.nn.utils.stateless import _reparametrize_module

from .errors import TransformUsageError


class ModuleArgumentError(TransformUsageError, ValueError):
    """functional_call got dictionaries it cannot use (torch.func raises ValueError)."""


class ModuleStateError(TransformUsageError, RuntimeError):
    """A module's state does not fit the call: strict keys, ensembles that differ, a module
    with buffers given to make_functional (torch.func raises RuntimeError)."""


class ModuleAttributeError(TransformUsageError, AttributeError):
    """A key names a submodule the module does not have (torch raises AttributeError)."""


class ModuleTypeError(TransformUsageError, TypeError):
    """A key or a value of the wrong kind: a non-tensor value, a key through a non-module
    (torch raises TypeError)."""


# --- functional_call ---------------------------------------------------------------------------
def _describe(module, dicts, tie_weights, strict) -> str:
    """``functional_call(<Linear>, <dict of 2>, args, strict=True)``: how errors name the call."""
    def shown(d):
        return f"<dict of {len(d)}>" if isinstance(d, dict) else f"<{type(d).__name__}>"
    if isinstance(dicts, (tuple, list)):
        given = "(" + ", ".join(shown(d) for d in dicts) + ("," if len(dicts) == 1 else "") + ")"
    else:
        given = shown(dicts)
    options = "".join([", tie_weights=False" if not tie_weights else "",
                       ", strict=True" if strict else ""])
    return f"functional_call(<{type(module).__name__}>, {given}, args{options})"


def _merge(dicts, call) -> dict:
    """One dict of every given tensor: torch.func's rules for a dict or a sequence of them."""
    if isinstance(dicts, dict):
        return dicts
    if not isinstance(dicts, Sequence):
        raise ModuleArgumentError(
            f"{call}: Expected parameter_and_buffer_dicts to be a dict, or a list/tuple of "
            f"dicts, but got {type(dicts)}. Expected {{name: tensor}} or a tuple of such dicts "
            "(parameters, buffers). Fix: pass dict(module.named_parameters()) or "
            "(params, buffers).")
    if not all(isinstance(d, dict) for d in dicts):
        kinds = [type(d).__name__ for d in dicts]
        raise ModuleArgumentError(
            f"{call}: Expected all elements of parameter_and_buffer_dicts to be dictionaries. "
            f"got elements of the kinds {kinds}. Fix: pass a tuple of dicts such as "
            "(params, buffers).")
    merged, first_seen, repeated = {}, {}, {}
    for index, d in enumerate(dicts):
        for key, value in d.items():
            if key in first_seen:
                repeated.setdefault(key, [first_seen[key]]).append(index)
            else:
                first_seen[key] = index
            merged[key] = value
    if repeated:
        where = "; ".join(f"{key!r} in dicts {indices}" for key, indices in repeated.items())
        raise ModuleArgumentError(
            f"{call}: {list(repeated)} appeared in multiple dictionaries; behavior of "
            f"functional call is ambiguous. Expected dictionaries with distinct keys, got {where}. "
            "Fix: give each parameter or buffer in one dictionary only.")
    return merged


def _check_refused_modules(module, call):
    if not isinstance(module, torch.nn.Module):
        raise ModuleTypeError(
            f"{call}: expected an nn.Module, got {type(module).__name__}. Fix: pass the module "
            "first, then its tensors.")
    jitted = (torch.jit.RecursiveScriptModule, torch.jit.ScriptModule, torch.jit.ScriptFunction)
    if torch.jit.is_tracing() or torch.jit.is_scripting() or isinstance(module, jitted):
        raise ModuleStateError(
            f"{call}: The stateless API can't be used with Jitted modules. Got a TorchScript "
            "module. Fix: call functional_call on the original Python module.")
    if isinstance(module, torch.nn.DataParallel):
        raise ModuleStateError(
            f"{call}: The stateless API can't be used with nn.DataParallel module. Got an "
            "nn.DataParallel. Fix: pass its .module.")


_USE_NAMES = "Fix: use the names of module.named_parameters() and module.named_buffers()."


def _check_keys_and_values(module, tensors, call):
    """What torch's swap tripped over, said with the key and the fix (run after it failed)."""
    for key, value in tensors.items():
        if not isinstance(key, str):
            raise ModuleTypeError(
                f"{call}: expected string keys (the names of module.named_parameters()), got "
                f"{key!r}. Fix: key the tensors by name.")
        if value is not None and not isinstance(value, torch.Tensor):
            raise ModuleTypeError(
                f"{call}: {value} is not an instance of torch.Tensor. The value for {key!r} "
                f"is a {type(value).__name__}. Fix: pass tensors (torch.as_tensor(...)).")
        owner, path = module, ""
        *owner_names, attribute = key.split(".")
        for part in owner_names:
            path = f"{path}.{part}" if path else part
            if not hasattr(owner, part):
                raise ModuleAttributeError(
                    f"{call}: {owner._get_name()} has no attribute `{part}`. The key {key!r} "
                    f"goes through {path!r}, which the module does not have. {_USE_NAMES}")
            owner = getattr(owner, part)
            if not isinstance(owner, torch.nn.Module):
                raise ModuleTypeError(
                    f"{call}: submodule `{path}`: {owner} is not an instance of torch.nn.Module. "
                    f"the key {key!r} goes through it. {_USE_NAMES}")
        if attribute in owner._parameters or attribute in owner._buffers:
            continue
        current = getattr(owner, attribute, None)
        if current is not None and not isinstance(current, torch.Tensor):
            raise ModuleTypeError(
                f"{call}: attribute `{attribute}`: {current} is not an instance of torch.Tensor. "
                f"the key {key!r} names an attribute that is not a tensor. {_USE_NAMES}")


def _tied_groups(module) -> dict:
    """name -> the names that share its tensor, for each tied name (none for untied ones)."""
    names_of = {}
    for name, tensor in (*module.named_parameters(remove_duplicate=False),
                         *module.named_buffers(remove_duplicate=False)):
        names_of.setdefault(id(tensor), []).append(name)
    return {name: group for group in names_of.values() if len(group) > 1 for name in group}


def _check_tied_values(tensors, groups, call):
    for name in tensors:
        given = [other for other in groups.get(name, ()) if other in tensors]
        if len({id(tensors[other]) for other in given}) > 1:
            raise ModuleArgumentError(
                f"{call}: functional_call got multiple values for keys "
                f"{sorted(groups[name])}, which are tied. Consider using tie_weights=False. The "
                f"module uses one tensor under the names {sorted(groups[name])}, and the dict "
                f"gives different tensors "
                f"for {sorted(given)}. Fix: give one of the names (the others follow it), or "
                "pass tie_weights=False to untie them for this call.")


def _check_strict(module, tensors, groups, tie_weights, call):
    given = set(tensors)
    if tie_weights:  # a tied name that is given stands for all of its group
        given |= {other for name in tensors for other in groups.get(name, ())}
    valid = {name for name, _ in module.named_parameters(remove_duplicate=False)}
    valid |= {name for name, _ in module.named_buffers(remove_duplicate=False)}
    unexpected, missing = sorted(given - valid), sorted(valid - given)
    if not unexpected and not missing:
        return
    problems = []
    if unexpected:
        problems.append(f"Unexpected key(s): {', '.join(map(repr, unexpected))}.")
    if missing:
        problems.append(f"Missing key(s): {', '.join(map(repr, missing))}.")
    raise ModuleStateError(
        f"{call}: Error(s) in reparametrizing for {module._get_name()}:\n\t" + "\n\t".join(problems)
        + "\nWith strict=True the keys must be exactly the names of the module's "
        "parameters and buffers" + (" (a tied name given counts for its whole group)"
                                    if tie_weights else "")
        + ". Fix: pass every parameter and buffer (dict(module.named_parameters()), "
        "dict(module.named_buffers())), or strict=False to replace only some of them.")


def functional_call(module, parameter_and_buffer_dicts, args=None, kwargs=None, *,
                    tie_weights=True, strict=False):
    """Call ``module`` with its parameters and buffers replaced by the given tensors.

    torch.func.functional_call's contract: ``parameter_and_buffer_dicts`` is a dict
    ``{name: tensor}`` or a tuple/list of dicts with distinct keys (``(params, buffers)``);
    ``args`` is a tuple of positional arguments, or one argument; ``kwargs`` a dict.
    ``tie_weights=True``: a name given for a tied tensor (one tensor under several names, such
    as a decoder weight shared with an embedding) replaces it under all its names;
    ``tie_weights=False``: only under that name. ``strict=True``: the keys must be exactly the
    module's parameters and buffers; ``strict=False``: a subset, and a key the module does not
    have is set as a plain attribute for the call. The module's own tensors are back in place
    afterwards, also after an error.

    >>> import torch
    >>> from minifunctorch.core import functional_call, grad
    >>> model = torch.nn.Linear(2, 1)
    >>> params = {k: torch.ones_like(v) for k, v in model.named_parameters()}
    >>> functional_call(model, params, (torch.ones(1, 2),))
    tensor([[3.]])
    >>> loss = lambda p, x: functional_call(model, p, (x,)).sum()
    >>> grad(loss)(params, torch.tensor([[1.0, 2.0]]))["weight"]
    tensor([[1., 2.]])
    >>> functional_call(model, {"weight": torch.ones(1, 2)}, torch.ones(1, 2), strict=True)
    Traceback (most recent call last):
    ...
    minifunctorch.core.modules.ModuleStateError: ...Error(s) in reparametrizing for Linear:...Missing...

    The swap is torch.func's own (NOTE [functional_call reuses torch.func's swap]), written
    out for the common case (NOTE [The common swap, written out]).
    """
    call = _Call(module, parameter_and_buffer_dicts, tie_weights, strict)
    tensors = _merge(parameter_and_buffer_dicts, call)
    _check_refused_modules(module, call)
    if args is None:
        args = ()
    elif not isinstance(args, tuple):
        args = (args,)
    # ``tensors`` is the caller's own dict when one dict was given: torch.func writes buffers
    # that the module reassigns back into it, and so does this
    # torch's swap checks keys, values, ties and strict (and puts back what it swapped when
    # one fails); the checks here run only then, to say which key and how to fix it
    # (a module with no tied tensors gets the same swap with tie_weights=False: there is
    # nothing to untie, and torch's search for ties is the slowest part of the swap)
    untie = tie_weights and _has_tied_tensors(module)
    if not untie and not strict:
        slots = _slots_of(module, tensors)
        if slots is not None:
            return _call_with_slots(module, tensors, slots, args, kwargs or {})
    with contextlib.ExitStack() as swapped:
        try:
            swapped.enter_context(_reparametrize_module(
                module, tensors, tie_weights=untie, strict=strict, stack_weights=True))
        except (ValueError, RuntimeError, TypeError, AttributeError, KeyError) as error:
            _check_keys_and_values(module, tensors, call)  # raises where a key or value is bad
            raise _swap_error(error, module, tensors, tie_weights, call) from None
        return module(*args, **(kwargs or {}))


def _slots_of(module, tensors):
    """NOTE [The common swap, written out]
    torch's swap (``_reparametrize_module``) resolves each name through a NamedMemberAccessor,
    checks it, and swaps it with ``swap_tensor``: about 15 us for a small MLP, which an
    ensemble or a MAML step pays on every call. In the common case (every key names an
    existing parameter or buffer, no untying, not strict) it amounts to a dict assignment per
    key into the owner's ``_parameters`` or ``_buffers``, which is what swap_tensor does
    there; ``_call_with_slots`` does just that, with torch's order (put back in reverse, as
    ``stack_weights=True``) and its write-back of what the module left in a slot into the
    caller's dict. Anything else (a key the module does not have, a value that is not a
    tensor, strict, tied weights) takes torch's swap, with its checks and errors.
    Returns the (table, name, key) slots, or None for torch's swap."""
    slots = []
    for key, value in tensors.items():
        if not isinstance(value, torch.Tensor):
            return None
        path, _, name = key.rpartition(".")
        owner = module
        if path:
            for part in path.split("."):
                owner = owner._modules.get(part)
                if owner is None:
                    return None
        if name in owner._parameters:
            slots.append((owner._parameters, name, key))
        elif name in owner._buffers:
            slots.append((owner._buffers, name, key))
        else:
            return None
    return slots


def _call_with_slots(module, tensors, slots, args, kwargs):
    originals = []
    try:
        for table, name, key in slots:
            originals.append((table, name, key, table[name]))
            table[name] = tensors[key]
        return module(*args, **kwargs)
    finally:
        for table, name, key, original in reversed(originals):
            if name in table:  # what the module left there goes back to the caller's dict
                tensors[key] = table[name]
            table[name] = original


def _has_tied_tensors(module) -> bool:
    """NOTE [A module without ties skips torch's untying]
    With ``tie_weights=True`` torch's swap first maps every tensor of the module to all the
    names it has (``_untie_named_tensors_map``: ``named_parameters`` and ``named_buffers``
    with duplicates, then a set of names per tensor), so that a name given for a tied tensor
    replaces it under all its names. For a module in which no tensor has two names, that map
    is the caller's dict copied, and the swap does what it does with ``tie_weights=False``.
    This walk visits the module tree as ``named_parameters(remove_duplicate=False)`` does and
    answers True at the first tensor, or submodule, met twice (torch's own search then
    decides, as it would have). It costs a few microseconds where torch's search costs about
    ten, on every call of an ensemble or a per-sample-gradient step."""
    seen = set()  # ids of the modules and tensors met
    pending = [module]
    while pending:
        current = pending.pop()
        if id(current) in seen:
            return True
        seen.add(id(current))
        for table in (current._parameters, current._buffers):
            for tensor in table.values():
                if tensor is None:
                    continue
                if id(tensor) in seen:
                    return True
                seen.add(id(tensor))
        for child in current._modules.values():
            if child is not None:
                pending.append(child)
    return False


class _Call:
    """How errors name the call (``_describe``), made only when an error is raised: the
    string costs a few microseconds, and functional_call runs once per step of a loop."""
    __slots__ = ("arguments",)

    def __init__(self, *arguments):
        self.arguments = arguments

    def __str__(self):
        return _describe(*self.arguments)

    def __format__(self, spec):
        return format(str(self), spec)


def _swap_error(error, module, tensors, tie_weights, call):
    """torch's swap refuses tied names given different tensors, and (strict) missing or
    unexpected keys: the same words, with the call and the fix."""
    if "which are tied" in str(error):
        groups = _tied_groups(module)
        _check_tied_values(tensors, groups, call)  # raises with the names in the module
    if "Error(s) in reparametrizing" in str(error):
        _check_strict(module, tensors, _tied_groups(module), tie_weights, call)  # raises
    return error


# --- ensembles ---------------------------------------------------------------------------------
def _check_ensemble(models, name):
    """torch.func's checks of a list of models to stack, in its order and wording."""
    call = f"{name}(<{len(models)} models>)"
    if len(models) == 0:
        raise ModuleStateError(
            f"{call}: {name}: Expected at least one model, got 0. Nothing to stack. Fix: pass "
            "a list of models of one class.")
    if not (all(m.training for m in models) or not any(m.training for m in models)):
        in_eval = [i for i, m in enumerate(models) if not m.training]
        raise ModuleStateError(
            f"{call}: {name}: Expected all models to have the same training/eval mode. Models "
            f"{in_eval} are in eval mode, the others in training mode. Fix: call .train() or "
            ".eval() on every model.")
    kinds = [type(m).__name__ for m in models]
    if any(type(m) is not type(models[0]) for m in models):
        raise ModuleStateError(
            f"{call}: {name}: Expected all models to be of the same class. Got {kinds}. Fix: "
            "stack copies of one architecture.")
    return call


def _stack(models, named, call, *, leaves):
    """Stack one kind of tensor (``named``: parameters or buffers) of ``models`` along dim 0.

    ``leaves=True``: torch.func's stack_module_state, where a stacked tensor is a new leaf that
    requires grad if the models' tensors do (all of them or none). ``leaves=False``: functorch's
    combine_state_for_ensemble, where every stacked tensor is detached.
    """
    tables = [dict(named(m)) for m in models]
    names = list(tables[0])
    for index, table in enumerate(tables[1:], start=1):
        if list(table) != names:
            raise ModuleStateError(
                f"{call}: model {index} has the tensors {list(table)}, model 0 has {names}. "
                "Fix: stack models with the same structure.")
    stacked = {}
    # (stacked without torch's autograd: the result is a new leaf either way, and recording
    # the stack only to detach it costs a graph node per tensor)
    with torch.no_grad():
        for name in names:
            tensors = [table[name] for table in tables]
            requires = [t.requires_grad for t in tensors]
            if leaves and any(requires) and not all(requires):
                raise ModuleStateError(
                    f"{call}: Expected {name} from each model to have the same "
                    f".requires_grad. requires_grad is {requires} across the models. Fix: "
                    f"freeze or unfreeze {name!r} in every model.")
            try:
                value = torch.stack(tensors)
            except RuntimeError:
                shapes = [tuple(t.shape) for t in tensors]
                if len(set(shapes)) > 1:  # torch's words, with the name, shapes and fix
                    raise ModuleStateError(
                        f"{call}: stack expects each tensor to be equal size. {name!r} has the "
                        f"shapes {shapes} in the models. Fix: stack models of one "
                        "configuration.") from None
                raise
            stacked[name] = value.requires_grad_() if leaves and all(requires) else value
    return stacked


def stack_module_state(models):
    """Stack the parameters and buffers of ``models`` (one class, one train/eval mode) along a
    new dim 0, for an ensemble under ``vmap``: returns ``(params, buffers)``, two dicts keyed by
    the names of ``named_parameters()`` and ``named_buffers()``.

    >>> import torch
    >>> from minifunctorch.core import functional_call, stack_module_state, vmap
    >>> models = [torch.nn.Linear(3, 2) for _ in range(4)]
    >>> params, buffers = stack_module_state(models)
    >>> params["weight"].shape, params["weight"].requires_grad, params["weight"].is_leaf
    (torch.Size([4, 2, 3]), True, True)
    >>> run = lambda p, b, x: functional_call(models[0], (p, b), (x,))
    >>> vmap(run, in_dims=(0, 0, None))(params, buffers, torch.ones(5, 3)).shape
    torch.Size([4, 5, 2])

    As with torch.func.stack_module_state, the stacked parameters are new leaves, detached from
    the models' own: they require grad where the models' parameters do, so an optimizer can
    train them directly. Models that differ (class, mode, names, shapes, requires_grad) are
    refused.
    """
    models = list(models)
    call = _check_ensemble(models, "stack_module_state")
    return (_stack(models, lambda m: m.named_parameters(), call, leaves=True),
            _stack(models, lambda m: m.named_buffers(), call, leaves=True))


# --- batch norm --------------------------------------------------------------------------------
def replace_all_batch_norm_modules_(root):
    """Make every batch norm in ``root`` stop tracking running statistics, in place; returns
    ``root``.

    A batch norm in training mode updates ``running_mean`` and ``running_var`` in place. Under
    ``vmap`` the update is batched (one statistic per example, or per model) while the buffer
    is not, and there is no single tensor to write it into. torch.func's answer, followed here:
    drop the running statistics (``running_mean = running_var = num_batches_tracked = None``,
    ``track_running_stats = False``), so batch norm always normalizes with the batch's own
    statistics.

    >>> import torch
    >>> from minifunctorch.core import replace_all_batch_norm_modules_
    >>> net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    >>> net = replace_all_batch_norm_modules_(net)
    >>> net[1].running_mean is None, net[1].track_running_stats, dict(net.named_buffers())
    (True, False, {})
    """
    for module in root.modules():  # root.modules() starts with root itself
        if isinstance(module, torch.nn.modules.batchnorm._BatchNorm) and \
                module.track_running_stats:
            module.running_mean = None
            module.running_var = None
            module.num_batches_tracked = None
            module.track_running_stats = False
    return root
