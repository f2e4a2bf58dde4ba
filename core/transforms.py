"""The torch.func-style API: grad, vjp, jvp, vmap and their compositions.

Each transform pushes one level (``transform_scope``), makes its inputs values of that
level, shows them to the function as FuncTensors (tensor.py), runs the function with
``user_code`` on, and takes the values back out of its outputs. What a transform returns is
a plain tensor, or a FuncTensor where the result is a value of an enclosing transform.
``jacrev``, ``jacfwd`` and ``hessian`` are compositions of these, not engines of their own:

    jacrev(f)  = vmap(vjp_fn) over the rows of an identity
    jacfwd(f)  = vmap(jvp)    over the columns of an identity
    hessian(f) = jacfwd(jacrev(f))
"""
import functools
import math

import optree
import torch

from . import ops
from .autograd import Autograd, AutogradValue
from .batching import Batched, BatchedValue, move_bdim
from .dispatch import new_level, transform_scope
from .errors import NonScalarOutputError, TransformUsageError
from .forward import Forward, ForwardValue
from .tensor import (
    FuncTensor,
    as_tensor,
    as_tensors,
    engine_code,
    unwrap,
    unwrap_tree,
    user_code,
    value_of,
)
from .values import Value


# --- call descriptions for error messages -----------------------------------------------------
def _function_name(f) -> str:
    return getattr(f, "__name__", None) or type(f).__name__


def describe_call(transform: str, f, **options) -> str:
    """``vmap(f, in_dims=(0,))(<inputs>)``: how an error message names the call."""
    shown = "".join(f", {key}={value!r}" for key, value in options.items())
    return f"{transform}({_function_name(f)}{shown})(<inputs>)"


def _is_array(value) -> bool:
    return isinstance(value, (torch.Tensor, Value))


def _normalize_argnums(argnums, num_args, call):
    as_tuple = (argnums,) if isinstance(argnums, int) else argnums
    if not isinstance(as_tuple, tuple) or not as_tuple or not all(
            isinstance(a, int) for a in as_tuple):
        raise TransformUsageError(
            f"{call}: expected argnums to be an int or a non-empty tuple of ints, got "
            f"{argnums!r}. Fix: pass argnums=0 or argnums=(0, 1)."
        )
    normalized = []
    for a in as_tuple:
        if not -num_args <= a < num_args:
            raise TransformUsageError(
                f"{call}: argnums={argnums!r} is out of range: the function got {num_args} "
                f"positional argument(s). Fix: use argnums between {-num_args} and "
                f"{num_args - 1}."
            )
        normalized.append(a % num_args)
    if len(set(normalized)) != len(normalized):
        raise TransformUsageError(f"{call}: argnums={argnums!r} names an argument twice.")
    return tuple(normalized)


def _flatten_arrays(tree, call, what):
    """The leaves of ``tree`` as engine values (FuncTensors unwrapped), checked to be tensors."""
    leaves, treedef = optree.tree_flatten(tree)
    leaves = [unwrap(leaf) for leaf in leaves]
    for leaf in leaves:
        if not _is_array(leaf):
            raise TransformUsageError(
                f"{call}: expected {what} to contain only tensors, got a leaf of type "
                f"{type(leaf).__name__}. Fix: pass tensors, or move non-tensor values out of "
                "the differentiated arguments (e.g. with functools.partial)."
            )
    return leaves, treedef


def _lower_tree(tree, level):
    """Aux outputs for the caller: values of ``level`` replaced by their payloads."""
    def lower(leaf):
        leaf = unwrap(leaf)
        if isinstance(leaf, Value) and leaf.dispatcher is level:
            leaf = level.lower(leaf)
        return as_tensor(leaf)
    return optree.tree_map(lower, tree)


def _split_aux(out, has_aux, call):
    if not has_aux:
        return out, None
    if not (isinstance(out, (tuple, list)) and len(out) == 2):
        raise TransformUsageError(
            f"{call}: with has_aux=True the function must return a pair (output, aux), got "
            f"{type(out).__name__}. Fix: return (output, aux), or drop has_aux."
        )
    return out[0], out[1]


def _write_back(shown, originals, lower):
    """NOTE [In-place writes to a transform's inputs]
    torch.func's inputs are the caller's own tensors, so ``x.add_(1)`` inside ``grad(f)(x)``
    also changes the caller's ``x``. Here ``f`` sees FuncTensors, and a write swaps a new
    value into one of them (tensor.py, ``_write``). After ``f`` returns, each input that was
    written is copied into the caller's tensor, one level down (``lower``)."""
    for tensor, original in zip(shown, originals):
        if type(tensor) is FuncTensor and tensor._generation:
            with torch.no_grad():
                original.copy_(as_tensor(lower(value_of(tensor))))


# --- reverse mode ------------------------------------------------------------------------------
def _wrap_for_autograd(level, leaves):
    wrapped, used = [], set()
    for leaf in leaves:
        label = leaf.name if isinstance(leaf, Value) else getattr(leaf, "t_name", None)
        name = label if label is not None and label not in used else None
        value = level.wrap_input(leaf, name)
        used.add(value.name)
        wrapped.append(value)
    return wrapped


def _run_reverse(f, args, kwargs, argnums, call):
    """Run ``f`` on an Autograd level with the arguments ``argnums`` as inputs.

    Returns (level, out, selected input leaves, their wrapped values, one treedef each).
    """
    argnums = _normalize_argnums(argnums, len(args), call)
    level = new_level(Autograd, name="Autograd", record_steps=False, call=call)
    args = list(args)
    inputs = []
    shown, originals = [], []
    with transform_scope(level):
        for argnum in argnums:
            originals += optree.tree_leaves(args[argnum])
            leaves, treedef = _flatten_arrays(args[argnum], call, f"argument {argnum}")
            wrapped = _wrap_for_autograd(level, leaves)
            inputs.append((leaves, wrapped, treedef))
            tensors = [as_tensor(w) for w in wrapped]
            shown += tensors
            args[argnum] = optree.tree_unflatten(treedef, tensors)
        with user_code():
            out = f(*args, **kwargs)
    _write_back(shown, originals, level.lower_own)
    return level, unwrap_tree(out), argnums, inputs


def _gradients(level, seeds, inputs):
    """Backward pass from ``seeds``; one gradient pytree (of values) per selected argument."""
    gradients = level.tape.backward(seeds, record_steps=level.record_steps) if seeds else {}
    result = []
    for leaves, wrapped, treedef in inputs:
        grads = []
        for leaf, value in zip(leaves, wrapped):
            g = gradients.get(value.name)
            grads.append(ops.zeros_like(leaf) if g is None else g)
        result.append(optree.tree_unflatten(treedef, grads))
    return result


def grad_and_value(f, argnums=0, has_aux=False):
    """Like :func:`grad`, but also returns the value: ``(gradients, value)``.

    >>> import torch
    >>> from minifunctorch.core import grad_and_value
    >>> g, value = grad_and_value(lambda x: (x ** 2).sum())(torch.tensor([1.0, 2.0]))
    >>> g, value
    (tensor([2., 4.]), tensor(5.))
    """
    @functools.wraps(f)
    def grad_and_value_f(*args, **kwargs):
        with engine_code():
            return _grad_and_value(f, argnums, has_aux, args, kwargs)
    return grad_and_value_f


def _grad_and_value(f, argnums, has_aux, args, kwargs):
    call = describe_call("grad", f, argnums=argnums) if argnums != 0 else describe_call("grad", f)
    level, out, argnums_, inputs = _run_reverse(f, args, kwargs, argnums, call)
    out, aux = _split_aux(out, has_aux, call)
    if not _is_array(out) or tuple(out.shape) != ():
        got = f"shape {tuple(out.shape)}" if _is_array(out) else type(out).__name__
        raise NonScalarOutputError(
            f"{call}: expected the function to return a scalar tensor (shape ()), got "
            f"{got}. Fix: reduce the output (e.g. .sum()), or use jacrev / %%jacobian for "
            "the Jacobian of a non-scalar output."
        )
    if isinstance(out, AutogradValue) and out.dispatcher is level:
        grads = _gradients(level, {out.name: ops.ones_like(out.payload)}, inputs)
        value = out.payload
    else:  # the output does not depend on the inputs
        grads = _gradients(level, {}, inputs)
        value = out
    if not level.record_steps:
        # Nobody will look at this tape again. Its entries and the values they hold refer
        # to the level, and the level to its tape: dropping the entries breaks that cycle,
        # so saved tensors are freed now rather than by a later garbage collection.
        level.tape.entries.clear()
    grads = as_tensors(grads[0] if isinstance(argnums, int) else tuple(grads))
    if has_aux:
        return grads, (as_tensor(value), _lower_tree(aux, level))
    return grads, as_tensor(value)


def grad(f, argnums=0, has_aux=False):
    """The gradient of a scalar-valued function, with torch.func's signature.

    >>> import torch
    >>> from minifunctorch.core import grad
    >>> grad(torch.sin)(torch.tensor(0.0))
    tensor(1.)
    >>> grad(grad(torch.sin))(torch.tensor(0.0))  # -sin(0)
    tensor(-0.)
    """
    gv = grad_and_value(f, argnums, has_aux)

    @functools.wraps(f)
    def grad_f(*args, **kwargs):
        grads, value = gv(*args, **kwargs)
        if has_aux:
            return grads, value[1]
        return grads
    return grad_f


def vjp(f, *primals, has_aux=False):
    """Run ``f`` and return ``(output, vjp_fn)``; ``vjp_fn(cotangents)`` pulls cotangents
    back to one per primal.

    >>> import torch
    >>> from minifunctorch.core import vjp
    >>> out, vjp_fn = vjp(torch.sin, torch.tensor([0.0, 1.0]))
    >>> vjp_fn(torch.ones(2))
    (tensor([1.0000, 0.5403]),)
    """
    with engine_code():
        return _vjp(f, primals, has_aux)


def _vjp(f, primals, has_aux):
    call = describe_call("vjp", f)
    level, out, _, inputs = _run_reverse(f, primals, {}, tuple(range(len(primals))), call)
    out, aux = _split_aux(out, has_aux, call)
    out_leaves, out_treedef = optree.tree_flatten(out)
    for leaf in out_leaves:
        if not _is_array(leaf):
            raise TransformUsageError(
                f"{call}: expected the function to return tensors, got a leaf of type "
                f"{type(leaf).__name__}. Fix: return tensors (or use has_aux=True for the rest)."
            )
    own = [isinstance(o, AutogradValue) and o.dispatcher is level for o in out_leaves]
    primal_out = optree.tree_unflatten(
        out_treedef, [as_tensor(o.payload if is_own else o) for o, is_own in zip(out_leaves, own)])

    def vjp_fn(cotangents):
        with engine_code():
            return _pull_back(cotangents)

    def _pull_back(cotangents):
        ct_leaves, ct_treedef = optree.tree_flatten(cotangents)
        ct_leaves = [unwrap(ct) for ct in ct_leaves]
        if ct_treedef != out_treedef:
            raise TransformUsageError(
                f"vjp_fn(cotangents): expected cotangents with the structure of the output "
                f"({out_treedef}), got {ct_treedef}. Fix: pass one cotangent per output."
            )
        seeds = {}
        for o, is_own, ct in zip(out_leaves, own, ct_leaves):
            if tuple(ct.shape) != tuple(o.shape):
                raise TransformUsageError(
                    f"vjp_fn(cotangents): expected a cotangent of shape {tuple(o.shape)}, got "
                    f"{tuple(ct.shape)}. Fix: give each cotangent its output's shape."
                )
            if is_own:
                seeds[o.name] = ct if o.name not in seeds else ops.add(seeds[o.name], ct)
        return as_tensors(tuple(_gradients(level, seeds, inputs)))

    if has_aux:
        return primal_out, vjp_fn, _lower_tree(aux, level)
    return primal_out, vjp_fn


# --- forward mode ------------------------------------------------------------------------------
def jvp(f, primals, tangents, has_aux=False):
    """Forward mode: ``(f(*primals), J @ tangents)``, with torch.func's signature.

    >>> import torch
    >>> from minifunctorch.core import jvp
    >>> jvp(torch.sin, (torch.tensor(0.0),), (torch.tensor(2.0),))
    (tensor(0.), tensor(2.))
    """
    with engine_code():
        return _jvp(f, primals, tangents, has_aux)


def _jvp(f, primals, tangents, has_aux):
    call = describe_call("jvp", f)
    if not isinstance(primals, tuple) or not isinstance(tangents, tuple):
        raise TransformUsageError(
            f"{call}: expected primals and tangents to be tuples, got "
            f"{type(primals).__name__} and {type(tangents).__name__}. Fix: jvp(f, (x,), (t,))."
        )
    p_leaves, p_treedef = _flatten_arrays(primals, call, "primals")
    t_leaves, t_treedef = _flatten_arrays(tangents, call, "tangents")
    if p_treedef != t_treedef:
        raise TransformUsageError(
            f"{call}: expected tangents with the structure of primals ({p_treedef}), got "
            f"{t_treedef}. Fix: give one tangent per primal."
        )
    for p, t in zip(p_leaves, t_leaves):
        if tuple(p.shape) != tuple(t.shape):
            raise TransformUsageError(
                f"{call}: expected each tangent to have its primal's shape, got a tangent of "
                f"shape {tuple(t.shape)} for a primal of shape {tuple(p.shape)}. Fix: give each "
                "tangent its primal's shape."
            )
    level = new_level(Forward, call=call)
    with transform_scope(level):
        wrapped = [as_tensor(level.wrap_input(p, t)) for p, t in zip(p_leaves, t_leaves)]
        with user_code():
            out = f(*optree.tree_unflatten(p_treedef, wrapped))
    _write_back(wrapped, optree.tree_leaves(primals), level.lower_own)
    out, aux = _split_aux(unwrap_tree(out), has_aux, call)
    out_leaves, out_treedef = optree.tree_flatten(out)
    primal_out, tangent_out = [], []
    for o in out_leaves:
        if isinstance(o, ForwardValue) and o.dispatcher is level:
            primal_out.append(o.payload)
            tangent_out.append(o.tangent)
        else:
            primal_out.append(o)
            tangent_out.append(ops.zeros_like(o) if _is_array(o) else None)
    result = (optree.tree_unflatten(out_treedef, as_tensors(primal_out)),
              optree.tree_unflatten(out_treedef, as_tensors(tangent_out)))
    if has_aux:
        return (*result, _lower_tree(aux, level))
    return result


def linearize(f, *primals):
    """Returns ``(f(*primals), jvp_fn)``, where ``jvp_fn(*tangents)`` is the JVP at primals.

    >>> import torch
    >>> from minifunctorch.core import linearize
    >>> out, jvp_fn = linearize(torch.sin, torch.tensor(0.0))
    >>> jvp_fn(torch.tensor(3.0))
    tensor(3.)

    The output is computed once; each call of ``jvp_fn`` runs forward mode again at the
    same primals (torch.func traces the function instead).
    """
    out = f(*primals)

    def jvp_fn(*tangents):
        return jvp(f, primals, tangents)[1]
    return out, jvp_fn


# --- vectorization -----------------------------------------------------------------------------
def _broadcast_dims(dims, tree, call, what):
    """Spread ``dims`` (an int/None, or a prefix of ``tree``) over the leaves of ``tree``."""
    try:
        return optree.tree_flatten(optree.tree_broadcast_prefix(dims, tree, none_is_leaf=True),
                                   none_is_leaf=True)[0]
    except (ValueError, TypeError) as error:
        where = "input" if what == "in_dims" else "output"
        raise TransformUsageError(
            f"{call}: {what} is not compatible with the structure of {where}s: "
            f"{str(error).rstrip('.')}. Fix: give one dim per {where} (a tuple as long as the "
            f"{where}s, or a matching pytree prefix), or a single int or None for all."
        ) from None


def vmap(f, in_dims=0, out_dims=0, randomness="error", *, chunk_size=None):
    """Vectorize ``f`` over a batch dimension of its inputs, with torch.func's signature.

    >>> import torch
    >>> from minifunctorch.core import vmap
    >>> vmap(torch.dot)(torch.ones(3, 2), torch.ones(3, 2))
    tensor([2., 2., 2.])
    >>> vmap(torch.mul, in_dims=(0, None))(torch.arange(3.0), torch.tensor(10.0))
    tensor([ 0., 10., 20.])
    """
    _check_randomness("vmap", randomness)
    if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size < 1):
        raise TransformUsageError(
            f"vmap(..., chunk_size={chunk_size!r}): expected a positive int or None."
        )

    @functools.wraps(f)
    def vmapped(*args, **kwargs):
        with engine_code():
            return as_tensors(_vmap(f, in_dims, out_dims, randomness, chunk_size, args, kwargs))
    return vmapped


def chunk_vmap(f, in_dims=0, out_dims=0, randomness="error", chunks=2):
    """functorch.experimental's ``chunk_vmap``: ``vmap`` run in ``chunks`` pieces of the batch
    (fewer if the batch is smaller), to bound the memory of one call. It is ``vmap`` with a
    chunk size of ``ceil(batch / chunks)``; with ``randomness='same'`` every piece makes the
    same draw.

    >>> import torch
    >>> from minifunctorch.core import chunk_vmap
    >>> chunk_vmap(torch.sum, chunks=2)(torch.ones(5, 3))
    tensor([3., 3., 3., 3., 3.])
    """
    _check_randomness("chunk_vmap", randomness)
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise TransformUsageError(
            f"chunk_vmap(..., chunks={chunks!r}): expected a positive int, the number of "
            "pieces the batch is split into."
        )

    @functools.wraps(f)
    def vmapped(*args, **kwargs):
        with engine_code():
            return as_tensors(_vmap(f, in_dims, out_dims, randomness, None, args, kwargs,
                                    chunks=chunks))
    return vmapped


def _check_randomness(transform, randomness):
    if randomness not in ("error", "same", "different"):
        raise TransformUsageError(
            f"{transform}(..., randomness={randomness!r}): expected 'error', 'same' or "
            "'different'."
        )


def _vmap(f, in_dims, out_dims, randomness, chunk_size, args, kwargs, *, chunks=None):
    options = {} if in_dims == 0 else {"in_dims": in_dims}
    call = describe_call("vmap", f, **options)
    if isinstance(in_dims, (tuple, list)) and len(in_dims) != len(args):
        raise TransformUsageError(
            f"{call}: in_dims is not compatible with the structure of inputs: in_dims has "
            f"{len(in_dims)} entries but the function got {len(args)} positional "
            "arguments. Fix: give one in_dim per argument."
        )
    dims = in_dims if not isinstance(in_dims, list) else tuple(in_dims)
    prefix = dims if isinstance(dims, tuple) else (dims,) * len(args)
    originals, arg_treedef = optree.tree_flatten(args, none_is_leaf=True)
    arg_leaves = [unwrap(leaf) for leaf in originals]
    dim_leaves = _broadcast_dims(tuple(prefix), args, call, "in_dims")
    size = _batch_size(arg_leaves, dim_leaves, call)
    if chunks is not None:  # chunk_vmap
        chunk_size = max(-(-size // chunks), 1)
    if chunk_size is None or chunk_size >= size:
        return _vmap_call(f, arg_leaves, arg_treedef, dim_leaves, size, kwargs, out_dims,
                          randomness, call, originals)
    outputs = []
    # randomness='same' replays the generator at each chunk, so that every chunk shares the
    # first one's draw (randomness.py, NOTE [Randomness under vmap])
    state = torch.get_rng_state() if randomness == "same" else None
    for start in range(0, size, chunk_size):
        stop = min(start + chunk_size, size)
        if state is not None:
            torch.set_rng_state(state)
        # d may be negative (in_dims=-1): count the leading full slices from the front
        chunk = [leaf if d is None else
                 ops.getitem(leaf, (slice(None),) * (d % leaf.dim()) + (slice(start, stop),))
                 for leaf, d in zip(arg_leaves, dim_leaves)]
        chunk_originals = [leaf if d is None else
                           leaf[(slice(None),) * (d % leaf.dim()) + (slice(start, stop),)]
                           for leaf, d in zip(originals, dim_leaves)]
        outputs.append(_vmap_call(f, chunk, arg_treedef, dim_leaves, stop - start, kwargs,
                                  out_dims, randomness, call, chunk_originals))
    return _concatenate_chunks(outputs, out_dims, call)


def _batch_size(arg_leaves, dim_leaves, call):
    sizes = {}
    for position, (leaf, dim) in enumerate(zip(arg_leaves, dim_leaves)):
        if dim is None:
            continue
        if not isinstance(dim, int):
            raise TransformUsageError(
                f"{call}: expected each in_dim to be an int or None, got {dim!r}."
            )
        if not _is_array(leaf):
            raise TransformUsageError(
                f"{call}: got in_dim={dim} for an input of type {type(leaf).__name__}; only "
                "tensors can be batched. Fix: use in_dim=None for that input."
            )
        rank = len(leaf.shape)
        if not -rank <= dim < rank:
            raise TransformUsageError(
                f"{call}: in_dim={dim} is out of range for an input of shape "
                f"{tuple(leaf.shape)}. Fix: use a dim in [{-rank}, {rank - 1}]."
            )
        sizes.setdefault(leaf.shape[dim], []).append(position)
    if not sizes:
        raise TransformUsageError(
            f"{call}: at least one input must be batched, but in_dims is None for every input. "
            "Fix: give the batched input an int in_dim."
        )
    if len(sizes) > 1:
        detail = ", ".join(f"size {s} for input(s) {p}" for s, p in sizes.items())
        raise TransformUsageError(
            f"{call}: expected all batched inputs to have the same batch size, got {detail}. "
            "Fix: make the batch dims equal, or use in_dims=None for inputs that are shared."
        )
    return next(iter(sizes))


def _vmap_call(f, arg_leaves, arg_treedef, dim_leaves, size, kwargs, out_dims, randomness,
               call, originals):
    level = new_level(Batched, length=size, call=call, randomness=randomness)
    with transform_scope(level):
        wrapped = [as_tensor(leaf if d is None else level.wrap_input(leaf, d % len(leaf.shape)))
                   for leaf, d in zip(arg_leaves, dim_leaves)]
        with user_code():
            out = f(*optree.tree_unflatten(arg_treedef, wrapped), **kwargs)
    for tensor, original, d in zip(wrapped, originals, dim_leaves):
        if d is not None:
            _write_back([tensor], [original], lambda v, d=d: level.lower_to_dim(v, d))
    result = _unbatch_outputs(level, unwrap_tree(out), out_dims, size, call)
    written = {id(t): (original, d) for t, original, d in zip(wrapped, originals, dim_leaves)
               if d is not None and type(t) is FuncTensor and t._generation}
    return _alias_written_inputs(out, result, written, out_dims) if written else result


def _alias_written_inputs(out, result, written, out_dims):
    """NOTE [An input written in place and returned is the caller's tensor]
    ``vmap(Tensor.sin_)(x)`` writes ``x`` (NOTE [In-place writes to a transform's inputs]) and
    returns it: in torch.func the result *is* ``x`` (or, with another out_dim, a view of it
    with the batch dim moved), so a later write to ``x`` shows in the result. The same here:
    an output that is an input the function wrote in place becomes the caller's tensor."""
    out_dims = _single_out_dim(out, out_dims)
    if not isinstance(out_dims, int):
        return result  # (per-output out_dims: the result keeps its own copy)
    out_leaves = optree.tree_leaves(out, none_is_leaf=False)
    result_leaves, treedef = optree.tree_flatten(result, none_is_leaf=False)
    for position, leaf in enumerate(out_leaves):
        alias = written.get(id(leaf))
        if alias is not None:
            original, in_dim = alias
            rank = original.dim()
            in_dim, out_dim = in_dim % rank, out_dims % rank
            result_leaves[position] = original if in_dim == out_dim else \
                original.movedim(in_dim, out_dim)
    return optree.tree_unflatten(treedef, result_leaves)


def _single_out_dim(out, out_dims):
    """``out_dims=(1,)`` for a function that returns one tensor means ``out_dims=1``, as in
    torch.func."""
    if isinstance(out_dims, tuple) and len(out_dims) == 1 and not isinstance(out, (tuple, list)):
        return out_dims[0]
    return out_dims


def _unbatch_outputs(level, out, out_dims, size, call):
    out_dims = _single_out_dim(out, out_dims)
    out_leaves, out_treedef = optree.tree_flatten(out, none_is_leaf=False)
    dims = _broadcast_dims(out_dims, out, call, "out_dims") if not isinstance(out_dims, int) \
        else [out_dims] * len(out_leaves)
    result = []
    for leaf, dim in zip(out_leaves, dims):
        batched = isinstance(leaf, BatchedValue) and leaf.dispatcher is level
        if dim is None:
            if batched:
                raise TransformUsageError(
                    f"{call}: out_dims is None for an output that varies over the batch. Fix: "
                    "give it an int out_dim."
                )
            result.append(leaf)
            continue
        if not _is_array(leaf):
            raise TransformUsageError(
                f"{call}: expected the function to return tensors, got {type(leaf).__name__}. "
                "Fix: return tensors, or use out_dims=None for that output."
            )
        rank = len(leaf.shape) + 1
        if not -rank <= dim < rank:
            raise TransformUsageError(f"{call}: out_dim={dim} is out of range for an output "
                                      f"with {rank} dims (batch included).")
        dim %= rank
        if batched:
            result.append(move_bdim(leaf.payload, leaf.bdim, dim))
        else:  # the same for every example: broadcast it along a new batch dim
            shape = list(leaf.shape)
            shape.insert(dim, size)
            result.append(ops.expand(ops.unsqueeze(leaf, dim), *shape))
    return optree.tree_unflatten(out_treedef, result)


def _concatenate_chunks(outputs, out_dims, call):
    out_dims = _single_out_dim(outputs[0], out_dims)
    leaves_per_chunk = [optree.tree_flatten(o)[0] for o in outputs]
    treedef = optree.tree_structure(outputs[0])
    dims = _broadcast_dims(out_dims, outputs[0], call, "out_dims") if not isinstance(out_dims, int) \
        else [out_dims] * len(leaves_per_chunk[0])
    merged = []
    for position, dim in enumerate(dims):
        pieces = [leaves[position] for leaves in leaves_per_chunk]
        merged.append(pieces[0] if dim is None else ops.cat(pieces, dim))
    return optree.tree_unflatten(treedef, merged)


# --- Jacobians and Hessians: compositions ------------------------------------------------------
# NOTE [Compositions call the inner transforms' bodies]
# jacrev is vmap of a vjp function and jacfwd vmap of jvp, and they say so in code. They call
# the bodies (_vjp, _vmap, _jvp) rather than the public functions: those would build a
# functools.wraps wrapper and check their arguments again on every call, which is a tenth of
# the time of a small Jacobian.
def _with_selected(f, args, argnums):
    """``f`` as a function of the arguments ``argnums`` only, the others held fixed."""
    if len(argnums) == len(args):
        return f

    def f_of_selected(*selected):
        full = list(args)
        for argnum, value in zip(argnums, selected):
            full[argnum] = value
        return f(*full)
    f_of_selected.__name__ = _function_name(f)  # errors name the user's function
    return f_of_selected


def _identity_basis(leaves):
    """The rows of an identity matrix, split into one block per leaf and shaped like it.

    Returns ``(basis, sizes)``: ``basis[i]`` has shape ``(total, *leaves[i].shape)``. Row k
    is the k-th unit vector of all the leaves flattened and concatenated.
    """
    sizes = [math.prod(leaf.shape) for leaf in leaves]
    total = sum(sizes)
    rows = torch.eye(total, dtype=leaves[0].dtype, device=leaves[0].device)
    basis, start = [], 0
    for leaf, size in zip(leaves, sizes):
        basis.append(rows[:, start:start + size].reshape((total, *leaf.shape)))
        start += size
    return basis, sizes


def jacrev(f, argnums=0, *, has_aux=False, chunk_size=None):
    """The Jacobian by reverse mode: ``vmap`` of the vjp function over identity rows.

    >>> import torch
    >>> from minifunctorch.core import jacrev
    >>> jacrev(torch.sin)(torch.zeros(2))
    tensor([[1., 0.],
            [0., 1.]])
    """
    @functools.wraps(f)
    def jacrev_f(*args):
        with engine_code():
            return _jacrev(f, argnums, has_aux, chunk_size, args)
    return jacrev_f


def _jacrev(f, argnums, has_aux, chunk_size, args):
    call = describe_call("jacrev", f)
    argnums_ = _normalize_argnums(argnums, len(args), call)
    selected = [args[a] for a in argnums_]
    result = _vjp(_with_selected(f, args, argnums_), selected, has_aux)
    out, vjp_fn = result[0], result[1]
    out_leaves, out_treedef = optree.tree_flatten(out)
    basis, sizes = _identity_basis(out_leaves)

    def pull_back(*basis_leaves):
        return vjp_fn(optree.tree_unflatten(out_treedef, list(basis_leaves)))
    pull_back.__name__ = f"vjp_fn of {_function_name(f)}"

    # vmap(pull_back, chunk_size=chunk_size)(*basis): (total, *in_shape) leaves
    per_input = as_tensors(_vmap(pull_back, 0, 0, "error", chunk_size, tuple(basis), {}))
    jacobians = []
    for o_index, (o, n) in enumerate(zip(out_leaves, sizes)):
        offset = sum(sizes[:o_index])

        def block(g, o=o, n=n, offset=offset):
            return g[offset:offset + n].reshape((*o.shape, *g.shape[1:]))
        per_arg = tuple(optree.tree_map(block, tree) for tree in per_input)
        jacobians.append(per_arg[0] if isinstance(argnums, int) else per_arg)
    jacobian = optree.tree_unflatten(out_treedef, jacobians)
    if has_aux:
        return jacobian, result[2]
    return jacobian


def jacfwd(f, argnums=0, has_aux=False, *, randomness="error"):
    """The Jacobian by forward mode: ``vmap`` of ``jvp`` over identity columns.

    >>> import torch
    >>> from minifunctorch.core import jacfwd
    >>> jacfwd(lambda x: x ** 2)(torch.tensor([1.0, 2.0]))
    tensor([[2., 0.],
            [0., 4.]])
    """
    _check_randomness("jacfwd", randomness)

    @functools.wraps(f)
    def jacfwd_f(*args):
        with engine_code():
            return _jacfwd(f, argnums, has_aux, randomness, args)
    return jacfwd_f


def _jacfwd(f, argnums, has_aux, randomness, args):
    call = describe_call("jacfwd", f)
    argnums_ = _normalize_argnums(argnums, len(args), call)
    selected = tuple(args[a] for a in argnums_)
    in_leaves, in_treedef = _flatten_arrays(selected, call, "the differentiated arguments")
    basis, sizes = _identity_basis(in_leaves)
    f_selected = _with_selected(f, args, argnums_)

    def push_forward(*basis_leaves):
        tangents = optree.tree_unflatten(in_treedef, list(basis_leaves))
        result = _jvp(f_selected, selected, tangents, has_aux)
        return (result[1], result[2]) if has_aux else result[1]
    push_forward.__name__ = f"jvp of {_function_name(f)}"

    out_dims = (-1, 0) if has_aux else -1
    # vmap(push_forward, out_dims=out_dims, randomness=randomness)(*basis)
    pushed = as_tensors(_vmap(push_forward, 0, out_dims, randomness, None, tuple(basis), {}))
    tangents_out, aux = pushed if has_aux else (pushed, None)

    def split(t):  # t: (*out_shape, total) -> per input leaf (*out_shape, *in_shape)
        out_shape = tuple(t.shape[:-1])
        blocks, begin = [], 0
        for x, n in zip(in_leaves, sizes):
            blocks.append(t[..., begin:begin + n].reshape((*out_shape, *x.shape)))
            begin += n
        per_arg = optree.tree_unflatten(in_treedef, blocks)
        return per_arg[0] if isinstance(argnums, int) else per_arg
    jacobian = optree.tree_map(split, tangents_out)
    if has_aux:
        return jacobian, optree.tree_map(lambda a: a[0], aux)
    return jacobian


def hessian(f, argnums=0):
    """The Hessian: forward-over-reverse, ``jacfwd(jacrev(f))``.

    >>> import torch
    >>> from minifunctorch.core import hessian
    >>> hessian(lambda x: (x ** 3).sum())(torch.tensor([1.0, 2.0]))
    tensor([[ 6.,  0.],
            [ 0., 12.]])
    """
    return jacfwd(jacrev(f, argnums), argnums)

