"""The package's exceptions.

Every misuse raises a subclass of :class:`TransformError`. A message starts with the call as
the user wrote it (``vmap(f, in_dims=(0,))(<inputs>): ...``), then says what was expected,
what was got, and how to fix it. Tests match messages by regex, so keep them stable.

Each subclass also derives from the builtin exception a Python user would expect
(``ValueError`` for bad values, ``NotImplementedError`` for missing rules, ...), so that
``except ValueError`` keeps working around code that uses minifunctorch.
"""


class TransformError(Exception):
    """Base class of every error raised by minifunctorch."""


class TransformUsageError(TransformError, ValueError):
    """A transform was called with arguments it cannot accept (argnums, in_dims, shapes...)."""


class NonScalarOutputError(TransformError, ValueError):
    """grad was asked to differentiate a function whose output is not a scalar."""


class MissingRuleError(TransformError, NotImplementedError):
    """An operation has no rule for the transform that is running."""


class UnsupportedOperationError(TransformError, NotImplementedError):
    """A torch function or tensor method that minifunctorch does not model was called."""


class BatchedControlFlowError(TransformError, RuntimeError):
    """Python tried to read a concrete value (bool(), .item()) from a batched value."""


class RandomnessError(TransformError, RuntimeError):
    """A random operation ran under vmap(randomness='error')."""


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
