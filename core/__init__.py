"""minifunctorch.core: composable function transforms over PyTorch tensors.

The public names, re-exported. Read the modules in this order to follow the course:
primitives -> values -> ops -> dispatch -> autograd, forward, batching -> transforms; then
tensor (with torch_api and aten_api) for how user code reaches the engine.
"""
from .autograd import Autograd, AutogradValue, BackwardStep, Tape, TapeEntry, capture_tapes, vjp_rules
from .batching import Batched, BatchedValue, batching_rules, capture_fallbacks
from .custom import custom_vjp
# families of primitives: importing each registers its primitives, rules and doors
from . import complex_numbers, elementwise, fft, indexing, linalg, nn, structural  # noqa: F401
from . import einsum, recurrent  # noqa: F401  (torch.einsum; recurrent layers)
from . import randomness  # noqa: F401  (torch.rand & co under vmap)
from . import autograd_function  # noqa: F401  (torch.autograd.Function under the transforms)
from .autograd_function import AutogradFunctionError
from .dispatch import Dispatcher, Logger, LoggedValue, Torch
from .tensor import FuncTensor, bind
from .values import Value
from .errors import (
    ArgnumsError,
    BatchedControlFlowError,
    CotangentTypeError,
    DimOutOfRangeError,
    FunctionOutputError,
    InPlaceError,
    InputDtypeError,
    InvalidOptionError,
    MissingRuleError,
    NonScalarOutputError,
    RandomnessError,
    RandomnessOptionError,
    NestedTensorError,
    SavedTensorHooksError,
    AnomalyError,
    ShapeMismatchError,
    TangentsError,
    TransformError,
    TransformUsageError,
    TypecheckError,
    UnsupportedOperationError,
)
from .forward import Forward, ForwardValue, jvp_rules
from .names import label, reset_names
from .ir import Equation, Literal, Var
from .program import Program
from .tracing import TracerValue, Tracing, trace
from .source_to_source import split_vjp, vjp_program
from .passes import simplify
from .jit import jit
from .primitives import PRIMITIVES, Primitive
from .modules import (
    ModuleArgumentError,
    ModuleAttributeError,
    ModuleStateError,
    ModuleTypeError,
    functional_call,
    replace_all_batch_norm_modules_,
    stack_module_state,
)
from .compat import combine_state_for_ensemble, make_functional, make_functional_with_buffers
from .transforms import (
    chunk_vmap,
    debug_unwrap,
    functionalize,
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
    "Autograd", "AutogradFunctionError", "BackwardStep", "Batched", "BatchedControlFlowError",
    "Dispatcher", "Forward",
    "FuncTensor", "InPlaceError", "Logger", "MissingRuleError", "NonScalarOutputError",
    "PRIMITIVES", "Primitive", "RandomnessError", "Tape", "TapeEntry", "Torch",
    "TransformError", "TransformUsageError", "TypecheckError", "UnsupportedOperationError",
    "batching_rules", "bind", "capture_tapes", "chunk_vmap", "custom_vjp", "debug_unwrap",
    "functional_call", "functionalize", "grad",
    "grad_and_value", "hessian", "jacfwd", "jacrev", "jvp", "jvp_rules", "label", "linearize",
    "stack_module_state", "replace_all_batch_norm_modules_", "make_functional",
    "make_functional_with_buffers", "combine_state_for_ensemble", "ModuleArgumentError",
    "ModuleAttributeError", "ModuleStateError", "ModuleTypeError",
    "reset_names", "vjp", "vjp_rules", "vmap", "trace", "Program", "Var", "Literal",
    "Equation", "Tracing", "TracerValue", "split_vjp", "vjp_program", "simplify", "jit",
    "Value", "AutogradValue", "BatchedValue", "ForwardValue", "LoggedValue", "capture_fallbacks",
    "ArgnumsError", "CotangentTypeError", "DimOutOfRangeError", "FunctionOutputError",
    "InputDtypeError", "InvalidOptionError", "RandomnessOptionError", "ShapeMismatchError",
    "NestedTensorError", "SavedTensorHooksError", "AnomalyError",
    "TangentsError",
]
