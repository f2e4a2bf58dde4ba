"""Shared notation for tapes, logs and programs: types read ``f32[4]``, equations
``v3:f32[4] = mul v1 v2``. One notation, used by the tape, the Logger and the Program printer.
"""
import torch

DTYPE_SHORT_NAMES = {
    torch.float16: "f16",
    torch.bfloat16: "bf16",
    torch.float32: "f32",
    torch.float64: "f64",
    torch.complex64: "c64",
    torch.complex128: "c128",
    torch.int8: "i8",
    torch.int16: "i16",
    torch.int32: "i32",
    torch.int64: "i64",
    torch.uint8: "u8",
    torch.bool: "bool",
}


def type_string(dtype, shape) -> str:
    """``f32[4,3]`` for a float32 tensor of shape (4, 3); ``f32[]`` for a scalar."""
    short = DTYPE_SHORT_NAMES.get(dtype, str(dtype).replace("torch.", ""))
    return f"{short}[{','.join(str(int(size)) for size in shape)}]"


def format_param(value) -> str:
    if isinstance(value, torch.dtype):
        return DTYPE_SHORT_NAMES.get(value, str(value))
    if isinstance(value, tuple):
        return "(" + ",".join(format_param(v) for v in value) + ("," if len(value) == 1 else "") + ")"
    if isinstance(value, slice):
        parts = ["" if p is None else str(p) for p in (value.start, value.stop)]
        text = ":".join(parts)
        return text + (f":{value.step}" if value.step not in (None, 1) else "")
    if value is Ellipsis:
        return "..."
    return str(value)


def format_params(params: dict) -> str:
    """Equation parameters in a stable order: ``dim=(0,) keepdim=False``."""
    return " ".join(f"{key}={format_param(value)}" for key, value in params.items())


def format_equation(out_name, out_type, prim_name, arg_names, params) -> str:
    """``v3:f32[4] = mul v1 v2`` (with ``key=value`` parameters after the arguments)."""
    rhs = " ".join([prim_name, *arg_names])
    if params:
        rhs += " " + format_params(params)
    return f"{out_name}:{out_type} = {rhs}"
