"""torch.func's errors, table-driven: each misuse runs on torch.func and on minifunctorch.

A row is (id, misuse, torch.func's exception type, torch.func's key wording as a regex). The
misuse is a function of the API module (``torch.func`` or ``minifunctorch.core``), so one
row is one program run on both. The test checks the row on torch.func first (so a row
cannot drift from the oracle), then that minifunctorch raises:
- an instance of torch.func's type (code that catches torch.func's errors still works);
- a TransformError whose message contains torch.func's wording (what people search for),
  begins with the call as the user wrote it, and gives a fix (see NOTE [Messages: the call,
  torch.func's words, the cause, the fix] in core/transforms.py);
and that the engine works right after.

KNOWN_GAPS are misuses torch.func refuses whose refusal here lives in files outside the
transform API (batching rules, randomness, in-place writes, functional_call). They are strict
xfails: when one is fixed, its row fails, and it moves to CASES.
"""
import re

import pytest
import torch
import torch.func

import minifunctorch.core as mf
from minifunctorch.core import TransformError, dispatch

# torch.func scripts its decompositions on first use; torch deprecates torch.jit.script
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning",
                                        "ignore::UserWarning")

x = torch.tensor([0.5, -1.0, 2.0])
xi = torch.arange(3)
b = torch.arange(6.0).reshape(2, 3)


def two(a, c):
    return (a * c).sum()


def _under_save_on_cpu(call):
    with torch.autograd.graph.save_on_cpu():
        return call()


def _under_anomaly_detection(call):
    with torch.autograd.set_detect_anomaly(True):
        return call()


CAPTURED = torch.zeros(3)  # made outside the transforms; functions below write into it


ARGNUMS_TYPE = r"argnums must be int or Tuple\[int, \.\.\.\], got: "
NON_SCALAR = (r"grad_and_value\(f\)\(\*args\): Expected f\(\*args\) to return a scalar Tensor, "
              r"got tensor with 1 dims")
GRAD = r"grad_and_value\(f\)\(\*args\): "
VJP = r"vjp\(f, \*primals\): "
JVP = r"jvp\(f, primals, tangents\): "
HAS_AUX = r"output of function f should be a tuple: \(output, aux\) if has_aux is True"
NON_EMPTY = r"Expected f to be a function that has non-empty output"
AUX_TENSORS = r"Expected tensors, got unsupported type <class 'str'>"
NOT_A_TENSOR = r"Thing passed to transform API must be Tensor, got <class 'float'>"
NOT_FLOAT = r"only Tensors of floating point dtype can require gradients"
VJP_OUTPUTS = (VJP + r"expected f\(\*primals\) to return only tensors, got unsupported type "
               r"<class 'float'>")
CT_STRUCTURE = (r"Expected pytree structure of cotangents to be the same as pytree structure of "
                r"outputs to the function")
JVP_STRUCTURE = JVP + r"Expected primals and tangents to have the same python structure"
IN_DIMS_TYPE = (r"expected `in_dims` to be int or a \(potentially nested\) tuple matching the "
                r"structure of inputs, got: ")
IN_DIMS_STRUCTURE = r"in_dims is not compatible with the structure of `inputs`"
IN_DIM_RANGE = (r"Got in_dim={0} for some input, but that input is a Tensor of dimensionality "
                r"{1} so expected in_dim to satisfy -{1} <= in_dim < {1}")
OUT_DIMS_TYPE = (r"`out_dims` must be an int, None or a python collection of ints representing "
                 r"where in the outputs the vmapped dimension should appear")
OUT_DIMS_STRUCTURE = r"out_dims is not compatible with the structure of `outputs`"
VMAP_OUTPUTS = (r"must only return Tensors, got type <class '{}'>\. Did you mean to set "
                r"out_dims= to None for output\?")
RANDOMNESS = r"Only allowed values for randomness are 'error', 'different', or 'same'\. Got "

CASES = [
    # --- grad and grad_and_value ------------------------------------------------------------
    ("grad_argnums_out_of_range", lambda F: F.grad(two, argnums=2)(x, x),
     RuntimeError, r"Got argnum=2, but only 2 positional inputs"),
    ("grad_argnums_negative_out_of_range", lambda F: F.grad(two, argnums=-3)(x, x),
     RuntimeError, r"Got argnum=-3, but only 2 positional inputs"),
    ("grad_argnums_duplicate", lambda F: F.grad(two, argnums=(0, 0))(x, x),
     RuntimeError, r"argnums elements must be unique, got \(0, 0\)"),
    ("grad_argnums_float", lambda F: F.grad(torch.sum, argnums=1.5)(x),
     RuntimeError, ARGNUMS_TYPE + "<class 'float'>"),
    ("grad_argnums_list", lambda F: F.grad(torch.sum, argnums=[0])(x),
     RuntimeError, ARGNUMS_TYPE + "<class 'list'>"),
    ("grad_argnums_empty", lambda F: F.grad(torch.sum, argnums=())(x),
     RuntimeError, r"argnums must be non-empty"),
    ("grad_argnums_tuple_with_a_float", lambda F: F.grad(two, argnums=(0, 1.0))(x, x),
     RuntimeError, r"argnum must be int, got: <class 'float'>"),
    ("grad_without_arguments", lambda F: F.grad(lambda: x.sum())(),
     RuntimeError, r"Got argnum=0, but only 0 positional inputs"),
    ("grad_non_scalar_output", lambda F: F.grad(lambda a: a * 2)(x),
     RuntimeError, NON_SCALAR),
    ("grad_non_tensor_output", lambda F: F.grad(lambda a: 3.0)(x),
     RuntimeError, GRAD + r"Expected f\(\*args\) to return a Tensor, got <class 'float'>"),
    ("grad_tuple_output", lambda F: F.grad(lambda a: (a.sum(), a.sum()))(x),
     RuntimeError, GRAD + r"Expected f\(\*args\) to return a Tensor, got <class 'tuple'>"),
    ("grad_has_aux_without_a_pair", lambda F: F.grad(torch.sum, has_aux=True)(x),
     RuntimeError, GRAD + HAS_AUX),
    ("grad_has_aux_with_a_triple",
     lambda F: F.grad(lambda a: (a.sum(), a, a), has_aux=True)(x), RuntimeError, HAS_AUX),
    ("grad_has_aux_with_a_list",
     lambda F: F.grad(lambda a: [a.sum(), a], has_aux=True)(x), RuntimeError, HAS_AUX),
    ("grad_has_aux_non_scalar_output",
     lambda F: F.grad(lambda a: (a, a), has_aux=True)(x), RuntimeError, NON_SCALAR),
    ("grad_has_aux_non_tensor_aux",
     lambda F: F.grad(lambda a: (a.sum(), "aux"), has_aux=True)(x), RuntimeError, AUX_TENSORS),
    ("grad_non_tensor_argument", lambda F: F.grad(lambda a: a * 2)(3.0),
     ValueError, NOT_A_TENSOR),
    ("grad_integer_input", lambda F: F.grad(lambda a: (a * 2).sum())(xi),
     RuntimeError, NOT_FLOAT),
    ("grad_and_value_non_scalar_output", lambda F: F.grad_and_value(lambda a: a * 2)(x),
     RuntimeError, NON_SCALAR),
    ("grad_and_value_argnums_out_of_range",
     lambda F: F.grad_and_value(torch.sum, argnums=1)(x),
     RuntimeError, r"Got argnum=1, but only 1 positional inputs"),
    ("grad_of_grad_non_scalar_inner",
     lambda F: F.grad(lambda a: F.grad(lambda c: c * a)(a).sum())(x), RuntimeError, NON_SCALAR),
    ("vmap_of_grad_non_scalar", lambda F: F.vmap(F.grad(lambda a: a[:2]))(b),
     RuntimeError, NON_SCALAR),
    # --- vjp --------------------------------------------------------------------------------
    ("vjp_non_tensor_primal", lambda F: F.vjp(lambda a: a, 3.0), ValueError, NOT_A_TENSOR),
    ("vjp_integer_primal", lambda F: F.vjp(lambda a: a * 2, xi), RuntimeError, NOT_FLOAT),
    ("vjp_non_tensor_output", lambda F: F.vjp(lambda a: 3.0, x), RuntimeError, VJP_OUTPUTS),
    ("vjp_has_aux_without_a_pair", lambda F: F.vjp(torch.sin, x, has_aux=True),
     RuntimeError, VJP + HAS_AUX),
    ("vjp_none_output", lambda F: F.vjp(lambda a: None, x), RuntimeError, VJP + NON_EMPTY),
    ("vjp_empty_tuple_output", lambda F: F.vjp(lambda a: (), x), RuntimeError, VJP + NON_EMPTY),
    ("vjp_has_aux_non_tensor_aux", lambda F: F.vjp(lambda a: (a, "aux"), x, has_aux=True),
     RuntimeError, AUX_TENSORS),
    ("vjp_fn_cotangent_shape", lambda F: F.vjp(torch.sin, x)[1](torch.ones(4)),
     RuntimeError, r"Mismatch in shape: grad_output\[0\] has a shape of torch\.Size\(\[4\]\) "
                   r"and output\[0\] has a shape of torch\.Size\(\[3\]\)"),
    ("vjp_fn_cotangent_in_a_tuple", lambda F: F.vjp(torch.sin, x)[1]((torch.ones(3),)),
     RuntimeError, CT_STRUCTURE),
    ("vjp_fn_one_cotangent_for_two_outputs",
     lambda F: F.vjp(lambda a: (a, a), x)[1](torch.ones(3)), RuntimeError, CT_STRUCTURE),
    ("vjp_fn_cotangent_dict_keys",
     lambda F: F.vjp(lambda a: {"a": a}, x)[1]({"b": x}), RuntimeError, CT_STRUCTURE),
    ("vjp_fn_cotangent_not_a_tensor", lambda F: F.vjp(torch.sin, x)[1](1.0),
     TypeError, r"gradients can be either Tensors or None, but got float"),
    # --- jvp --------------------------------------------------------------------------------
    ("jvp_primals_not_a_tuple", lambda F: F.jvp(torch.sin, x, x),
     RuntimeError, JVP + r"Expected primals to be a tuple\. E\.g\. it should be valid to call "
                   r"f\(\*primals\)"),
    ("jvp_primals_a_list", lambda F: F.jvp(torch.sin, [x], [x]),
     RuntimeError, r"Expected primals to be a tuple"),
    ("jvp_tangents_not_a_tuple", lambda F: F.jvp(torch.sin, (x,), x),
     RuntimeError, JVP_STRUCTURE),
    ("jvp_fewer_tangents_than_primals", lambda F: F.jvp(torch.mul, (x, x), (x,)),
     RuntimeError, JVP_STRUCTURE),
    ("jvp_nested_structure_mismatch", lambda F: F.jvp(lambda p: p[0], ((x, x),), (x,)),
     RuntimeError, JVP_STRUCTURE),
    ("jvp_tangent_shape", lambda F: F.jvp(torch.sin, (x,), (torch.ones(4),)),
     RuntimeError, r"Trying to set a forward gradient that has a different size than that of "
                   r"the original Tensor, this is not supported\. Tensor is of size \[3\] "
                   r"while the given forward gradient is of size \[4\]"),
    ("jvp_non_tensor_primal", lambda F: F.jvp(torch.sin, (3.0,), (1.0,)),
     RuntimeError, JVP + r"Expected primals to only contain Tensors, got <class 'float'>"),
    ("jvp_non_tensor_tangent", lambda F: F.jvp(torch.sin, (x,), (1.0,)),
     RuntimeError, JVP + r"Expected tangents to only contain Tensors, got <class 'float'>"),
    ("jvp_no_primals", lambda F: F.jvp(lambda: x, (), ()),
     RuntimeError, JVP + r"Expected primals to contain at least one Tensor"),
    ("jvp_integer_primal", lambda F: F.jvp(lambda a: a * 2, (xi,), (xi,)),
     ValueError, r"Expected primal to be floating point or complex, but got: torch\.int64"),
    ("jvp_non_tensor_output", lambda F: F.jvp(lambda a: 3.0, (x,), (x,)),
     RuntimeError, JVP + r"expected f\(\*primals\) to return only tensors, got unsupported "
                         r"type <class 'float'>"),
    ("jvp_has_aux_without_a_pair", lambda F: F.jvp(torch.sin, (x,), (x,), has_aux=True),
     RuntimeError, JVP + HAS_AUX),
    ("jvp_none_output", lambda F: F.jvp(lambda a: None, (x,), (x,)),
     RuntimeError, JVP + NON_EMPTY),
    ("jvp_has_aux_non_tensor_aux",
     lambda F: F.jvp(lambda a: (a, "aux"), (x,), (x,), has_aux=True), RuntimeError, AUX_TENSORS),
    # --- vmap: in_dims ------------------------------------------------------------------------
    ("vmap_in_dims_shorter_than_inputs", lambda F: F.vmap(torch.add, in_dims=(0,))(b, b),
     ValueError, IN_DIMS_STRUCTURE),
    ("vmap_in_dims_dict_keys", lambda F: F.vmap(lambda t: t["a"], in_dims=({"b": 0},))({"a": b}),
     ValueError, IN_DIMS_STRUCTURE),
    ("vmap_in_dims_deeper_than_input", lambda F: F.vmap(lambda t: t, in_dims=((0, 0),))(b),
     ValueError, IN_DIMS_STRUCTURE),
    ("vmap_in_dims_str", lambda F: F.vmap(torch.sin, in_dims="0")(b),
     ValueError, IN_DIMS_TYPE + "<class 'str'>"),
    ("vmap_in_dims_float", lambda F: F.vmap(torch.sin, in_dims=0.5)(b),
     ValueError, IN_DIMS_TYPE + "<class 'float'>"),
    ("vmap_in_dims_list", lambda F: F.vmap(torch.sin, in_dims=[0])(b),
     ValueError, IN_DIMS_TYPE + "<class 'list'>"),
    ("vmap_in_dims_none", lambda F: F.vmap(torch.add, in_dims=None)(x, x),
     ValueError, IN_DIMS_TYPE + "<class 'NoneType'>"),
    ("vmap_in_dim_float_entry", lambda F: F.vmap(torch.sin, in_dims=(0.5,))(b),
     ValueError, r"Got in_dim=0\.5 for an input but in_dim must be either an integer "
                 r"dimension or None"),
    ("vmap_in_dim_out_of_range", lambda F: F.vmap(torch.sin, in_dims=2)(b),
     ValueError, IN_DIM_RANGE.format(2, 2)),
    ("vmap_in_dim_negative_out_of_range", lambda F: F.vmap(torch.sin, in_dims=-3)(b),
     ValueError, IN_DIM_RANGE.format(-3, 2)),
    ("vmap_over_a_0_dim_tensor", lambda F: F.vmap(torch.sin)(torch.tensor(1.0)),
     ValueError, IN_DIM_RANGE.format(0, 0)),
    ("vmap_in_dim_for_a_non_tensor", lambda F: F.vmap(torch.mul, in_dims=(0, 0))(b, 2.0),
     ValueError, r"Got in_dim=0 for an input but the input is of type <class 'float'>\. We "
                 r"cannot vmap over non-Tensor arguments"),
    ("vmap_no_inputs", lambda F: F.vmap(lambda: x)(),
     ValueError, r"got no inputs\. Maybe you forgot to add inputs, or you are trying to vmap "
                 r"over a function with no inputs"),
    ("vmap_every_in_dim_none", lambda F: F.vmap(torch.add, in_dims=(None, None))(x, x),
     ValueError, r"Expected at least one Tensor to vmap over"),
    ("vmap_batch_sizes_differ", lambda F: F.vmap(torch.add)(b, torch.ones(4, 3)),
     ValueError, r"Expected all tensors to have the same size in the mapped dimension, got "
                 r"sizes \[2, 4\] for the mapped dimension"),
    ("vmap_batch_sizes_differ_along_in_dims",
     lambda F: F.vmap(torch.add, in_dims=(0, 1))(b, torch.ones(3, 4)),
     ValueError, r"Expected all tensors to have the same size in the mapped dimension, got "
                 r"sizes \[2, 4\]"),
    # --- vmap: out_dims and outputs -----------------------------------------------------------
    ("vmap_out_dims_str", lambda F: F.vmap(torch.sin, out_dims="0")(b),
     ValueError, OUT_DIMS_TYPE),
    ("vmap_out_dims_float", lambda F: F.vmap(torch.sin, out_dims=0.5)(b),
     ValueError, OUT_DIMS_TYPE),
    ("vmap_out_dims_tuple_with_a_float", lambda F: F.vmap(lambda a: (a, a), out_dims=(0, 0.5))(b),
     ValueError, OUT_DIMS_TYPE),
    ("vmap_out_dims_longer_than_outputs", lambda F: F.vmap(torch.sin, out_dims=(0, 0))(b),
     ValueError, OUT_DIMS_STRUCTURE),
    ("vmap_out_dims_longer_than_output_tuple",
     lambda F: F.vmap(lambda a: (a, a), out_dims=(0, 0, 0))(b), ValueError, OUT_DIMS_STRUCTURE),
    ("vmap_out_dims_list_for_tuple_output",
     lambda F: F.vmap(lambda a: (a, a), out_dims=[0, 1])(b), ValueError, OUT_DIMS_STRUCTURE),
    ("vmap_out_dim_out_of_range", lambda F: F.vmap(torch.sin, out_dims=3)(b),
     IndexError, r"Dimension out of range \(expected to be in range of \[-2, 1\], but got 3\)"),
    ("vmap_out_dim_negative_out_of_range", lambda F: F.vmap(torch.sin, out_dims=-4)(b),
     IndexError, r"Dimension out of range \(expected to be in range of \[-2, 1\], but got -4\)"),
    ("vmap_out_dims_none_for_a_batched_output", lambda F: F.vmap(torch.sin, out_dims=None)(b),
     ValueError, r"can not return a BatchedTensor when out_dim is None"),
    ("vmap_non_tensor_output", lambda F: F.vmap(lambda a: 3.0)(b),
     ValueError, VMAP_OUTPUTS.format("float")),
    ("vmap_non_tensor_in_output_tuple", lambda F: F.vmap(lambda a: (a, "s"))(b),
     ValueError, VMAP_OUTPUTS.format("str")),
    # --- vmap: options ------------------------------------------------------------------------
    ("vmap_chunk_size_zero", lambda F: F.vmap(torch.sin, chunk_size=0)(b),
     ValueError, r"vmap: chunk_size should be None or greater than 0\. \(got 0\)"),
    ("vmap_chunk_size_negative", lambda F: F.vmap(torch.sin, chunk_size=-1)(b),
     ValueError, r"vmap: chunk_size should be None or greater than 0\. \(got -1\)"),
    ("vmap_randomness_invalid", lambda F: F.vmap(torch.sin, randomness="sometimes")(b),
     RuntimeError, RANDOMNESS + "sometimes"),
    # --- jacrev, jacfwd, hessian --------------------------------------------------------------
    ("jacrev_argnums_out_of_range", lambda F: F.jacrev(torch.sin, argnums=3)(x),
     RuntimeError, r"Got argnum=3, but only 1 positional inputs"),
    ("jacrev_argnums_duplicate", lambda F: F.jacrev(torch.mul, argnums=(0, 0))(x, x),
     RuntimeError, r"argnums elements must be unique, got \(0, 0\)"),
    ("jacrev_argnums_float", lambda F: F.jacrev(torch.sin, argnums=0.5)(x),
     RuntimeError, ARGNUMS_TYPE + "<class 'float'>"),
    ("jacrev_non_tensor_output", lambda F: F.jacrev(lambda a: 3.0)(x), RuntimeError, VJP_OUTPUTS),
    ("jacrev_has_aux_without_a_pair", lambda F: F.jacrev(torch.sin, has_aux=True)(x),
     RuntimeError, VJP + HAS_AUX),
    ("jacrev_empty_tuple_output", lambda F: F.jacrev(lambda a: ())(x),
     RuntimeError, VJP + NON_EMPTY),
    ("jacrev_complex_input", lambda F: F.jacrev(torch.sin)(x.to(torch.cfloat)),
     RuntimeError, r"jacrev: Expected all inputs to be real but received complex tensor at "
                   r"flattened input idx: 0"),
    ("jacrev_chunk_size_zero", lambda F: F.jacrev(torch.sin, chunk_size=0)(x),
     ValueError, r"jacrev: `chunk_size` should be greater than 0"),
    ("jacrev_chunk_size_negative", lambda F: F.jacrev(torch.sin, chunk_size=-1)(x),
     ValueError, r"jacrev: `chunk_size` should be greater than 0"),
    ("jacrev_non_tensor_argument", lambda F: F.jacrev(torch.sin)(3.0), ValueError, NOT_A_TENSOR),
    ("jacrev_integer_input", lambda F: F.jacrev(lambda a: a * 2)(xi), RuntimeError, NOT_FLOAT),
    ("jacfwd_argnums_out_of_range", lambda F: F.jacfwd(torch.sin, argnums=3)(x),
     RuntimeError, r"Got argnum=3, but only 1 positional inputs"),
    ("jacfwd_argnums_duplicate", lambda F: F.jacfwd(torch.mul, argnums=(0, 0))(x, x),
     RuntimeError, r"argnums elements must be unique, got \(0, 0\)"),
    ("jacfwd_argnums_float", lambda F: F.jacfwd(torch.sin, argnums=0.5)(x),
     RuntimeError, ARGNUMS_TYPE + "<class 'float'>"),
    ("jacfwd_non_tensor_output", lambda F: F.jacfwd(lambda a: 3.0)(x),
     RuntimeError, JVP + r"expected f\(\*primals\) to return only tensors"),
    ("jacfwd_has_aux_without_a_pair", lambda F: F.jacfwd(torch.sin, has_aux=True)(x),
     RuntimeError, JVP + HAS_AUX),
    ("jacfwd_none_output", lambda F: F.jacfwd(lambda a: None)(x), RuntimeError, JVP + NON_EMPTY),
    ("jacfwd_complex_input", lambda F: F.jacfwd(torch.sin)(x.to(torch.cfloat)),
     RuntimeError, r"jacfwd: Expected all inputs to be real but received complex tensor at "
                   r"flattened input idx: 0"),
    ("jacfwd_randomness_invalid", lambda F: F.jacfwd(torch.sin, randomness="x")(x),
     RuntimeError, RANDOMNESS + "x"),
    ("jacfwd_integer_input", lambda F: F.jacfwd(lambda a: a * 2)(xi),
     ValueError, r"Expected primal to be floating point or complex, but got: torch\.int64"),
    ("hessian_argnums_out_of_range", lambda F: F.hessian(torch.sum, argnums=2)(x),
     RuntimeError, r"Got argnum=2, but only 1 positional inputs"),
    ("hessian_non_tensor_output", lambda F: F.hessian(lambda a: 3.0)(x),
     RuntimeError, VJP_OUTPUTS),
    # --- linearize ------------------------------------------------------------------------------
    ("linearize_tangent_shape", lambda F: F.linearize(torch.sin, x)[1](torch.ones(4)),
     RuntimeError, r"tangent:0 with shape torch\.Size\(\[4\]\) in flattened pytree doesn't "
                   r"match the shape torch\.Size\(\[3\]\) of the corresponding primal"),
    ("linearize_tangent_dtype", lambda F: F.linearize(torch.sin, x)[1](x.double()),
     RuntimeError, r"tangent:0 with dtype torch\.float64 in flattened pytree doesn't match the "
                   r"dtype torch\.float32 of the corresponding primal"),
    ("linearize_too_many_tangents", lambda F: F.linearize(torch.sin, x)[1](x, x),
     RuntimeError, r"to have the same argspec as the primals"),
    ("vmap_random_op_in_error_mode", lambda F: F.vmap(lambda a: a + torch.rand(3))(b),
     RuntimeError, r"vmap: called random operation while in randomness error mode"),
    ("vmap_mm_of_vectors", lambda F: F.vmap(torch.mm)(b, torch.ones(2, 3, 4)),
     RuntimeError, r"Shape mismatch: Got incorrect dims for mm\(a, b\)"),
    # torch.func says it as bmm (its vmap of mm is one bmm); per example, it is mm's wording
    ("vmap_mm_inner_sizes_differ",
     lambda F: F.vmap(torch.mm)(torch.ones(2, 3, 4), torch.ones(2, 5, 6)), RuntimeError,
     r"Expected size for first two dimensions of batch2 tensor|mat1 and mat2 shapes cannot be "
     r"multiplied"),
    ("functional_call_same_key_twice",
     lambda F: F.functional_call(torch.nn.Linear(2, 1), ({"weight": torch.ones(1, 2)},
                                                        {"weight": torch.ones(1, 2)}),
                                 (torch.ones(1, 2),)),
     ValueError, r"\['weight'\] appeared in multiple dictionaries; behavior of functional call "
                 r"is ambiguous"),
    # --- refusals that live in the engine's ops (tensor.py, batching.py, modules.py) ---------
    ("vmap_item_on_a_batched_tensor", lambda F: F.vmap(lambda a: a.sum().item())(b),
                 RuntimeError, r"It looks like you're calling \.item\(\) on a Tensor"),
    ("vmap_if_on_a_batched_tensor",
                 lambda F: F.vmap(lambda a: a if a.sum() > 0 else -a)(b), RuntimeError,
                 r"attempting to use a Tensor in some data-dependent control flow"),
    ("vmap_in_place_into_an_unbatched_input",
                 lambda F: F.vmap(lambda a, c: c.mul_(a), in_dims=(0, None))(b, torch.ones(3)),
                 RuntimeError, r"vmap: inplace arithmetic\(self, \*extra_args\) is not possible"),
    ("grad_in_place_into_a_captured_tensor",
                 lambda F: F.grad(lambda a: (CAPTURED.copy_(a) * a).sum())(x),
                 RuntimeError, r"attempted to call in-place operation .* that would mutate a "
                               r"captured Tensor"),
    ("jvp_in_place_into_a_captured_tensor",
                 lambda F: F.jvp(lambda a: (CAPTURED.copy_(a) * a).sum(), (x,), (x,)),
                 RuntimeError, r"attempted to call in-place operation .* that would mutate a "
                               r"captured Tensor"),
    # --- an op's own checks, which a batching rule must not lose (OpInfo error_inputs) ------
    ("vmap_amax_names_a_dim_twice", lambda F: F.vmap(lambda a: a.amax(dim=(0, -2)))(b[:, :, None]),
     RuntimeError, r"appears multiple times in the list of dims"),
    ("vmap_reshape_of_nothing_with_minus_one",
     lambda F: F.vmap(lambda a: a.reshape(0, -1))(torch.ones(2, 0, 5)),
     RuntimeError, r"cannot reshape tensor of 0 elements into shape"),
    ("vmap_permute_with_a_repeated_dim",
     lambda F: F.vmap(lambda a: a.permute(0, 0))(torch.ones(2, 3, 4)),
     RuntimeError, r"permute\(\): duplicate dims are not allowed"),
    ("grad_permute_with_a_repeated_negative_dim",
     lambda F: F.grad(lambda a: a.permute(1, -1).sum())(torch.ones(3, 4)),
     RuntimeError, r"permute\(\): duplicate dims are not allowed"),
    ("vmap_t_of_a_3d_example", lambda F: F.vmap(torch.t)(torch.ones(2, 3, 4, 5)),
     RuntimeError, r"t\(\) expects a tensor with <= 2 dimensions, but self is 3D"),
    ("vmap_complex_of_a_float_and_an_int",
     lambda F: F.vmap(torch.complex, in_dims=(0, None))(b, torch.ones(3, dtype=torch.int32)),
     RuntimeError, r"Expected both inputs to be Half, Float or Double tensors"),
    ("vmap_flipud_of_numbers", lambda F: F.vmap(torch.flipud)(x), RuntimeError,
     r"Input must be >= 1-d"),
    ("grad_roll_of_a_number", lambda F: F.grad(lambda a: torch.roll(a, 1, 0))(x[0]),
     IndexError, r"Dimension specified as 0 but tensor has no dimensions"),
    ("grad_dot_of_two_lengths", lambda F: F.grad(lambda a: torch.dot(a, a[:2]))(x),
     RuntimeError, r"inconsistent tensor size"),
    ("grad_dot_of_two_dtypes", lambda F: F.grad(lambda a: torch.dot(a, a.double()))(x),
     RuntimeError, r"dot : expected both vectors to have same dtype"),
    ("grad_narrow_with_a_bool_start",
     lambda F: F.grad(lambda a: a.narrow(0, torch.tensor(True), 1).sum())(x),
     RuntimeError, r"start must be an 0-dim integral Tensor"),
    ("vmap_rms_norm_over_other_sizes",
     lambda F: F.vmap(lambda a: torch.nn.functional.rms_norm(a, (2, 2)))(torch.ones(2, 2, 3)),
     RuntimeError, r"Given normalized_shape=\[2, 2\], expected input with shape"),
    ("vmap_prelu_of_a_number_with_two_weights",
     lambda F: F.vmap(lambda a: torch.nn.functional.prelu(a, torch.ones(2)))(x),
     RuntimeError, r"Not allow zero-dim input tensor"),
    ("vmap_max_unpool_with_indices_of_another_shape",
     lambda F: F.vmap(lambda a, i: torch.nn.functional.max_unpool1d(a, i, 2))(
         torch.ones(2, 3, 4), torch.zeros(2, 3, 3, dtype=torch.long)),
     RuntimeError, r"Expected shape of indices to be same as that of the input tensor"),
    ("vmap_adaptive_avg_pool2d_with_one_size",
     lambda F: F.vmap(lambda a: torch.nn.functional.adaptive_avg_pool2d(a, (2,)))(
         torch.ones(2, 1, 4, 4)), RuntimeError, r"output_size must be 2"),
    ("grad_conv1d_with_a_double_bias",
     lambda F: F.grad(lambda w: torch.nn.functional.conv1d(
         torch.ones(1, 1, 4), w, torch.ones(1, dtype=torch.float64)).sum())(torch.ones(1, 1, 2)),
     RuntimeError, r"Input type .* and bias type .* should be the same"),
    ("vmap_cross_of_two_ranks",
     lambda F: F.vmap(torch.linalg.cross)(torch.ones(2, 4, 3), torch.ones(2, 3)),
     RuntimeError, r"linalg.cross: inputs must have the same number of dimensions"),
    ("vmap_index_add_of_a_source_of_another_shape",
     lambda F: F.vmap(lambda a, s: a.index_add(0, torch.tensor([0, 1]), s))(
         torch.ones(2, 3, 2), torch.ones(2, 2)),
     RuntimeError, r"source tensor shape must match self tensor shape"),
    ("vmap_scatter_of_another_dtype",
     lambda F: F.vmap(lambda a, s: a.scatter(0, torch.tensor([0]), s))(b, b.double()[:, :1]),
     RuntimeError, r"Expected self.dtype to be equal to src.dtype"),
    ("vmap_masked_scatter_with_a_uint8_mask",
     lambda F: F.vmap(lambda a: a.masked_scatter(torch.ones(3, dtype=torch.uint8), a))(b),
     RuntimeError, r"only supports boolean masks"),
    ("vmap_cholesky_of_vectors", lambda F: F.vmap(torch.linalg.cholesky)(torch.eye(3)),
     RuntimeError, r"must have at least 2 dimensions"),
    ("vmap_solve_of_vectors",
     lambda F: F.vmap(torch.linalg.solve)(torch.eye(3), torch.ones(3, 3)),
     RuntimeError, r"must have at least 2 dimensions"),
    ("vmap_autograd_functional_jacobian",
     lambda F: F.vmap(lambda a: torch.autograd.functional.jacobian(torch.sin, a))(b),
     RuntimeError, r"You are attempting to call Tensor.requires_grad_\(\) \(or perhaps using "
     r"torch.autograd.functional.\* APIs\) inside of a function being transformed"),
    ("grad_autograd_functional_vjp",
     lambda F: F.grad(lambda a: torch.autograd.functional.vjp(torch.sin, a)[1])(x[0]),
     RuntimeError, r"torch.autograd.functional"),
    ("grad_requires_grad_on_a_new_tensor",
     lambda F: F.grad(lambda a: (a * torch.ones(3).requires_grad_()).sum())(x),
     RuntimeError, r"You are attempting to call Tensor.requires_grad_\(\)"),
    ("vmap_data_attribute", lambda F: F.vmap(lambda a: a.data + a)(b),
     RuntimeError, r"accessing `data` under vmap transform is not allowed"),
    ("vmap_set_data", lambda F: F.vmap(lambda a: setattr(a, "data", torch.ones(3)) or a)(b),
     RuntimeError, r"mutating directly with `.data` under vmap transform is not allowed"),
    ("grad_set_data",
     lambda F: F.grad(lambda a: (setattr(a, "data", torch.ones(3)) or a).sum())(x),
     RuntimeError, r"mutating directly with `.data` inside functorch transform is not allowed"),
    ("vmap_grad_nan_under_anomaly_detection",
     lambda F: _under_anomaly_detection(
         lambda: F.vmap(F.grad(lambda a: a.sqrt().sum()))(torch.zeros(3) - 1)),
     RuntimeError, r"Function 'SqrtBackward0' returned nan values in its 0th output"),
    ("vmap_fallback_over_an_empty_batch",
     lambda F: F.vmap(torch._test_functorch_fallback, (0, None))(torch.ones(0, 3), x),
     RuntimeError, r"The fallback path does not support vmap over dims of size 0"),
    ("grad_under_saved_tensor_hooks",
     lambda F: _under_save_on_cpu(lambda: F.grad(lambda a: a.sin().sum())(x)),
     RuntimeError, r"don't yet support saved tensor hooks"),
    ("functional_call_strict_missing_key",
                 lambda F: F.functional_call(torch.nn.Linear(2, 1), {"weight": torch.ones(1, 2)},
                                             (torch.ones(1, 2),), strict=True),
                 RuntimeError, r"Missing key\(s\): 'bias'"),
    ("vmap_out_argument",
     lambda F: F.vmap(lambda a, out: torch.abs(a, out=out))(b, b.clone()),
     RuntimeError, r"Batching rule not implemented for aten::abs.out; the fallback path "
     r"doesn't work on out= or view ops"),
    ("vmap_equal", lambda F: F.vmap(torch.equal)(b, b),
     RuntimeError, r"Batching rule not implemented for aten::equal"),
    ("grad_out_argument",
     lambda F: F.grad(lambda a: torch.sin(a, out=torch.empty(3)).sum())(x),
     RuntimeError, r"sin\(\): functions with out=... arguments don't support automatic "
     r"differentiation, but one of the arguments requires grad"),
    # (a RuntimeError here, where torch and torch.func's other rules raise IndexError: the
    # engine's DimOutOfRangeError is both)
    ("vmap_squeeze_of_a_0d_example_at_dim_1",
     lambda F: F.vmap(lambda a: torch.squeeze(a, dim=1))(torch.ones(4)),
     RuntimeError, r"out of range \(expected to be in range of \[-1, 0\], but got \[?1"),
    # NOTE [Memory formats under vmap] (core/ops.py)
    ("vmap_contiguous_channels_last",
     lambda F: F.vmap(lambda a: a.contiguous(memory_format=torch.channels_last))(
         torch.ones(2, 1, 2, 2, 2)),
     RuntimeError, r"NYI: querying is_contiguous inside of vmap for memory_format other than "
     r"torch.contiguous_format"),
    ("vmap_is_contiguous_channels_last_3d",
     lambda F: F.vmap(lambda a: a + a.is_contiguous(memory_format=torch.channels_last_3d))(
         torch.ones(2, 1, 2, 2, 2, 2)),
     RuntimeError, r"NYI: querying is_contiguous inside of vmap for memory_format"),
    ("vmap_clone_channels_last",
     lambda F: F.vmap(lambda a: torch.clone(a, memory_format=torch.channels_last))(
         torch.ones(2, 1, 2, 2, 2)),
     RuntimeError, r"NYI: Tensor.clone\(memory_format\) inside vmap is only supported with "
     r"memory_format torch.preserve_format or torch.contiguous_format"),
]


def _gap(reason):
    return pytest.mark.xfail(strict=True, reason=reason)


KNOWN_GAPS = [
    pytest.param("vmap_in_place_into_an_unbatched_local",
                 lambda F: F.vmap(lambda a: torch.ones(3).mul_(a))(b),
                 RuntimeError, r"vmap: inplace arithmetic\(self, \*extra_args\) is not possible",
                 marks=_gap("not refused: core/tensor.py (_write) swaps in a batched value")),
]

# The message begins with the call as the user wrote it (NOTE [Messages: ...]): a transform
# call, vmap(f)(<inputs>), or for an op's error the op, Tensor.mul_(...).
CALL = re.compile(r"^[A-Za-z_][\w.]*\(")


def _raised(misuse, api):
    try:
        misuse(api)
    except Exception as error:  # noqa: BLE001 - the test inspects whatever was raised
        return error
    return None


def _check(misuse, torch_type, wording):
    theirs = _raised(misuse, torch.func)
    assert theirs is not None, "the row is wrong: torch.func accepts this"
    assert isinstance(theirs, torch_type), f"the row is wrong: torch.func raised {theirs!r}"
    assert re.search(wording, str(theirs)), f"the row is wrong: torch.func said {theirs}"

    ours = _raised(misuse, mf)
    assert ours is not None, "minifunctorch accepted a misuse that torch.func refuses"
    message = str(ours)
    assert isinstance(ours, torch_type), f"{type(ours).__mro__} is not a {torch_type}: {message}"
    assert isinstance(ours, TransformError), f"not a TransformError: {ours!r}"
    assert re.search(wording, message), f"torch.func's wording is missing from: {message}"
    assert CALL.match(message), f"the message does not begin with the call: {message}"
    assert "Fix: " in message, f"no fix in: {message}"
    # the engine is usable right after: no level left on the stack, transforms still right
    assert not dispatch.transform_levels(), dispatch.transform_levels()
    torch.testing.assert_close(mf.grad(lambda a: (a.sin() * a).sum())(x),
                               x.sin() + x * x.cos())
    torch.testing.assert_close(mf.vmap(torch.sum)(b), b.sum(1))


@pytest.mark.parametrize("case_id, misuse, torch_type, wording", CASES,
                         ids=[case[0] for case in CASES])
def test_misuse_raises_torch_funcs_error(case_id, misuse, torch_type, wording):
    _check(misuse, torch_type, wording)


@pytest.mark.parametrize("case_id, misuse, torch_type, wording", KNOWN_GAPS,
                         ids=[case.values[0] for case in KNOWN_GAPS])
def test_known_gaps(case_id, misuse, torch_type, wording):
    _check(misuse, torch_type, wording)


def test_the_table_is_large_and_its_ids_unique():
    ids = [case[0] for case in CASES] + [case.values[0] for case in KNOWN_GAPS]
    assert len(CASES) >= 40
    assert len(set(ids)) == len(ids)


def test_old_names_still_catch_the_split_errors():
    """ArgnumsError and friends are TransformUsageErrors, as these misuses raised before."""
    with pytest.raises(mf.TransformUsageError):
        mf.grad(two, argnums=5)(x, x)
    with pytest.raises(mf.TransformUsageError):
        mf.jvp(torch.sin, x, x)
    with pytest.raises(mf.NonScalarOutputError):
        mf.grad(lambda a: a)(x)
