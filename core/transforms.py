"""The torch.func-style API: grad, vjp, jvp, vmap and their compositions.

Each transform pushes one level (``transform_scope``), wraps its inputs as values of that
level, runs the function, and unwraps the outputs. ``jacrev``, ``jacfwd`` and ``hessian`` are
compositions of these, not engines of their own:

    jacrev(f)  = vmap(vjp_fn) over the rows of an identity
    jacfwd(f)  = vmap(jvp)    over the columns of an identity
    hessian(f) = jacfwd(jacrev(f))
"""
import functools
import math

import optree
import torch

from . import ops
from .autograd import Autograd, AutogradTensor
from .batching import Batched, BatchedTensor, move_bdim
from .dispatch import FuncTensor, new_level, transform_scope
from .errors import NonScalarOutputError, TransformUsageError
from .forward import Forward, ForwardTensor
from .randomness import random_guard


# --- call descriptions for error messages -----------------------------------------------------
def _function_name(f) -> str:
    return getattr(f, "__name__", None) or type(f).__name__


def describe_call(transform: str, f, **options) -> str:
    """``vmap(f, in_dims=(0,))(<inputs>)``: how an error message names the call."""
    shown = "".join(f", {key}={value!r}" for key, value in options.items())
    return f"{transform}({_function_name(f)}{shown})(<inputs>)"


def _is_array(value) -> bool:
    return isinstance(value, (torch.Tensor, FuncTensor))


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
    leaves, treedef = optree.tree_flatten(tree)
    for leaf in leaves:
        if not _is_array(leaf):
            raise TransformUsageError(
                f"{call}: expected {what} to contain only tensors, got a leaf of type "
                f"{type(leaf).__name__}. Fix: pass tensors, or move non-tensor values out of "
                "the differentiated arguments (e.g. with functools.partial)."
            )
    return leaves, treedef


def _lower_tree(tree, level):
    """Replace values of ``level`` by their payloads (used for aux outputs)."""
    def lower(leaf):
        if isinstance(leaf, FuncTensor) and leaf.dispatcher is level:
            return level.lower(leaf)
        return leaf
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


# --- reverse mode ------------------------------------------------------------------------------
def _wrap_for_autograd(level, leaves):
    wrapped, used = [], set()
    for leaf in leaves:
        label = leaf.name if isinstance(leaf, FuncTensor) else getattr(leaf, "t_name", None)
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
    level = new_level(Autograd, name="Autograd", record_steps=False)
    args = list(args)
    inputs = []
    with transform_scope(level):
        for argnum in argnums:
            leaves, treedef = _flatten_arrays(args[argnum], call, f"argument {argnum}")
            wrapped = _wrap_for_autograd(level, leaves)
            inputs.append((leaves, wrapped, treedef))
            args[argnum] = optree.tree_unflatten(treedef, wrapped)
        out = f(*args, **kwargs)
    return level, out, argnums, inputs


def _gradients(level, seeds, inputs):
    """Backward pass from ``seeds``; one gradient pytree per selected argument."""
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
        if isinstance(out, AutogradTensor) and out.dispatcher is level:
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
        grads = grads[0] if isinstance(argnums, int) else tuple(grads)
        if has_aux:
            return grads, (value, _lower_tree(aux, level))
        return grads, value
    return grad_and_value_f


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
    own = [isinstance(o, AutogradTensor) and o.dispatcher is level for o in out_leaves]
    primal_out = optree.tree_unflatten(
        out_treedef, [o.payload if is_own else o for o, is_own in zip(out_leaves, own)])

    def vjp_fn(cotangents):
        ct_leaves, ct_treedef = optree.tree_flatten(cotangents)
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
        return tuple(_gradients(level, seeds, inputs))

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
    level = new_level(Forward)
    with transform_scope(level):
        wrapped = [level.wrap_input(p, t) for p, t in zip(p_leaves, t_leaves)]
        out = f(*optree.tree_unflatten(p_treedef, wrapped))
    out, aux = _split_aux(out, has_aux, call)
    out_leaves, out_treedef = optree.tree_flatten(out)
    primal_out, tangent_out = [], []
    for o in out_leaves:
        if isinstance(o, ForwardTensor) and o.dispatcher is level:
            primal_out.append(o.payload)
            tangent_out.append(o.tangent)
        else:
            primal_out.append(o)
            tangent_out.append(ops.zeros_like(o) if _is_array(o) else None)
    result = (optree.tree_unflatten(out_treedef, primal_out),
              optree.tree_unflatten(out_treedef, tangent_out))
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
    if randomness not in ("error", "same", "different"):
        raise TransformUsageError(
            f"vmap(..., randomness={randomness!r}): expected 'error', 'same' or 'different'."
        )
    if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size < 1):
        raise TransformUsageError(
            f"vmap(..., chunk_size={chunk_size!r}): expected a positive int or None."
        )

    @functools.wraps(f)
    def vmapped(*args, **kwargs):
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
        arg_leaves, arg_treedef = optree.tree_flatten(args, none_is_leaf=True)
        dim_leaves = _broadcast_dims(tuple(prefix), args, call, "in_dims")
        size = _batch_size(arg_leaves, dim_leaves, call)
        if chunk_size is None or chunk_size >= size:
            return _vmap_call(f, arg_leaves, arg_treedef, dim_leaves, size, kwargs, out_dims,
                              randomness, call)
        outputs = []
        for start in range(0, size, chunk_size):
            stop = min(start + chunk_size, size)
            # d may be negative (in_dims=-1): count the leading full slices from the front
            chunk = [leaf if d is None else
                     ops.getitem(leaf, (slice(None),) * (d % leaf.dim()) + (slice(start, stop),))
                     for leaf, d in zip(arg_leaves, dim_leaves)]
            outputs.append(_vmap_call(f, chunk, arg_treedef, dim_leaves, stop - start, kwargs,
                                      out_dims, randomness, call))
        return _concatenate_chunks(outputs, out_dims, call)
    return vmapped


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
               call):
    level = new_level(Batched, length=size, call=call)
    with transform_scope(level), random_guard(level, randomness, call):
        wrapped = [leaf if d is None else level.wrap_input(leaf, d % len(leaf.shape))
                   for leaf, d in zip(arg_leaves, dim_leaves)]
        out = f(*optree.tree_unflatten(arg_treedef, wrapped), **kwargs)
    return _unbatch_outputs(level, out, out_dims, size, call)


def _unbatch_outputs(level, out, out_dims, size, call):
    out_leaves, out_treedef = optree.tree_flatten(out, none_is_leaf=False)
    dims = _broadcast_dims(out_dims, out, call, "out_dims") if not isinstance(out_dims, int) \
        else [out_dims] * len(out_leaves)
    result = []
    for leaf, dim in zip(out_leaves, dims):
        batched = isinstance(leaf, BatchedTensor) and leaf.dispatcher is level
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
def _with_selected(f, args, argnums):
    """``f`` as a function of the arguments ``argnums`` only, the others held fixed."""
    def f_of_selected(*selected):
        full = list(args)
        for argnum, value in zip(argnums, selected):
            full[argnum] = value
        return f(*full)
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
        basis.append(ops.reshape(rows[:, start:start + size], total, *leaf.shape))
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
        call = describe_call("jacrev", f)
        argnums_ = _normalize_argnums(argnums, len(args), call)
        selected = [args[a] for a in argnums_]
        result = vjp(_with_selected(f, args, argnums_), *selected, has_aux=has_aux)
        out, vjp_fn = result[0], result[1]
        out_leaves, out_treedef = optree.tree_flatten(out)
        basis, sizes = _identity_basis(out_leaves)

        def pull_back(*basis_leaves):
            return vjp_fn(optree.tree_unflatten(out_treedef, list(basis_leaves)))

        per_input = vmap(pull_back, chunk_size=chunk_size)(*basis)  # (total, *in_shape) leaves
        jacobians = []
        for o_index, (o, n) in enumerate(zip(out_leaves, sizes)):
            offset = sum(sizes[:o_index])

            def block(g, o=o, n=n, offset=offset):
                return ops.reshape(g[offset:offset + n], *o.shape, *g.shape[1:])
            per_arg = tuple(optree.tree_map(block, tree) for tree in per_input)
            jacobians.append(per_arg[0] if isinstance(argnums, int) else per_arg)
        jacobian = optree.tree_unflatten(out_treedef, jacobians)
        if has_aux:
            return jacobian, result[2]
        return jacobian
    return jacrev_f


def jacfwd(f, argnums=0, has_aux=False, *, randomness="error"):
    """The Jacobian by forward mode: ``vmap`` of ``jvp`` over identity columns.

    >>> import torch
    >>> from minifunctorch.core import jacfwd
    >>> jacfwd(lambda x: x ** 2)(torch.tensor([1.0, 2.0]))
    tensor([[2., 0.],
            [0., 4.]])
    """
    @functools.wraps(f)
    def jacfwd_f(*args):
        call = describe_call("jacfwd", f)
        argnums_ = _normalize_argnums(argnums, len(args), call)
        selected = tuple(args[a] for a in argnums_)
        in_leaves, in_treedef = _flatten_arrays(selected, call, "the differentiated arguments")
        basis, sizes = _identity_basis(in_leaves)
        f_selected = _with_selected(f, args, argnums_)

        def push_forward(*basis_leaves):
            tangents = optree.tree_unflatten(in_treedef, list(basis_leaves))
            result = jvp(f_selected, selected, tangents, has_aux=has_aux)
            return (result[1], result[2]) if has_aux else result[1]

        out_dims = (-1, 0) if has_aux else -1
        pushed = vmap(push_forward, out_dims=out_dims, randomness=randomness)(*basis)
        tangents_out, aux = pushed if has_aux else (pushed, None)

        def split(t):  # t: (*out_shape, total) -> per input leaf (*out_shape, *in_shape)
            out_shape = tuple(t.shape[:-1])
            blocks, begin = [], 0
            for x, n in zip(in_leaves, sizes):
                piece = ops.getitem(t, (Ellipsis, slice(begin, begin + n)))
                blocks.append(ops.reshape(piece, *out_shape, *x.shape))
                begin += n
            per_arg = optree.tree_unflatten(in_treedef, blocks)
            return per_arg[0] if isinstance(argnums, int) else per_arg
        jacobian = optree.tree_map(split, tangents_out)
        if has_aux:
            return jacobian, optree.tree_map(lambda a: ops.getitem(a, 0), aux)
        return jacobian
    return jacfwd_f


def hessian(f, argnums=0):
    """The Hessian: forward-over-reverse, ``jacfwd(jacrev(f))``.

    >>> import torch
    >>> from minifunctorch.core import hessian
    >>> hessian(lambda x: (x ** 3).sum())(torch.tensor([1.0, 2.0]))
    tensor([[ 6.,  0.],
            [ 0., 12.]])
    """
    return jacfwd(jacrev(f, argnums), argnums)


# --- modules -----------------------------------------------------------------------------------
def functional_call(module, params_and_buffers, args=(), kwargs=None, *, tie_weights=True,
                    strict=False):
    """Call ``module`` with its parameters and buffers replaced by ``params_and_buffers``.

    >>> import torch
    >>> from minifunctorch.core import functional_call, grad
    >>> model = torch.nn.Linear(2, 1)
    >>> params = {k: torch.ones_like(v) for k, v in model.named_parameters()}
    >>> functional_call(model, params, (torch.ones(1, 2),))
    tensor([[3.]])

    The tensors are swapped into the module for the duration of the call and restored in
    ``finally``, so values of a transform can stand in for parameters.
    """
    if isinstance(params_and_buffers, (tuple, list)):
        merged = {}
        for mapping in params_and_buffers:
            merged.update(mapping)
        params_and_buffers = merged
    if not isinstance(args, tuple):
        args = (args,)
    swapped = []
    try:
        for qualified_name, value in params_and_buffers.items():
            owner_name, _, attribute = qualified_name.rpartition(".")
            try:
                owner = module.get_submodule(owner_name) if owner_name else module
            except AttributeError:
                raise TransformUsageError(
                    f"functional_call(module, params, args): the module has no submodule "
                    f"{owner_name!r} (from the key {qualified_name!r}). Fix: use the keys of "
                    "module.named_parameters()."
                ) from None
            if attribute in owner._parameters:
                table = owner._parameters
            elif attribute in owner._buffers:
                table = owner._buffers
            else:
                raise TransformUsageError(
                    f"functional_call(module, params, args): {qualified_name!r} is neither a "
                    "parameter nor a buffer of the module. Fix: use the keys of "
                    "module.named_parameters() and module.named_buffers()."
                )
            swapped.append((table, attribute, table[attribute]))
            table[attribute] = value
        return module(*args, **(kwargs or {}))
    finally:
        for table, attribute, original in reversed(swapped):
            table[attribute] = original
