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

import torch

from . import ops, pytree
from .autograd import Autograd, AutogradValue, refuse_write_to_recorded
from .batching import Batched, BatchedValue, move_bdim
from .compile_boundary import dynamo_traces, outside_the_graph
from .dispatch import new_level, transform_scope
from .errors import (
    ArgnumsError,
    CotangentTypeError,
    DimOutOfRangeError,
    FunctionOutputError,
    InPlaceError,
    InputDtypeError,
    InvalidOptionError,
    NestedTensorError,
    NonScalarOutputError,
    RandomnessOptionError,
    SavedTensorHooksError,
    TangentsError,
    TransformError,
    TransformUsageError,
    UnsupportedOperationError,
)
from .forward import Forward, ForwardValue
from .grad_mode import level_scope
from .names import fresh_name
from .passes import identity_basis
from .tensor import (
    FuncTensor,
    as_tensor,
    as_tensors,
    captured_write_words,
    engine_code,
    is_plain_strided,
    share_memory,
    unwrap,
    unwrap_tree,
    user_code,
    value_of,
    wrap,
)
from .values import Value, batched_by_vmap, bottom_tensor


# --- call descriptions for error messages -----------------------------------------------------
def _function_name(f) -> str:
    return getattr(f, "__name__", None) or type(f).__name__


class describe_call:
    """``vmap(f, in_dims=(0,))(<inputs>)``: how an error message names the call. The string
    is made when a message needs it (``f"{call}: ..."``): a transform is called once per step
    of a loop, and formatting the options costs microseconds that only an error uses."""
    __slots__ = ("transform", "f", "options")

    def __init__(self, transform: str, f, **options):
        self.transform, self.f, self.options = transform, f, options

    def __str__(self):
        shown = "".join(f", {key}={value!r}" for key, value in self.options.items())
        return f"{self.transform}({_function_name(self.f)}{shown})(<inputs>)"

    def __format__(self, spec):
        return format(str(self), spec)

    def __repr__(self):
        return repr(str(self))


def _is_array(value) -> bool:
    return isinstance(value, (torch.Tensor, Value))


def _type_shown(value) -> str:
    """``<class 'float'>``, as torch.func names a type in its messages; an engine value is
    shown as the Tensor the user's code sees."""
    return "<class 'torch.Tensor'>" if _is_array(value) else str(type(value))


# NOTE [Messages: the call, torch.func's words, the cause, the fix]
# Each check below raises with a message in four parts:
#   grad(f, argnums=2)(<inputs>): Got argnum=2, but only 2 positional inputs. argnums counts
#   the function's positional arguments from 0 (from -1 at the end). Fix: use argnums ...
# The call comes first, as everywhere in this package (the magics rewrite it into the magic
# as written, magics/errors.py). Then torch.func's own sentence for the case, word for word
# where it has no torch internals in it: it is what people paste into a search engine, and
# tests/test_torchfunc_errors.py checks it against torch.func. Then the cause in this call's
# terms, and the fix. torch.func's messages are built the same way where it names the call
# ("vmap(f, in_dims=2, ...)(<inputs>): Got in_dim=2 for some input, ...").
# Where torch.func's sentence begins with its own generic call ("vjp(f, *primals): expected
# f(*primals) to return only tensors"), that call is quoted too, after ours: tests written
# against torch.func match the whole sentence, prefix included.
_TORCH_CALLS = {"grad": "grad_and_value(f)(*args)", "vjp": "vjp(f, *primals)",
                "jvp": "jvp(f, primals, tangents)"}


def _torch_call(call) -> str:
    """torch.func's generic call for the transform ``call`` names, as its messages begin."""
    generic = _TORCH_CALLS.get(str(call).split("(", 1)[0])
    return f"{generic}: " if generic else ""


def _normalize_argnums(argnums, num_args, call):
    """``argnums`` as a tuple of distinct non-negative ints, checked as torch.func does."""
    fix = "Fix: pass argnums=0 for the first argument, or a tuple such as argnums=(0, 1)."
    if not isinstance(argnums, (int, tuple)):
        raise ArgnumsError(
            f"{call}: argnums must be int or Tuple[int, ...], got: {type(argnums)}. argnums "
            f"says which positional arguments to differentiate. {fix}"
        )
    as_tuple = (argnums,) if isinstance(argnums, int) else argnums
    if not as_tuple:
        raise ArgnumsError(
            f"{call}: argnums must be non-empty: argnums=() selects no argument to "
            f"differentiate. {fix}"
        )
    for a in as_tuple:
        if not isinstance(a, int):
            raise ArgnumsError(
                f"{call}: argnum must be int, got: {type(a)}. argnums={argnums!r} has an entry "
                f"that is not an argument position. {fix}"
            )
    normalized = []
    for a in as_tuple:
        if not -num_args <= a < num_args:
            raise ArgnumsError(
                f"{call}: Got argnum={a}, but only {num_args} positional inputs. argnums "
                f"counts the function's positional arguments from 0 (from -1 at the end). " + (
                    f"Fix: use argnums between {-num_args} and {num_args - 1}." if num_args
                    else "Fix: pass the inputs to differentiate as positional arguments.")
            )
        normalized.append(a % num_args)
    if len(set(normalized)) != len(normalized):
        raise ArgnumsError(
            f"{call}: argnums elements must be unique, got {argnums!r}: they name an argument "
            "twice. Fix: list each argument once."
        )
    return tuple(normalized)


def _flatten_arrays(tree, call, what):
    """The leaves of ``tree`` as engine values (FuncTensors unwrapped), checked to be tensors."""
    leaves, treedef = pytree.tree_flatten(tree)
    leaves = [unwrap(leaf) for leaf in leaves]
    for leaf in leaves:
        if not _is_array(leaf):
            raise TransformUsageError(
                f"{call}: Thing passed to transform API must be Tensor, got {type(leaf)}: "
                f"{what} holds a {type(leaf).__name__}, and only tensors can be differentiated. "
                "Fix: pass tensors, or move non-tensor values out of the differentiated "
                "arguments (e.g. with functools.partial)."
            )
    return leaves, treedef


def _check_differentiable(leaves, call):
    """torch.func's grad and vjp make their inputs require grad, which torch allows for
    floating-point and complex tensors only."""
    for leaf in leaves:
        if not (leaf.dtype.is_floating_point or leaf.dtype.is_complex):
            raise InputDtypeError(
                f"{call}: only Tensors of floating point dtype can require gradients: an "
                f"input has dtype {leaf.dtype}, and its gradient would not be defined. Fix: "
                "convert it (x.float()), or leave it out of argnums."
            )


def _lower_tree(tree, level):
    """Aux outputs for the caller: values of ``level`` replaced by their payloads."""
    def lower(leaf):
        leaf = unwrap(leaf)
        if isinstance(leaf, Value) and leaf.dispatcher is level:
            leaf = level.lower(leaf)
        return as_tensor(leaf)
    return pytree.tree_map(lower, tree)


def _split_aux(out, has_aux, call):
    if not has_aux:
        return out, None
    if not (isinstance(out, tuple) and len(out) == 2):
        got = f"a tuple of {len(out)}" if isinstance(out, tuple) else _type_shown(out)
        raise FunctionOutputError(
            f"{call}: {_torch_call(call)}output of function f should be a tuple: (output, aux) if has_aux is "
            f"True, got {got}. Fix: return (output, aux), or drop has_aux."
        )
    for leaf in pytree.tree_leaves(out[1]):
        if not _is_array(unwrap(leaf)):
            raise FunctionOutputError(
                f"{call}: Expected tensors, got unsupported type {type(leaf)}: with "
                "has_aux=True, aux is returned through the transform, and it carries tensors "
                "only. Fix: return tensors in aux, or keep other values outside the function."
            )
    return out[0], out[1]


def _check_outputs_are_tensors(leaves, call, returned, out):
    if not leaves:
        raise FunctionOutputError(
            f"{call}: {_torch_call(call)}Expected f to be a function that has non-empty output "
            f"(got output = {out!r}): there is nothing to differentiate. Fix: return the "
            "tensors to differentiate."
        )
    for leaf in leaves:
        if not _is_array(leaf):
            raise FunctionOutputError(
                f"{call}: {_torch_call(call)}expected {returned} to return only tensors, got unsupported type "
                f"{type(leaf)}. Fix: return tensors, or return the other values as aux "
                "(has_aux=True)."
            )


def _write_back(shown, originals, lower, call):
    """NOTE [In-place writes to a transform's inputs]
    torch.func's inputs are the caller's own tensors, so ``x.add_(1)`` inside ``grad(f)(x)``
    also changes the caller's ``x``. Here ``f`` sees FuncTensors, and a write swaps a new
    value into one of them (tensor.py, ``_write``). After ``f`` returns, each input that was
    written is copied into the caller's tensor, one level down (``lower``)."""
    for tensor, original in zip(shown, originals):
        if type(tensor) is FuncTensor and tensor._generation:
            new_value = as_tensor(lower(_past_exited_levels(value_of(tensor))))
            # a value that broadcasts to the input is written into it (one draw shared by
            # the batch, randomness='same'); any other shape means the op reshaped the input
            reshaped = len(new_value.shape) != len(original.shape) or any(
                n not in (o, 1) for n, o in zip(new_value.shape, original.shape))
            if type(original) is FuncTensor:
                if reshaped:
                    raise UnsupportedOperationError(
                        f"{call}: an in-place op that changes an input's shape (squeeze_, "
                        "unsqueeze_, t_, ...) inside nested transforms is not supported: the "
                        f"input of shape {tuple(original.shape)} would become "
                        f"{tuple(new_value.shape)}. Fix: "
                        "use the out-of-place op (x = x.squeeze()).")
                # a value of an enclosing transform: its grad levels record the write
                # (under no_grad they would not: NOTE [Grad modes and transform levels])
                original.copy_(new_value)
            elif isinstance(original, Value):  # split_vjp's traced inputs
                raise UnsupportedOperationError(
                    f"{call}: f writes in place into an argument of shape "
                    f"{tuple(original.shape)}, and the forward and backward programs of "
                    "split_vjp do not write their inputs. Fix: compute out of place "
                    "(s = s * 2 rather than s.mul_(2)).")
            elif isinstance(new_value, FuncTensor):
                _refuse_a_value_in_a_plain_tensor(new_value, original, call)
            else:
                with torch.no_grad():  # a plain leaf that requires grad may be written
                    if new_value.untyped_storage().data_ptr() == \
                            original.untyped_storage().data_ptr():
                        new_value = new_value.clone()  # a view of the input itself
                    if reshaped:  # squeeze_, unsqueeze_, t_: the caller's tensor takes the
                        original.set_(new_value)  # new shape, as in torch.func
                    else:
                        original.copy_(new_value)


def _refuse_aliased_writes(shown, originals, call):
    """NOTE [A write into an input that another input aliases]
    ``vmap(f)(x, x)``, ``jvp(f, (x, x), ...)`` or ``vmap(f)(x[:2], x[1:3])``, where f writes
    into its first argument and reads the second: torch.func wraps each argument over the
    caller's tensor, so the second sees the write through the memory they share. Here each
    is shown to f as a FuncTensor of its own value, and the second would not see it: the
    results would be silently wrong. So when f returns, before anything is copied back, a
    written input that shares memory with another input is refused. (One tensor passed twice
    as arguments that grad does not differentiate is one FuncTensor, and sees its writes:
    NOTE [Arguments a transform does not differentiate]. jit checks its inputs the same way:
    program.py.)"""
    for tensor, original in zip(shown, originals):
        if type(tensor) is not FuncTensor or not tensor._generation:
            continue
        for other, other_original in zip(shown, originals):
            if other is not tensor and share_memory(original, other_original):
                raise UnsupportedOperationError(
                    f"{call}: f writes in place into an input of shape "
                    f"{tuple(original.shape)} that shares memory with another input (the same "
                    "tensor passed twice, or views of one): torch.func would show the write "
                    "through the other input too, and here each input is a tensor of its own, "
                    "so f read the other without it. Fix: pass a copy as one of them "
                    "(x.clone()), or compute out of place.")


def _past_exited_levels(value):
    """What an inner transform wrote into a tensor of this one (``b.copy_(w)`` in a function
    of grad that closes over ``b``) holds that transform's value after it returns: seen as
    what it wraps, as any value that escapes a transform is (NOTE [Values that escape a
    transform] in dispatch.py). An exited vmap's value has no single value and is kept: its
    level raises when it is used."""
    while isinstance(value, Value) and value.dispatcher.exited and \
            getattr(value.dispatcher, "length", None) is None:
        value = value.dispatcher.lower(value)
    return value


def _refuse_a_value_in_a_plain_tensor(new_value, original, call):
    """f wrote a value of an enclosing transform into an argument that the caller passed as a
    plain tensor, which cannot hold it: one value per example of an enclosing vmap
    (``vmap(grad(f), in_dims=(0, None))(x, buf)`` with ``buf.copy_(x)``), or a value that an
    enclosing grad differentiates. torch.func raises at the write, in these words."""
    batched = batched_by_vmap(value_of(new_value))
    if batched:
        what = ("a value batched by an enclosing vmap into an argument of shape "
                f"{tuple(original.shape)} that the vmap does not batch (in_dims=None), and "
                "one tensor cannot hold one value per example. Fix: batch the argument too "
                "(in_dims 0, with a batch dim added), or compute out of place.")
    else:
        what = (f"a value of an enclosing transform into an argument of shape "
                f"{tuple(original.shape)} that the enclosing transform does not see (a tensor "
                "it closes over). Fix: pass the tensor to the enclosing transform as an "
                "argument too, or compute out of place.")
    raise InPlaceError(f"{call}: {captured_write_words(batched)}f wrote {what}")


def _writable_arguments(args, argnums, kwargs):
    """NOTE [Arguments a transform does not differentiate]
    torch.func's grad, jacrev and jacfwd wrap every positional argument at their level, the
    differentiated ones requiring grad and the others not, so that ``f`` may write into the
    others in place: a running statistic (``stats.mul_(0.9).add_(...)``), a preallocated
    output (``out.copy_(x @ w)``), even with a value of the transform. The write reaches the
    caller's tensor, and the result carries its derivative. Here each tensor of such an
    argument is shown to ``f`` as a fresh FuncTensor holding what the caller passed (its
    plain tensor, or its value of an enclosing transform), as a tensor that ``f`` creates is
    (NOTE [Tensors created inside a transform] in tensor.py): a write swaps in a new value,
    and ``_write_back`` copies it into the caller's tensor, when ``f`` returns for jacfwd,
    and after the backward pass for grad and jacrev: the backward pass reads what ``f``
    computed with (torch.func's version counter raises where a backward would read a written
    tensor; here the gradient is that of what ``f`` computed). One tensor passed twice is
    one FuncTensor, so each place sees the other's writes. grad's keyword arguments are
    shown the same way, as torch.func's grad does; a tensor that ``f`` closes over stays
    plain, and torch.func refuses to write a value of the transform into it (tensor.py,
    ``_write``).
    Returns the arguments and keyword arguments to call ``f`` with, and (shown, originals)
    for ``_write_back``."""
    args = list(args)
    shown, originals, by_id = [], [], {}

    def show(tree):
        leaves, treedef = pytree.tree_flatten(tree)
        if not any(_is_writable(leaf) for leaf in leaves):
            return tree
        for i, leaf in enumerate(leaves):
            if _is_writable(leaf):
                key = id(leaf)
                if key not in by_id:
                    by_id[key] = wrap(value_of(leaf) if type(leaf) is FuncTensor else leaf)
                    shown.append(by_id[key])
                    originals.append(leaf)
                leaves[i] = by_id[key]
        return pytree.tree_unflatten(treedef, leaves)

    for argnum, arg in enumerate(args):
        if argnum not in argnums:
            args[argnum] = show(arg)
    return args, {name: show(value) for name, value in kwargs.items()}, shown, originals


def _is_writable(leaf) -> bool:
    """A tensor that ``_writable_arguments`` shows to ``f``: a FuncTensor, or a strided
    plain tensor; other subclasses and layouts are passed as they are."""
    return type(leaf) is FuncTensor or is_plain_strided(leaf)


# --- reverse mode ------------------------------------------------------------------------------
def _wrap_for_autograd(level, leaves, used):
    """The inputs of a reverse-mode level, each with its own name: the tape keys cotangents by
    name, so a tensor given twice (``grad(f, argnums=(0, 1))(x, x)``) must be two inputs,
    each with its own gradient, as in torch.func. A labelled tensor keeps its label the first
    time; after that, and for a tensor without one, the input gets a fresh name (left to the
    value itself, it would take its payload's label again). ``used``: the names given so far
    to this level's inputs (of every argument), updated."""
    wrapped = []
    for leaf in leaves:
        label = leaf.name if isinstance(leaf, Value) else getattr(leaf, "t_name", None)
        name = label if label is not None and label not in used else fresh_name()
        used.add(name)
        wrapped.append(level.wrap_input(leaf, name))
    return wrapped


def _output_values(out):
    """NOTE [Outputs are read while their level runs]
    An output may be a view whose base f wrote in place after taking it (``y0 = y[0];
    y.sin_()``): its value is the view replayed on the base's new value (tensor.py's views),
    and that replay must run on the transform's level, so that grad records it and vmap
    batches it. So the outputs are unwrapped before the level's scope closes."""
    return unwrap_tree(out)


def _run_reverse(f, args, kwargs, argnums, call, user_scope=user_code):
    """Run ``f`` on an Autograd level with the arguments ``argnums`` as inputs (inside
    ``user_scope()``: split_vjp's trace gives its own).

    ``argnums`` is already normalized (a tuple of distinct non-negative ints; vjp with no
    primals gives ``()``). Returns (level, out, argnums, one (leaves, wrapped values, treedef)
    per selected argument, and a function that copies what ``f`` wrote into the other
    arguments into the caller's tensors, to be called once the backward pass has read the
    tape: NOTE [Arguments a transform does not differentiate]).
    """
    # NOTE [Saved-tensor hooks]: torch.func refuses them under its reverse-mode transforms
    # (a hook would see the engine's values, not what torch's autograd saves); so do we, with
    # its words, for hooks active at the call and for hooks entered inside f
    hooks_message = (f"{call}: torch.func.{{grad, vjp, jacrev, hessian}} don't yet support "
                     "saved tensor hooks. Fix: leave the hooks' context "
                     "(torch.autograd.graph.save_on_cpu, saved_tensors_hooks) around the "
                     "transform, or apply it outside.")
    if torch._C._autograd._top_saved_tensors_default_hooks(False) is not None:
        raise SavedTensorHooksError(hooks_message)
    level = new_level(Autograd, name="Autograd", record_steps=False, call=call)
    inputs = []
    shown, originals, names = [], [], set()
    with transform_scope(level), level_scope(level), \
            torch.autograd.graph.disable_saved_tensors_hooks(hooks_message):
        # NOTE [Arguments a transform does not differentiate]
        args, kwargs, fixed_shown, fixed_originals = _writable_arguments(args, argnums, kwargs)
        for argnum in argnums:
            originals += pytree.tree_leaves(args[argnum])
            leaves, treedef = _flatten_arrays(args[argnum], call, f"argument {argnum}")
            _check_differentiable(leaves, call)
            wrapped = _wrap_for_autograd(level, leaves, names)
            inputs.append((leaves, wrapped, treedef))
            tensors = [as_tensor(w) for w in wrapped]
            shown += tensors
            args[argnum] = pytree.tree_unflatten(treedef, tensors)
        with user_scope():
            out = f(*args, **kwargs)
        out = _output_values(out)
        _refuse_writes_a_tape_reads(shown, originals)
    _refuse_aliased_writes(shown + fixed_shown, originals + fixed_originals, call)
    _write_back(shown, originals, level.lower_own, call)

    def write_back_fixed():
        """After the backward pass, which may read what the arguments held."""
        _write_back(fixed_shown, fixed_originals, level.lower_own, call)
    return level, out, argnums, inputs, write_back_fixed


def _refuse_writes_a_tape_reads(shown, originals):
    """Before ``_write_back``, while the level runs. An input that f wrote in place is copied
    into the caller's tensor, the very tensor the ops recorded on its first value read. If
    one of them would read it in the backward pass (``x.sin_()``; ``(x * x).sum()`` then
    ``x.add_(1)``), the gradient would use the new numbers: torch.func refuses every such
    write into its leaves, and here a write is refused when a recorded op has the caller's
    tensor among its arguments (NOTE [A tape has no version counter] in autograd.py). A
    write before any use under no_grad, or one that replaces the input (``x.copy_(y)``), is
    copied back as before."""
    for tensor, original in zip(shown, originals):
        if type(tensor) is FuncTensor and tensor._generation and type(original) is not FuncTensor:
            refuse_write_to_recorded(
                original, "an in-place op on an input (torch.func: a leaf Variable that "
                          "requires grad is being used in an in-place operation)")


def _gradients(level, seeds, inputs):
    """Backward pass from ``seeds``; one gradient pytree (of values) per selected argument."""
    gradients = level.tape.backward(seeds, record_steps=level.record_steps) if seeds else {}
    result = []
    for leaves, wrapped, treedef in inputs:
        grads = []
        for leaf, value in zip(leaves, wrapped):
            g = gradients.get(value.name)
            if g is None:
                g = ops.zeros_like(leaf)
            elif g.dtype != leaf.dtype:  # as torch's autograd: a gradient has its input's dtype
                g = ops.convert(g, leaf.dtype)
            grads.append(g)
        result.append(pytree.tree_unflatten(treedef, grads))
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
        if dynamo_traces():  # NOTE [Transforms under torch.compile] (compile_boundary.py)
            return outside_the_graph(grad_and_value_f, args, kwargs)
        with engine_code():
            return _grad_and_value(f, argnums, has_aux, args, kwargs)
    return grad_and_value_f


def _grad_and_value(f, argnums, has_aux, args, kwargs):
    call = describe_call("grad", f, argnums=argnums) if argnums != 0 else describe_call("grad", f)
    level, out, argnums_, inputs, write_back_fixed = _run_reverse(
        f, args, kwargs, _normalize_argnums(argnums, len(args), call), call)
    try:
        return _gradient_and_value(level, out, inputs, argnums, has_aux, call)
    finally:
        write_back_fixed()


def _gradient_and_value(level, out, inputs, argnums, has_aux, call):
    out, aux = _split_aux(out, has_aux, call)
    if not _is_array(out):
        raise NonScalarOutputError(
            f"{call}: {_torch_call(call)}Expected f(*args) to return a Tensor, got {type(out)}: grad "
            "differentiates one number, a scalar tensor. Fix: return a scalar tensor (with "
            "has_aux=True, return (scalar, aux)); for several outputs use jacrev or vjp."
        )
    if tuple(out.shape) != ():
        raise NonScalarOutputError(
            f"{call}: {_torch_call(call)}Expected f(*args) to return a scalar Tensor, got tensor with "
            f"{len(out.shape)} dims (shape {tuple(out.shape)}): grad differentiates one "
            "number. Fix: reduce the output (e.g. .sum()), or use jacrev / %%jacobian for the "
            "Jacobian of a non-scalar output (vjp for a vector-Jacobian product)."
        )
    if out.dtype.is_complex:  # NOTE [Complex numbers] (dispatch.py): a real loss only
        raise NonScalarOutputError(
            f"{call}: {_torch_call(call)}grad can be implicitly created only for real scalar "
            f"outputs but got {out.dtype}. Fix: differentiate a real number, such as "
            "out.real or out.abs() (vjp for a complex cotangent)."
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
    if dynamo_traces():  # NOTE [Transforms under torch.compile] (compile_boundary.py)
        return outside_the_graph(vjp, (f, *primals), {"has_aux": has_aux})
    with engine_code():
        return _vjp(f, primals, has_aux)


def _vjp(f, primals, has_aux):
    result, _ = _vjp_of_selected(f, primals, has_aux, tuple(range(len(primals))))
    return result


def _vjp_of_selected(f, args, has_aux, argnums):
    """vjp's result, where vjp_fn pulls back to the arguments ``argnums`` only (jacrev's), and
    the function that copies what f wrote into the other arguments into the caller's
    tensors, to be called after the last pull-back (NOTE [Arguments a transform does not
    differentiate]); with every argument selected (vjp's), it does nothing."""
    call = describe_call("vjp", f)
    level, out, _, inputs, write_back_fixed = _run_reverse(f, args, {}, argnums, call)
    out, aux = _split_aux(out, has_aux, call)
    out_leaves, out_treedef = pytree.tree_flatten(out)
    _check_outputs_are_tensors(out_leaves, call, "f(*primals)", out)
    own = [isinstance(o, AutogradValue) and o.dispatcher is level for o in out_leaves]
    primal_out = pytree.tree_unflatten(
        out_treedef, [as_tensor(o.payload if is_own else o) for o, is_own in zip(out_leaves, own)])

    def vjp_fn(cotangents, retain_graph=True, create_graph=None):
        # retain_graph: the tape lives as long as vjp_fn, which can always be called again.
        # create_graph=False: plain results leave torch's autograd graph (torch.func's
        # default, None, keeps it when grad mode is on); transform levels still see the ops.
        if dynamo_traces():  # NOTE [Transforms under torch.compile] (compile_boundary.py)
            return outside_the_graph(vjp_fn, (cotangents, retain_graph, create_graph), {})
        with engine_code():
            cts = _pull_back(cotangents)
        if create_graph is False or (create_graph is None and not torch.is_grad_enabled()):
            cts = pytree.tree_map(lambda ct: ct.detach() if type(ct) is torch.Tensor else ct,
                                  cts, none_is_leaf=True)
        return cts

    def _pull_back(cotangents):
        ct_leaves, ct_treedef = pytree.tree_flatten(cotangents)
        ct_leaves = [unwrap(ct) for ct in ct_leaves]
        if ct_treedef != out_treedef:
            raise TangentsError(
                "vjp_fn(cotangents): Expected pytree structure of cotangents to be the same as "
                "pytree structure of outputs to the function. cotangents: "
                f"{_structure(ct_treedef)}, primal output: {_structure(out_treedef)}. Fix: pass "
                "one cotangent per output, in a container like the output's."
            )
        seeds = {}
        for index, (o, is_own, ct) in enumerate(zip(out_leaves, own, ct_leaves)):
            if not _is_array(ct):
                raise CotangentTypeError(
                    f"vjp_fn(cotangents): gradients can be either Tensors or None, but got "
                    f"{type(ct).__name__}: cotangent {index} is not a tensor. Fix: pass a "
                    "tensor with the output's shape (torch.ones_like(output) for a sum)."
                )
            if tuple(ct.shape) != tuple(o.shape):
                raise TangentsError(
                    f"vjp_fn(cotangents): Mismatch in shape: grad_output[{index}] has a shape of "
                    f"{torch.Size(ct.shape)} and output[{index}] has a shape of "
                    f"{torch.Size(o.shape)}. Fix: give each cotangent its output's shape."
                )
            if is_own:
                seeds[o.name] = ct if o.name not in seeds else ops.add(seeds[o.name], ct)
        return as_tensors(tuple(_gradients(level, seeds, inputs)))

    if has_aux:
        return (primal_out, vjp_fn, _lower_tree(aux, level)), write_back_fixed
    return (primal_out, vjp_fn), write_back_fixed


# --- forward mode ------------------------------------------------------------------------------
def _structure(treedef) -> str:
    """A pytree structure as a short string: ``(*, *)`` for a pair of leaves."""
    text = str(treedef).replace(", NoneIsLeaf", "")
    return text[len("PyTreeSpec("):-1] if text.startswith("PyTreeSpec(") else text


def _check_primals_and_tangents(primals, tangents, call):
    """jvp's checks, in torch.func's order: primals a tuple, tangents of the same structure,
    at least one tensor and only tensors, then per pair the shape and the dtype kind.
    Returns (primal leaves, tangent leaves, primals' treedef)."""
    if not isinstance(primals, tuple):
        raise TangentsError(
            f"{call}: {_torch_call(call)}Expected primals to be a tuple. E.g. it should be valid to call "
            f"f(*primals). Got {_type_shown(primals)}. Fix: jvp(f, (x,), (t,)), one tangent "
            "per argument of f."
        )
    p_leaves, p_treedef = pytree.tree_flatten(primals)
    t_leaves, t_treedef = pytree.tree_flatten(tangents)
    if p_treedef != t_treedef:
        raise TangentsError(
            f"{call}: {_torch_call(call)}Expected primals and tangents to have the same python structure. For "
            "example, if primals is a tuple of 3 tensors, tangents also must be. Got primals "
            f"with structure {_structure(p_treedef)} and tangents with structure "
            f"{_structure(t_treedef)}. Fix: give one tangent per primal, in the same container."
        )
    for what, leaves in (("primals", p_leaves), ("tangents", t_leaves)):
        if not leaves:
            raise TangentsError(
                f"{call}: {_torch_call(call)}Expected {what} to contain at least one Tensor. Fix: pass the point "
                "to differentiate at as primals, e.g. jvp(f, (x,), (t,))."
            )
        for leaf in leaves:
            if not _is_array(unwrap(leaf)):
                raise TangentsError(
                    f"{call}: {_torch_call(call)}Expected {what} to only contain Tensors, got {type(leaf)}. Fix: "
                    "pass tensors, and close over other values (functools.partial)."
                )
    p_leaves = [unwrap(p) for p in p_leaves]
    t_leaves = [unwrap(t) for t in t_leaves]
    for p, t in zip(p_leaves, t_leaves):
        if tuple(p.shape) != tuple(t.shape):
            raise TangentsError(
                f"{call}: Trying to set a forward gradient that has a different size than that "
                f"of the original Tensor, this is not supported. Tensor is of size "
                f"{list(p.shape)} while the given forward gradient is of size {list(t.shape)}. "
                "Fix: give each tangent its primal's shape."
            )
        if not (p.dtype.is_floating_point or p.dtype.is_complex):
            raise TransformUsageError(
                f"{call}: Expected primal to be floating point or complex, but got: {p.dtype}. "
                "A derivative needs a continuous input. Fix: convert it (x.float()), or close "
                "over it instead of passing it as a primal."
            )
    return p_leaves, t_leaves, p_treedef


def jvp(f, primals, tangents, *, strict=False, has_aux=False):
    """Forward mode: ``(f(*primals), J @ tangents)``, with torch.func's signature.
    ``strict=True`` refuses an output that does not depend on the inputs (its tangent would be
    zeros).

    >>> import torch
    >>> from minifunctorch.core import jvp
    >>> jvp(torch.sin, (torch.tensor(0.0),), (torch.tensor(2.0),))
    (tensor(0.), tensor(2.))
    """
    if dynamo_traces():  # NOTE [Transforms under torch.compile] (compile_boundary.py)
        return outside_the_graph(jvp, (f, primals, tangents),
                                 {"strict": strict, "has_aux": has_aux})
    with engine_code():
        return _jvp(f, primals, tangents, has_aux, strict)


def _jvp(f, primals, tangents, has_aux, strict=False, fixed=None):
    """``fixed``: jacfwd's (all of f's arguments, argnums), where ``primals`` are the
    selected ones, and f may write into the others (NOTE [Arguments a transform does not
    differentiate])."""
    call = describe_call("jvp", f)
    p_leaves, t_leaves, p_treedef = _check_primals_and_tangents(primals, tangents, call)
    level = new_level(Forward, call=call)
    shown, originals = [], []
    with transform_scope(level), level_scope(level):
        wrapped = [as_tensor(level.wrap_input(p, t)) for p, t in zip(p_leaves, t_leaves)]
        args = pytree.tree_unflatten(p_treedef, wrapped)
        if fixed is not None:
            all_args, argnums = fixed
            full, _, shown, originals = _writable_arguments(all_args, argnums, {})
            for argnum, arg in zip(argnums, args):
                full[argnum] = arg
            args = full
        with user_code():
            out = f(*args)
        out = _output_values(out)
    shown, originals = wrapped + shown, pytree.tree_leaves(primals) + originals
    _refuse_aliased_writes(shown, originals, call)
    _write_back(shown, originals, level.lower_own, call)
    out, aux = _split_aux(out, has_aux, call)
    out_leaves, out_treedef = pytree.tree_flatten(out)
    _check_outputs_are_tensors(out_leaves, call, "f(*primals)", out)
    primal_out, tangent_out = [], []
    for o in out_leaves:
        if isinstance(o, ForwardValue) and o.dispatcher is level:
            primal_out.append(o.payload)
            tangent_out.append(o.tangent)
        else:
            if strict:
                raise FunctionOutputError(
                    f"{call}: jvp(f, primals, tangents, strict=True): The output of f is "
                    "independent of the inputs. This is not allowed with strict=True. Fix: "
                    "drop strict=True to get zeros as its tangent."
                )
            primal_out.append(o)
            tangent_out.append(ops.zeros_like(o) if _is_array(o) else None)
    result = (pytree.tree_unflatten(out_treedef, as_tensors(primal_out)),
              pytree.tree_unflatten(out_treedef, as_tensors(tangent_out)))
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
        _check_linearize_tangents(primals, tangents)
        return jvp(f, primals, tangents)[1]
    return out, jvp_fn


def _check_linearize_tangents(primals, tangents):
    """linearize's jvp_fn takes tangents like the primals: structure, shape and dtype."""
    call = "linearize(f, *primals)'s jvp_fn(*tangents)"
    p_leaves, p_treedef = pytree.tree_flatten(primals)
    t_leaves, t_treedef = pytree.tree_flatten(tangents)
    if p_treedef != t_treedef:
        raise TangentsError(
            f"{call}: Expected the tangents {_structure(t_treedef)} to have the same argspec as "
            f"the primals {_structure(p_treedef)}. Fix: pass one tangent per primal, as "
            "jvp_fn(*tangents)."
        )
    for index, (p, t) in enumerate(zip(p_leaves, t_leaves)):
        if not _is_array(unwrap(t)):
            raise TangentsError(f"{call}: Expected tangents to only contain Tensors, got "
                                f"{type(t)}. Fix: pass tensors.")
        for what, got, want in (("shape", t.shape, p.shape), ("dtype", t.dtype, p.dtype)):
            if got != want:
                raise TangentsError(
                    f"{call}: tangent:{index} with {what} {got} in flattened pytree doesn't "
                    f"match the {what} {want} of the corresponding primal. Fix: give each "
                    f"tangent its primal's {what}."
                )


# --- vectorization -----------------------------------------------------------------------------
def _broadcast_dims(dims, tree, call, what):
    """Spread ``dims`` (an int/None, or a prefix of ``tree``) over the leaves of ``tree``."""
    try:
        return pytree.tree_flatten(pytree.tree_broadcast_prefix(dims, tree, none_is_leaf=True),
                                   none_is_leaf=True)[0]
    except (ValueError, TypeError):
        where = "inputs" if what == "in_dims" else "outputs"
        dims_structure = pytree.tree_structure(dims, none_is_leaf=True)
        tree_structure = pytree.tree_structure(tree, none_is_leaf=True)
        raise TransformUsageError(
            f"{call}: {what} is not compatible with the structure of `{where}`. {what} has "
            f"structure {_structure(dims_structure)} but {where} has structure "
            f"{_structure(tree_structure)}. Fix: give one dim per {where[:-1]} (a tuple as long "
            f"as the {where}, or a matching pytree prefix), or a single int or None for all."
        ) from None


def vmap(f, in_dims=0, out_dims=0, randomness="error", *, chunk_size=None):
    """Vectorize ``f`` over a batch dimension of its inputs, with torch.func's signature.
    A nested tensor (``torch.nested``) is mapped over its components, which may differ in
    shape (NOTE [vmap over a nested tensor]).

    >>> import torch
    >>> from minifunctorch.core import vmap
    >>> vmap(torch.dot)(torch.ones(3, 2), torch.ones(3, 2))
    tensor([2., 2., 2.])
    >>> vmap(torch.mul, in_dims=(0, None))(torch.arange(3.0), torch.tensor(10.0))
    tensor([ 0., 10., 20.])
    """
    _check_randomness("vmap", randomness)
    _check_chunk_size(f, chunk_size)

    @functools.wraps(f)
    def vmapped(*args, **kwargs):
        if dynamo_traces():  # NOTE [Transforms under torch.compile] (compile_boundary.py)
            return outside_the_graph(vmapped, args, kwargs)
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
        if dynamo_traces():  # NOTE [Transforms under torch.compile] (compile_boundary.py)
            return outside_the_graph(vmapped, args, kwargs)
        with engine_code():
            return as_tensors(_vmap(f, in_dims, out_dims, randomness, None, args, kwargs,
                                    chunks=chunks))
    return vmapped


def _check_chunk_size(f, chunk_size):
    call = f"vmap({_function_name(f)}, chunk_size={chunk_size!r})"
    if chunk_size is not None and not isinstance(chunk_size, int):
        raise TransformUsageError(
            f"{call}: chunk_size should be None or an int, got {type(chunk_size)}: it is the "
            "number of examples run at once. Fix: pass a positive int, or None for all."
        )
    if chunk_size is not None and chunk_size < 1:
        raise TransformUsageError(
            f"{call}: vmap: chunk_size should be None or greater than 0. (got {chunk_size}) "
            "It is the number of examples run at once. Fix: pass a positive int, or None for "
            "all."
        )


def _check_randomness(transform, randomness):
    if randomness not in ("error", "same", "different"):
        raise RandomnessOptionError(
            f"{transform}(..., randomness={randomness!r}): Only allowed values for randomness "
            f"are 'error', 'different', or 'same'. Got {randomness}. Fix: 'different' for "
            "independent draws per example, 'same' for one draw shared by the batch, 'error' "
            "to refuse random operations."
        )


def _check_out_dims(out_dims, call):
    """torch.func's out_dims: an int, None, or a container of them (checked before f runs)."""
    if out_dims is None or type(out_dims) is int:
        return
    # (any pytree of them: a registered class too, NOTE [Pytrees are torch's])
    if all(isinstance(d, (int, type(None)))
           for d in pytree.tree_leaves(out_dims, none_is_leaf=True)):
        return
    raise TransformUsageError(
        f"{call}: `out_dims` must be an int, None or a python collection of ints representing "
        f"where in the outputs the vmapped dimension should appear. Got out_dims={out_dims!r}. "
        "Fix: out_dims=0 puts the batch dim first in every output; a tuple gives one per "
        "output."
    )


def _vmap(f, in_dims, out_dims, randomness, chunk_size, args, kwargs, *, chunks=None):
    options = {} if in_dims == 0 else {"in_dims": in_dims}
    call = describe_call("vmap", f, **options)
    if not args:
        raise TransformUsageError(
            f"{call}: got no inputs. Maybe you forgot to add inputs, or you are trying to vmap "
            "over a function with no inputs. The latter is unsupported. Fix: pass the batched "
            "tensors as positional arguments."
        )
    if not isinstance(in_dims, (int, tuple)):
        raise TransformUsageError(
            f"{call}: expected `in_dims` to be int or a (potentially nested) tuple matching "
            f"the structure of inputs, got: {type(in_dims)}. Fix: in_dims=0 batches every "
            "input along dim 0; a tuple such as in_dims=(0, None) gives one per argument "
            "(None: not batched)."
        )
    if isinstance(in_dims, tuple) and len(in_dims) != len(args):
        raise TransformUsageError(
            f"{call}: in_dims is not compatible with the structure of `inputs`. in_dims has "
            f"{len(in_dims)} entries but the function got {len(args)} positional arguments. "
            "Fix: give one in_dim per argument."
        )
    _check_out_dims(out_dims, call)
    prefix = in_dims if isinstance(in_dims, tuple) else (in_dims,) * len(args)
    originals, arg_treedef = pytree.tree_flatten(args, none_is_leaf=True)
    arg_leaves = [unwrap(leaf) for leaf in originals]
    if all(d is None or type(d) is int for d in prefix):  # one dim per argument: spread it
        dim_leaves = [d for d, child in zip(prefix, arg_treedef.children())
                      for _ in range(child.num_leaves)]
    else:
        dim_leaves = _broadcast_dims(prefix, args, call, "in_dims")
    _refuse_a_vmap_inside_a_nested_one(arg_leaves, dim_leaves, call)
    if any(_is_nested(leaf) for leaf in arg_leaves):
        return _vmap_nested(f, arg_leaves, arg_treedef, dim_leaves, kwargs, out_dims,
                            randomness, call)
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
    sizes = []  # (input position, batch size), in the order of the inputs
    for position, (leaf, dim) in enumerate(zip(arg_leaves, dim_leaves)):
        if dim is None:
            continue
        if not isinstance(dim, int):
            raise TransformUsageError(
                f"{call}: Got in_dim={dim!r} for an input but in_dim must be either an integer "
                "dimension or None. Fix: give each input an int dim, or None if it is shared."
            )
        if not _is_array(leaf):
            raise TransformUsageError(
                f"{call}: Got in_dim={dim} for an input but the input is of type "
                f"{type(leaf)}. We cannot vmap over non-Tensor arguments, please use None as "
                "the respective in_dim. Fix: use in_dim=None for that input."
            )
        rank = len(leaf.shape)
        if not -rank <= dim < rank:
            raise TransformUsageError(
                f"{call}: Got in_dim={dim} for some input, but that input is a Tensor of "
                f"dimensionality {rank} so expected in_dim to satisfy -{rank} <= in_dim < "
                f"{rank}. The input has shape {tuple(leaf.shape)}. " + (
                    f"Fix: use a dim in [{-rank}, {rank - 1}], or None if the input is not "
                    "batched." if rank else "Fix: a 0-dim tensor has no dim to map over: use "
                    "in_dim=None for it, or stack the examples along a new dim first.")
            )
        sizes.append((position, leaf.shape[dim]))
    if not sizes:
        raise TransformUsageError(
            f"{call}: Expected at least one Tensor to vmap over: in_dims is None for every "
            "input. Fix: give the batched input an int in_dim."
        )
    if len({size for _, size in sizes}) > 1:
        by_size = {}
        for position, size in sizes:
            by_size.setdefault(size, []).append(position)
        detail = ", ".join(f"size {s} for input(s) {p}" for s, p in by_size.items())
        raise TransformUsageError(
            f"{call}: Expected all tensors to have the same size in the mapped dimension, got "
            f"sizes {[size for _, size in sizes]} for the mapped dimension: {detail}. Fix: make "
            "the batch dims equal, or use in_dims=None for inputs that are shared."
        )
    return sizes[0][1]


def _vmap_call(f, arg_leaves, arg_treedef, dim_leaves, size, kwargs, out_dims, randomness,
               call, originals):
    level = new_level(Batched, length=size, call=call, randomness=randomness)
    with transform_scope(level):
        wrapped = [as_tensor(leaf if d is None else level.wrap_input(leaf, d % len(leaf.shape)))
                   for leaf, d in zip(arg_leaves, dim_leaves)]
        with user_code():
            out = f(*pytree.tree_unflatten(arg_treedef, wrapped), **kwargs)
        out_values = _output_values(out)
    # the batched inputs that f wrote in place
    written = {id(t): (t, original, d) for t, original, d in zip(wrapped, originals, dim_leaves)
               if d is not None and type(t) is FuncTensor and t._generation}
    if written:
        _refuse_aliased_writes(wrapped, originals, call)
    for tensor, original, d in written.values():
        _write_back([tensor], [original], lambda v, d=d: level.lower_to_dim(v, d), call)
    result = _unbatch_outputs(level, out_values, out_dims, size, call, _function_name(f))
    if written:
        result = _alias_written_inputs(out, result, written, out_dims)
    if type(out) is FuncTensor and out._view is None:
        return result  # (the common case: one output, not a view)
    return _views_are_fresh_tensors(out, result, arg_leaves)


def _transpose_of_a_number(leaf):
    """torch.func's one exception: the transpose of 0-d examples returns its input itself
    (its batching rule keeps PyTorch's special case of a 0-d tensor's transpose(0, -1))."""
    name = getattr(leaf._view.func, "__name__", "")
    return leaf.dim() == 0 and name.split(".")[0] in ("transpose", "swapaxes", "swapdims")


def _views_are_fresh_tensors(out, result, arg_leaves):
    """A view op that changes nothing (``squeeze`` of a tensor with no dim of size 1) gives
    back its input's value, so the result would be the caller's tensor itself; in torch (and
    torch.func) a view op returns a new tensor, a view of its input (``y._base is x``). So an
    output that a view op made, and that came out as one of the inputs, becomes an alias."""
    out_leaves = pytree.tree_leaves(out, none_is_leaf=False)
    if not any(type(leaf) is FuncTensor and leaf._view is not None for leaf in out_leaves):
        return result  # (no output is a view: the common case)
    result_leaves, treedef = pytree.tree_flatten(result, none_is_leaf=False)
    if len(out_leaves) != len(result_leaves):
        return result

    def identity(t):  # (a FuncTensor input comes back as another FuncTensor of its value)
        return id(value_of(t)) if type(t) is FuncTensor else id(t)
    inputs = {identity(leaf) for leaf in arg_leaves if isinstance(leaf, (torch.Tensor, Value))}
    changed = False
    for position, (leaf, tensor) in enumerate(zip(out_leaves, result_leaves)):
        if type(leaf) is FuncTensor and leaf._view is not None and identity(tensor) in inputs \
                and not _transpose_of_a_number(leaf):
            tensor = as_tensor(tensor)  # (inside another vmap: a view that it sees as one)
            result_leaves[position] = tensor.view_as(tensor)
            changed = True
    return pytree.tree_unflatten(treedef, result_leaves) if changed else result


# --- NOTE [vmap over a nested tensor] ------------------------------------------------------------
# A nested tensor holds examples of different shapes (``torch.nested``), so no batch dim can
# hold them: vmap maps f over its components, one at a time, as torch.func's fallback for
# nested tensors does (BatchedFallback.cpp: unbind, call, re-nest). Here each example runs on
# a Batched level of length 1, whose values are the component with a batch dim of size 1:
# the level then tells which outputs vary over the examples (they become one nested tensor,
# in torch's strided layout, as torch.func returns) from those that do not (expanded along the
# batch, as any vmap output). The components keep their autograd history (``unbind``,
# ``as_nested_tensor``), so a nested input that requires grad gives an output that does.
# torch.func's limits are kept, with its words: the nested inputs and the outputs are mapped
# over dim 0 only, and a vmap inside one over a nested tensor raises. A dense input batched
# alongside may have its batch dim anywhere (torch.func's fallback refuses one not at dim 0
# where an op reaches the fallback with it, and runs others: here all run).
def _is_nested(leaf) -> bool:
    return isinstance(leaf, torch.Tensor) and leaf.is_nested  # (jagged ones are a subclass)


def _refuse_a_vmap_inside_a_nested_one(arg_leaves, dim_leaves, call):
    for leaf, d in zip(arg_leaves, dim_leaves):
        value = leaf
        while isinstance(value, Value) and d is not None:
            if value.dispatcher.over_nested:
                raise NestedTensorError(
                    f"{call}: Only one level of vmap is supported when vmapping over nested "
                    "tensors: this vmap runs inside one over a nested tensor. Fix: vmap once "
                    "over the nested tensor, and write the inner loop inside the function.")
            value = value.payload


def _vmap_nested(f, arg_leaves, arg_treedef, dim_leaves, kwargs, out_dims, randomness, call):
    """vmap of ``f`` over the components of the nested inputs (the NOTE above)."""
    sizes = set()
    for leaf, d in zip(arg_leaves, dim_leaves):
        if d is None:
            continue
        if _is_nested(leaf) and d != 0:
            raise NestedTensorError(
                f"{call}: Nested tensors can only be vmapped over dim=0, but got dim={d}. "
                "Fix: use in_dims=0 for a nested tensor (its components are the examples).")
        if not _is_array(leaf):
            sizes.add(None)
        else:
            sizes.add(leaf.size(0) if _is_nested(leaf) else leaf.size(d))
    out_leaves_of_dims = pytree.tree_leaves(out_dims, none_is_leaf=True)
    for d in out_leaves_of_dims:
        if d is not None and d != 0:
            raise NestedTensorError(
                f"{call}: Nested tensors can only be vmapped over dim=0, but got dim={d} in "
                "out_dims. Fix: use out_dims=0; a nested output holds one example per "
                "component.")
    if len(sizes) != 1 or None in sizes:
        raise TransformUsageError(
            f"{call}: Expected all tensors to have the same size in the mapped dimension, got "
            f"{sorted(s for s in sizes if s is not None)} (a nested tensor's size is its "
            "number of components). Fix: give every batched input as many examples.")
    size = sizes.pop()
    components = [leaf.unbind(0) if _is_nested(leaf) and d is not None else None
                  for leaf, d in zip(arg_leaves, dim_leaves)]
    per_example, treedef = [], None
    for i in range(size):
        level = new_level(Batched, length=1, call=call, randomness=randomness)
        level.over_nested = True
        with transform_scope(level):
            wrapped = []
            for leaf, d, parts in zip(arg_leaves, dim_leaves, components):
                if d is None:
                    wrapped.append(as_tensor(leaf))
                    continue
                if parts is not None:  # component i, with a batch dim of size 1
                    wrapped.append(as_tensor(level.wrap_input(ops.unsqueeze(parts[i], 0), 0)))
                else:  # a dense input batched along any dim: example i keeps that dim
                    d = d % leaf.dim()
                    example = ops.getitem(leaf, (slice(None),) * d + (slice(i, i + 1),))
                    wrapped.append(as_tensor(level.wrap_input(example, d)))
            with user_code():
                out = f(*pytree.tree_unflatten(arg_treedef, wrapped), **kwargs)
            if any(type(t) is FuncTensor and t._generation for t in wrapped):
                raise NestedTensorError(
                    f"{call}: an in-place write to an input of a vmap over a nested tensor "
                    "is not supported here. Fix: compute a new tensor (x = x + y, not "
                    "x += y).")
            out = _output_values(out)
        leaves, treedef = pytree.tree_flatten(out, none_is_leaf=True)
        per_example.append([None if leaf is None else
                            ops.squeeze(level.lower(leaf), 0)
                            if isinstance(leaf, BatchedValue) and leaf.dispatcher is level
                            else (leaf, "unbatched") for leaf in leaves])
    outputs = []
    for position in range(len(per_example[0])):
        column = [example[position] for example in per_example]
        if column[0] is None:
            outputs.append(None)
        elif all(type(c) is tuple for c in column):  # the same tensor for every example
            shared = column[0][0]
            outputs.append(ops.expand(ops.unsqueeze(shared, 0), size, *ops.shape_of(shared)))
        else:
            outputs.append(torch.nested.as_nested_tensor(
                [bottom_tensor(c[0] if type(c) is tuple else c) for c in column],
                layout=torch.strided))
    return pytree.tree_unflatten(treedef, outputs)


def _alias_written_inputs(out, result, written, out_dims):
    """NOTE [An input written in place and returned is the caller's tensor]
    ``vmap(Tensor.sin_)(x)`` writes ``x`` (NOTE [In-place writes to a transform's inputs]) and
    returns it: in torch.func the result *is* ``x`` (or, with another out_dim, a view of it
    with the batch dim moved), so a later write to ``x`` shows in the result. The same here:
    an output that is an input the function wrote in place becomes the caller's tensor. An
    output that is a view of such an input (``vmap(vmap(Tensor.sin_, in_dims=1))``: the inner
    vmap returns its input with the batch dim moved, a view) becomes the same view of the
    caller's tensor: its view ops, which the FuncTensors remember (NOTE [Views that outlive a
    write] in tensor.py), are replayed on the caller's tensor by a vmap, whose view rules
    return views."""
    out_dims = _single_out_dim(out, out_dims)
    if not isinstance(out_dims, int):
        return result  # (per-output out_dims: the result keeps its own copy)
    out_leaves = pytree.tree_leaves(out, none_is_leaf=False)
    result_leaves, treedef = pytree.tree_flatten(result, none_is_leaf=False)
    for position, leaf in enumerate(out_leaves):
        chain, alias = _views_of_a_written_input(leaf, written)
        if alias is None:
            continue
        _, original, in_dim = alias
        rank = original.dim()
        in_dim, out_dim = in_dim % rank, out_dims % rank
        if not chain:
            result_leaves[position] = original if in_dim == out_dim else \
                original.movedim(in_dim, out_dim)
            continue
        aliased = _replay_views(chain, original, in_dim, out_dim)
        if aliased is not None and aliased.shape == result_leaves[position].shape:
            result_leaves[position] = aliased
    return pytree.tree_unflatten(treedef, result_leaves)


def _views_of_a_written_input(leaf, written):
    """(the view records from the written input down to ``leaf``, the input's entry in
    ``written``), or ((), None) when ``leaf`` is not a view of one."""
    chain, node = [], leaf
    alias = written.get(id(node))
    while alias is None and type(node) is FuncTensor and node._view is not None:
        view = node._view
        if view.generation != view.base._generation:
            return (), None  # the base was written after this view was taken
        chain.append(view)
        node = view.base
        alias = written.get(id(node))
    return chain[::-1], alias


def _replay_views(chain, original, in_dim, out_dim):
    """The views of ``chain``, per example, on the caller's tensor: a view of it, or None."""
    if type(original) is FuncTensor or any(
            isinstance(a, torch.Tensor) for view in chain
            for a in pytree.tree_leaves((view.args, view.kwargs))):
        return None  # (view ops take sizes and dims; a tensor argument is not replayed)

    def replay(example):
        for view in chain:
            example = view.replay(example)
        return example
    try:
        aliased = as_tensor(_vmap(replay, in_dim, out_dim, "error", None, (original,), {}))
    except TransformError:
        return None
    return aliased if aliased.untyped_storage().data_ptr() == \
        original.untyped_storage().data_ptr() else None


def _single_out_dim(out, out_dims):
    """``out_dims=(1,)`` for a function that returns one tensor means ``out_dims=1``, as in
    torch.func."""
    if isinstance(out_dims, tuple) and len(out_dims) == 1 and not isinstance(out, (tuple, list)):
        return out_dims[0]
    return out_dims


def _unbatch_outputs(level, out, out_dims, size, call, name):
    out_dims = _single_out_dim(out, out_dims)
    # None is a leaf here, as in _broadcast_dims, so that leaves and dims stay aligned:
    # vmap(lambda x: (None, x), out_dims=(None, 0))
    out_leaves, out_treedef = pytree.tree_flatten(out, none_is_leaf=True)
    dims = _broadcast_dims(out_dims, out, call, "out_dims") if not isinstance(out_dims, int) \
        else [out_dims] * len(out_leaves)
    result = []
    for leaf, dim in zip(out_leaves, dims):
        if leaf is None:
            # torch.func refuses None where out_dim is an int; here it passes through, since
            # a custom_vjp backward says "no gradient" with None and runs under vmap (custom.py),
            # unless the function returned nothing at all
            if out is None:
                raise TransformUsageError(
                    f"{call}: `{name}` must only return Tensors, got type {type(None)}. The "
                    "function returned None. Fix: return the tensors it computes."
                )
            result.append(None)
            continue
        batched = isinstance(leaf, BatchedValue) and leaf.dispatcher is level
        if batched and dim == 0:  # (the common case: every check below holds)
            result.append(move_bdim(leaf.payload, leaf.bdim, 0))
            continue
        if dim is None:
            if batched:
                raise TransformUsageError(
                    f"{call}: `{name}` can not return a BatchedTensor when "
                    "out_dim is None: out_dims is None for an output that varies over the "
                    "batch. Fix: give it an int out_dim."
                )
            result.append(leaf)
            continue
        if not _is_array(leaf):
            raise TransformUsageError(
                f"{call}: `{name}` must only return Tensors, got type "
                f"{type(leaf)}. Did you mean to set out_dims= to None for output? Fix: return "
                "tensors, or use out_dims=None for that output."
            )
        rank = len(leaf.shape) + 1
        if not -rank <= dim < rank:
            raise DimOutOfRangeError(
                f"{call}: Dimension out of range (expected to be in range of [{-rank}, "
                f"{rank - 1}], but got {dim}): out_dims={dim} for an output with {rank} dims, "
                "the batch dim included. Fix: use an out_dim in that range."
            )
        dim %= rank
        if batched:
            result.append(move_bdim(leaf.payload, leaf.bdim, dim))
        else:  # the same for every example: broadcast it along a new batch dim
            shape = list(leaf.shape)
            shape.insert(dim, size)
            result.append(ops.expand(ops.unsqueeze(leaf, dim), *shape))
    return pytree.tree_unflatten(out_treedef, result)


def _concatenate_chunks(outputs, out_dims, call):
    out_dims = _single_out_dim(outputs[0], out_dims)
    leaves_per_chunk = [pytree.tree_flatten(o, none_is_leaf=True)[0] for o in outputs]
    treedef = pytree.tree_structure(outputs[0], none_is_leaf=True)
    if isinstance(out_dims, int):
        dims = [out_dims] * len(leaves_per_chunk[0])
    else:
        dims = _broadcast_dims(out_dims, outputs[0], call, "out_dims")
    merged = []
    for position, dim in enumerate(dims):
        pieces = [leaves[position] for leaves in leaves_per_chunk]
        merged.append(pieces[0] if dim is None or pieces[0] is None else ops.cat(pieces, dim))
    return pytree.tree_unflatten(treedef, merged)


def functionalize(f, *, remove="mutations"):
    """torch.func's ``functionalize``: ``f`` with its in-place ops (and with
    ``remove='mutations_and_views'``, its views) turned into out-of-place ones; a write to an
    input still reaches the caller's tensor at the end.

    NOTE [functionalize is the engine's own behaviour]
    torch needs functionalize because its tensors are mutable storage: its tracers and
    compilers want programs without writes. Here no transform ever writes into a value: an
    in-place op on a FuncTensor swaps a new value in (tensor.py, ``_write``), and a view is
    replayed from its base; ``trace`` records the out-of-place ops, and writes to a
    transform's inputs are copied back when it returns (NOTE [In-place writes to a
    transform's inputs]). So there is nothing left to remove: ``functionalize(f)`` checks its
    argument and calls ``f``, and ``trace(functionalize(f))`` shows a program without writes,
    as ``trace(f)`` does. In torch this is the Functionalize dispatch key.

    >>> import torch
    >>> from minifunctorch.core import functionalize, grad
    >>> def f(x):
    ...     y = x.clone()
    ...     y.mul_(2.0)
    ...     return y.sum()
    >>> grad(functionalize(f))(torch.ones(2))
    tensor([2., 2.])
    """
    if remove not in ("mutations", "mutations_and_views"):
        raise InvalidOptionError(
            f"functionalize({_function_name(f)}, remove={remove!r}): functionalize(f, "
            f"remove='mutations'): received invalid argument for remove={remove}. Valid "
            "options are 'mutations' and 'mutations_and_views'. Fix: pass one of those."
        )

    @functools.wraps(f)
    def functionalized(*args, **kwargs):
        return f(*args, **kwargs)
    return functionalized


def debug_unwrap(tensor, *, recurse=True):
    """The tensor under a transform's value, for looking at it in a debugger (torch.func's
    ``debug_unwrap``): with ``recurse=True`` the plain tensor at the bottom (a batched value
    shows its batch dims), else the value one level down. Computing with the result inside
    the transformed function escapes the transform: use it to look, not to compute.

    >>> import torch
    >>> from minifunctorch.core import debug_unwrap, vmap
    >>> shapes = []
    >>> _ = vmap(lambda x: shapes.append(tuple(debug_unwrap(x).shape)) or x)(torch.ones(2, 3))
    >>> shapes
    [(2, 3)]
    """
    value = unwrap(tensor)
    if not isinstance(value, Value):
        return tensor
    return bottom_tensor(value) if recurse else as_tensor(value.payload)


# --- Jacobians and Hessians: compositions ------------------------------------------------------
# NOTE [Compositions call the inner transforms' bodies]
# jacrev is vmap of a vjp function and jacfwd vmap of jvp, and they say so in code. They call
# the bodies (_vjp, _vmap, _jvp) rather than the public functions: those would build a
# functools.wraps wrapper and check their arguments again on every call, which is a tenth of
# the time of a small Jacobian.
def _refuse_complex_inputs(transform, selected, call, what="inputs"):
    """torch.func's jacrev and jacfwd compute real Jacobians only, of real inputs and real
    outputs, and say so (in the same words for both)."""
    for index, leaf in enumerate(pytree.tree_leaves(selected)):
        if _is_array(unwrap(leaf)) and unwrap(leaf).dtype.is_complex:
            raise InputDtypeError(
                f"{call}: {transform}: Expected all {what} to be real but received complex "
                f"tensor at flattened input idx: {index}. A Jacobian here is real. Fix: "
                "differentiate the real and imaginary parts (torch.view_as_real)."
            )


def _reshaped(t, shape):
    """``t.reshape(shape)``, or ``t`` itself where it has that shape already: a Jacobian of
    a 1-D output is its rows as they are, and under an outer vmap a reshape is an op of it
    (and a view to record) that changes nothing."""
    return t if tuple(t.shape) == shape else t.reshape(shape)


def _identity_basis(leaves):
    """The rows of an identity matrix, split into one block per leaf and shaped like it.

    Returns ``(basis, sizes)``: ``basis[i]`` has shape ``(total, *leaves[i].shape)``. Row k
    is the k-th unit vector of all the leaves flattened and concatenated.
    """
    sizes = [math.prod(leaf.shape) for leaf in leaves]
    total = sum(sizes)
    # (an identity that jit's programs may compute with by its diagonal: NOTE [An identity
    # basis is a diagonal matrix] in passes.py)
    rows = identity_basis(total, leaves[0].dtype, leaves[0].device)
    if len(leaves) == 1:  # the identity itself: no block to slice out (a slice costs ~5 µs)
        return [_reshaped(rows, (total, *leaves[0].shape))], sizes
    basis, start = [], 0
    for leaf, size in zip(leaves, sizes):
        basis.append(rows[:, start:start + size].reshape((total, *leaf.shape)))
        start += size
    return basis, sizes


def jacrev(f, argnums=0, *, has_aux=False, chunk_size=None, _preallocate_and_copy=False):
    """The Jacobian by reverse mode: ``vmap`` of the vjp function over identity rows.
    (``_preallocate_and_copy`` is torch.func's memory strategy for chunks; it is accepted and
    changes nothing here: the chunks are concatenated.)

    >>> import torch
    >>> from minifunctorch.core import jacrev
    >>> jacrev(torch.sin)(torch.zeros(2))
    tensor([[1., 0.],
            [0., 1.]])
    """
    if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size < 1):
        raise TransformUsageError(
            f"jacrev({_function_name(f)}, chunk_size={chunk_size!r}): jacrev: `chunk_size` "
            "should be greater than 0. It is the number of Jacobian rows computed at once. "
            "Fix: pass a positive int, or None for all rows at once."
        )

    @functools.wraps(f)
    def jacrev_f(*args):
        if dynamo_traces():  # NOTE [Transforms under torch.compile] (compile_boundary.py)
            return outside_the_graph(jacrev_f, args, {})
        with engine_code():
            return _jacrev(f, argnums, has_aux, chunk_size, args)
    return jacrev_f


def _jacrev(f, argnums, has_aux, chunk_size, args):
    call = describe_call("jacrev", f)
    argnums_ = _normalize_argnums(argnums, len(args), call)
    selected = [args[a] for a in argnums_]
    _refuse_complex_inputs("jacrev", selected, call)
    result, write_back_fixed = _vjp_of_selected(f, args, has_aux, argnums_)
    try:
        return _jacobian_by_rows(f, argnums, has_aux, chunk_size, result, call)
    finally:
        write_back_fixed()


def _jacobian_by_rows(f, argnums, has_aux, chunk_size, result, call):
    out, vjp_fn = result[0], result[1]
    out_leaves, out_treedef = pytree.tree_flatten(out)
    _refuse_complex_inputs("jacrev", out_leaves, call, "outputs")
    basis, sizes = _identity_basis(out_leaves)

    def pull_back(*basis_leaves):
        return vjp_fn(pytree.tree_unflatten(out_treedef, list(basis_leaves)))
    pull_back.__name__ = f"vjp_fn of {_function_name(f)}"

    # vmap(pull_back, chunk_size=chunk_size)(*basis): (total, *in_shape) leaves
    if chunk_size == 1:
        # torch.func pulls back one row at a time here, without vmap, so that a backward
        # with data-dependent ops (nonzero, .item()) works (pytorch/pytorch issue 127036)
        total = ops.shape_of(basis[0])[0]
        rows = [pull_back(*[b[i] for b in basis]) for i in range(total)]
        per_input = as_tensors(pytree.tree_map(lambda *r: ops.stack(list(r)), *rows))
    else:
        per_input = as_tensors(_vmap(pull_back, 0, 0, "error", chunk_size, tuple(basis), {}))
    jacobians = []
    for o_index, (o, n) in enumerate(zip(out_leaves, sizes)):
        offset = sum(sizes[:o_index])

        def block(g, o=o, n=n, offset=offset):
            rows = g if len(sizes) == 1 else g[offset:offset + n]
            return _reshaped(rows, (*o.shape, *g.shape[1:]))
        per_arg = tuple(pytree.tree_map(block, tree) for tree in per_input)
        jacobians.append(per_arg[0] if isinstance(argnums, int) else per_arg)
    jacobian = pytree.tree_unflatten(out_treedef, jacobians)
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
        if dynamo_traces():  # NOTE [Transforms under torch.compile] (compile_boundary.py)
            return outside_the_graph(jacfwd_f, args, {})
        with engine_code():
            return _jacfwd(f, argnums, has_aux, randomness, args)
    return jacfwd_f


def _jacfwd(f, argnums, has_aux, randomness, args):
    call = describe_call("jacfwd", f)
    argnums_ = _normalize_argnums(argnums, len(args), call)
    selected = tuple(args[a] for a in argnums_)
    in_leaves, in_treedef = _flatten_arrays(selected, call, "a differentiated argument")
    _refuse_complex_inputs("jacfwd", selected, call)
    basis, sizes = _identity_basis(in_leaves)

    def push_forward(*basis_leaves):
        tangents = pytree.tree_unflatten(in_treedef, list(basis_leaves))
        with engine_code():  # vmap runs this as user code; _jvp is the engine's
            result = _jvp(f, selected, tangents, has_aux, fixed=(args, argnums_))
        return (result[1], result[2]) if has_aux else result[1]
    push_forward.__name__ = f"jvp of {_function_name(f)}"

    out_dims = (-1, 0) if has_aux else -1
    # vmap(push_forward, out_dims=out_dims, randomness=randomness)(*basis)
    pushed = as_tensors(_vmap(push_forward, 0, out_dims, randomness, None, tuple(basis), {}))
    tangents_out, aux = pushed if has_aux else (pushed, None)
    _refuse_complex_inputs("jacfwd", tangents_out, call, "outputs")

    def split(t):  # t: (*out_shape, total) -> per input leaf (*out_shape, *in_shape)
        out_shape = tuple(t.shape[:-1])
        blocks, begin = [], 0
        for x, n in zip(in_leaves, sizes):
            columns = t if len(sizes) == 1 else t[..., begin:begin + n]
            blocks.append(_reshaped(columns, (*out_shape, *x.shape)))
            begin += n
        per_arg = pytree.tree_unflatten(in_treedef, blocks)
        return per_arg[0] if isinstance(argnums, int) else per_arg
    jacobian = pytree.tree_map(split, tangents_out)
    if has_aux:
        return jacobian, pytree.tree_map(lambda a: a[0], aux)
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

