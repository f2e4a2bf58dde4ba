"""minifunctorch.core: composable function transforms over PyTorch tensors.

The public names, re-exported. Read the modules in this order to follow the course:
primitives -> dispatch -> ops/torch_api -> autograd, forward, batching -> transforms.
"""
from .autograd import Autograd, BackwardStep, Tape, TapeEntry, capture_tapes, vjp_rules
from .batching import Batched, batching_rules
from .custom import custom_vjp
from .dispatch import Dispatcher, FuncTensor, Logger, Torch, bind
from .errors import (
    BatchedControlFlowError,
    InPlaceError,
    MissingRuleError,
    NonScalarOutputError,
    RandomnessError,
    TransformError,
    TransformUsageError,
    TypecheckError,
    UnsupportedOperationError,
)
from .forward import Forward, jvp_rules
from .names import label, reset_names
from .program import Equation, Literal, Program, Var
from .tracing import TracerTensor, Tracing, trace
from .source_to_source import split_vjp, vjp_program
from .passes import simplify
from .jit import jit
from .primitives import PRIMITIVES, Primitive
from .transforms import (
    functional_call,
    grad,
    grad_and_value,
    hessian,
    jacfwd,
    jacrev,
    jvp,
    linearize,
    vjp,
    vmap,
)

__all__ = [
    "Autograd", "BackwardStep", "Batched", "BatchedControlFlowError", "Dispatcher", "Forward",
    "FuncTensor", "InPlaceError", "Logger", "MissingRuleError", "NonScalarOutputError",
    "PRIMITIVES", "Primitive", "RandomnessError", "Tape", "TapeEntry", "Torch",
    "TransformError", "TransformUsageError", "TypecheckError", "UnsupportedOperationError",
    "batching_rules", "bind", "capture_tapes", "custom_vjp", "functional_call", "grad",
    "grad_and_value", "hessian", "jacfwd", "jacrev", "jvp", "jvp_rules", "label", "linearize",
    "reset_names", "vjp", "vjp_rules", "vmap", "trace", "Program", "Var", "Literal",
    "Equation", "Tracing", "TracerTensor", "split_vjp", "vjp_program", "simplify", "jit",
]
