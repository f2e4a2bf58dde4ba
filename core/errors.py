"""The package's exceptions.

Every misuse raises a subclass of :class:`TransformError`. A message starts with the call as
the user wrote it (``vmap(f, in_dims=(0,))(<inputs>): ...``), then gives torch.func's own
words for the case (the words people search for), then says what was got and why, and ends
with ``Fix: ...``. Tests match messages by regex, so keep them stable.

NOTE [Which builtin exception each error is]
torch.func raises builtin exceptions: ``RuntimeError`` for bad ``argnums``, for what ``grad``,
``vjp`` and ``jvp`` find wrong in a function's outputs and in primals/tangents/cotangents;
``ValueError`` for ``vmap``'s ``in_dims``/``out_dims``/``chunk_size`` and for non-tensor
arguments of ``grad``; ``IndexError`` for an ``out_dims`` out of range. Code written against
torch.func catches those, so each class here also derives from the builtin torch.func raises
in its case, and a test (tests/test_torchfunc_errors.py) runs each misuse on both and checks
the types agree.

``TransformUsageError`` was a ``ValueError`` before this table existed, and code outside the
transforms (ops, layers, widgets) still raises it where a ``ValueError`` is right. The cases
that torch.func raises as another builtin got their own subclasses (``ArgnumsError``,
``FunctionOutputError``, ``TangentsError``, ...): they derive from that builtin *and* from
``TransformUsageError``, so ``except RuntimeError`` (torch.func's contract) and ``except
TransformUsageError`` (this package's older one) both catch them. The price: such an error is
also a ``ValueError``, which torch.func's is not. JAX makes the other choice, its own
exception types with no builtin parent for most misuse (``jax.errors``); we keep the
builtins because the oracle here is torch.func.
"""


class TransformError(Exception):
    """Base class of every error raised by minifunctorch."""


class TransformUsageError(TransformError, ValueError):
    """A transform was called with arguments it cannot accept (argnums, in_dims, shapes...).

    It is a ``ValueError``, as torch.func's errors for ``vmap``'s ``in_dims``, ``out_dims`` and
    ``chunk_size`` and for non-tensor arguments are. Its subclasses below cover the cases that
    torch.func raises as other builtins."""


class ArgnumsError(TransformUsageError, RuntimeError):
    """``argnums`` is not an int or a tuple of distinct ints in range (torch.func:
    ``RuntimeError``)."""


class FunctionOutputError(TransformUsageError, RuntimeError):
    """The transformed function returned something grad/vjp/jvp cannot use: a non-tensor, or
    not an ``(output, aux)`` pair with ``has_aux=True`` (torch.func: ``RuntimeError``)."""


class NonScalarOutputError(FunctionOutputError):
    """grad was asked to differentiate a function whose output is not a scalar."""


class TangentsError(TransformUsageError, RuntimeError):
    """jvp's primals and tangents, linearize's tangents or vjp_fn's cotangents do not match
    (structure, shape, dtype) or are not tensors (torch.func: ``RuntimeError``)."""


class CotangentTypeError(TangentsError, TypeError):
    """vjp_fn got a cotangent that is not a tensor (torch.func: ``TypeError``)."""


class InvalidOptionError(TransformUsageError, RuntimeError):
    """A keyword option outside its choices, where torch.func raises RuntimeError."""


class ShapeMismatchError(TransformUsageError, RuntimeError):
    """An op's tensors have shapes it cannot combine (torch raises RuntimeError)."""


class NestedTensorError(TransformUsageError, RuntimeError):
    """vmap over a nested tensor in a way torch.func refuses: a dim other than 0, a second
    vmap level, or a dense input batched along another dim (torch.func: ``RuntimeError``)."""


class InputDtypeError(TransformUsageError, RuntimeError):
    """An input of a dtype the transform cannot differentiate: grad/vjp/jacrev of an integer
    tensor, jacrev/jacfwd of a complex one (torch.func: ``RuntimeError``; for an integer
    primal of jvp it raises ``ValueError``, a plain ``TransformUsageError`` here)."""


class DimOutOfRangeError(TransformUsageError, IndexError, RuntimeError):
    """A dim out of range: of an op, or vmap's ``out_dims`` naming a dim the output does not
    have. torch raises ``IndexError``; torch.func's vmap raises that or ``RuntimeError``
    (its batching rules of an op on 0-d examples), so this is both."""


class MissingRuleError(TransformError, NotImplementedError):
    """An operation has no rule for the transform that is running."""


class UnsupportedOperationError(TransformError, NotImplementedError):
    """A torch function or tensor method that minifunctorch does not model was called."""


class BatchedControlFlowError(TransformError, RuntimeError):
    """Python tried to read a concrete value (bool(), .item()) from a batched value."""


class RandomnessError(TransformError, RuntimeError):
    """A random operation ran under vmap(randomness='error')."""


class RandomnessOptionError(RandomnessError, TransformUsageError):
    """``randomness=`` is not 'error', 'same' or 'different' (torch.func: ``RuntimeError``)."""


class SavedTensorHooksError(TransformError, RuntimeError):
    """grad, vjp and jacrev under saved-tensor hooks (``save_on_cpu``), which torch.func
    refuses with a RuntimeError."""


class AnomalyError(TransformError, RuntimeError):
    """Under ``torch.autograd.set_detect_anomaly(True)``, a vjp rule returned NaN (torch's
    anomaly mode raises a RuntimeError)."""


class InPlaceError(TransformError, RuntimeError):
    """An in-place operation was applied to a value wrapped by a transform."""


class TypecheckError(TransformError, TypeError):
    """A program's equation does not have the type its shape rule derives."""


def missing_rule_error(prim, table, transform) -> MissingRuleError:
    """The error every level raises when ``prim`` has no rule in its ``table``."""
    return MissingRuleError(
        f"{transform}: the primitive '{prim.name}' has no {table} rule, so {transform} cannot "
        f"handle it. Fix: register one ({table}_rules[{prim.name}_p] = ...), or wrap the "
        "computation in a custom_vjp function that supplies its backward."
    )
