"""Five programs in the style of the official torch.func tutorials, each written once against
a transform namespace (``api``: ``minifunctorch.core`` or ``torch.func``) and run with both:
only the import differs, and torch.func is the oracle.

1. per-sample gradients of a CNN (convolution, pooling, dropout in eval, log_softmax, nll);
2. an ensemble of models with ``stack_module_state``, one minibatch or one each;
3. the empirical neural tangent kernel of a CNN, by Jacobian contraction and by NTK-vector
   products;
4. Jacobians, Hessians, hvp and vhp of a small MLP;
5. MAML: an inner ``grad`` step per task under ``vmap``, then an outer ``.backward()``.
"""
import copy

import pytest
import torch
import torch.func
import torch.nn as nn
import torch.nn.functional as F

import minifunctorch.core

APIS = {"minifunctorch": minifunctorch.core, "torch.func": torch.func}

# torch.func scripts its decompositions on first use; torch deprecates torch.jit.script
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")


def assert_same(ours, theirs, **tolerances):
    for leaf in torch.utils._pytree.tree_leaves(ours):
        assert type(leaf) is torch.Tensor, f"a transform returned a {type(leaf).__name__}"
    torch.testing.assert_close(ours, theirs, **tolerances)


def run_both(program, *args):
    return [program(APIS[name], *args) for name in ("minifunctorch", "torch.func")]


# --- 1. per-sample gradients of a CNN ------------------------------------------------------------
class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, 1)
        self.conv2 = nn.Conv2d(8, 16, 3, 1, padding=1)
        self.dropout = nn.Dropout(0.25)
        self.fc1 = nn.Linear(16 * 5 * 5, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = self.dropout(torch.flatten(x, 1))
        x = self.fc2(F.relu(self.fc1(x)))
        return F.log_softmax(x, dim=1)


def per_sample_gradients(api, model, data, targets):
    params = {k: v.detach() for k, v in model.named_parameters()}
    buffers = {k: v.detach() for k, v in model.named_buffers()}

    def compute_loss(params, buffers, sample, target):
        predictions = api.functional_call(model, (params, buffers), (sample.unsqueeze(0),))
        return F.nll_loss(predictions, target.unsqueeze(0))

    compute_sample_grad = api.vmap(api.grad(compute_loss), in_dims=(None, None, 0, 0))
    return compute_sample_grad(params, buffers, data, targets)


def test_per_sample_gradients_of_a_cnn():
    torch.manual_seed(0)
    model = SmallCNN().eval()
    data, targets = torch.randn(8, 1, 12, 12), torch.randint(10, (8,))
    ours, theirs = run_both(per_sample_gradients, model, data, targets)
    assert_same(ours, theirs, rtol=1e-4, atol=1e-6)
    # and the per-sample gradients are what one backward pass per sample gives
    loss = F.nll_loss(model(data[3:4]), targets[3:4])
    expected = torch.autograd.grad(loss, list(model.parameters()))
    for name, g in zip(dict(model.named_parameters()), expected):
        torch.testing.assert_close(ours[name][3], g, rtol=1e-4, atol=1e-6)


# --- 2. model ensembling -------------------------------------------------------------------------
class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def ensemble(api, models, minibatches):
    params, buffers = api.stack_module_state(models)
    base = copy.deepcopy(models[0]).to("meta")

    def fmodel(params, buffers, x):
        return api.functional_call(base, (params, buffers), (x,))

    same_minibatch = api.vmap(fmodel, in_dims=(0, 0, None))(params, buffers, minibatches[0])
    own_minibatch = api.vmap(fmodel)(params, buffers, minibatches)
    return same_minibatch, own_minibatch


def test_model_ensembling():
    torch.manual_seed(0)
    models = [MLP() for _ in range(5)]
    minibatches = torch.randn(5, 6, 4, 4)
    ours, theirs = run_both(ensemble, models, minibatches)
    assert_same(ours, theirs)
    torch.testing.assert_close(ours[0][2], models[2](minibatches[0]))


# --- 3. the empirical NTK of a CNN ---------------------------------------------------------------
class TinyCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, (3, 3))
        self.conv2 = nn.Conv2d(4, 4, (3, 3))
        self.fc = nn.Linear(4 * 4 * 4, 3)

    def forward(self, x):
        x = self.conv2(self.conv1(x).relu()).relu()
        return self.fc(x.flatten(1))


def ntk_by_jacobian_contraction(api, net, x1, x2):
    params = {k: v.detach() for k, v in net.named_parameters()}

    def fnet_single(params, x):
        return api.functional_call(net, params, (x.unsqueeze(0),)).squeeze(0)

    jac1 = api.vmap(api.jacrev(fnet_single), (None, 0))(params, x1)
    jac2 = api.vmap(api.jacrev(fnet_single), (None, 0))(params, x2)
    jac1 = [j.flatten(2) for j in jac1.values()]
    jac2 = [j.flatten(2) for j in jac2.values()]
    return torch.stack([torch.einsum("Naf,Mbf->NMab", j1, j2)
                        for j1, j2 in zip(jac1, jac2)]).sum(0)


def ntk_by_ntk_vector_products(api, net, x1, x2):
    params = {k: v.detach() for k, v in net.named_parameters()}

    def fnet_single(params, x):
        return api.functional_call(net, params, (x.unsqueeze(0),)).squeeze(0)

    def func_x1(params):
        return fnet_single(params, x1)

    def func_x2(params):
        return fnet_single(params, x2)

    def get_ntk_slice(x1, x2):
        def f1(params):
            return fnet_single(params, x1)

        def f2(params):
            return fnet_single(params, x2)

        output, vjp_fn = api.vjp(f1, params)

        def get_ntk_column(vec):
            return api.jvp(f2, (params,), vjp_fn(vec))[1]

        basis = torch.eye(output.numel(), dtype=output.dtype).view(output.numel(), -1)
        return api.vmap(get_ntk_column)(basis)

    return api.vmap(api.vmap(get_ntk_slice, (None, 0)), (0, None))(x1, x2)


@pytest.mark.parametrize("method", [ntk_by_jacobian_contraction, ntk_by_ntk_vector_products],
                         ids=["jacobian_contraction", "ntk_vector_products"])
def test_empirical_ntk_of_a_cnn(method):
    torch.manual_seed(0)
    net = TinyCNN()
    x1, x2 = torch.randn(4, 3, 8, 8), torch.randn(3, 3, 8, 8)
    ours, theirs = run_both(method, net, x1, x2)
    assert ours.shape == (4, 3, 3, 3)
    assert_same(ours, theirs, rtol=1e-4, atol=1e-5)


# --- 4. Jacobians, Hessians, hvp and vhp ---------------------------------------------------------
def jacobians_and_hessians(api, weight, bias, x, v):
    def predict(weight, bias, x):
        return F.linear(x, weight, bias).tanh()

    def loss(weight, bias, x):
        return predict(weight, bias, x).pow(2).sum()

    def hvp(f, primals, tangents):
        return api.jvp(api.grad(f), primals, tangents)[1]

    def vhp(f, primals, tangent):
        _, vjp_fn = api.vjp(api.grad(f), primals)
        return vjp_fn(tangent)

    return {
        "jacrev": api.jacrev(predict, argnums=2)(weight, bias, x),
        "jacfwd": api.jacfwd(predict, argnums=2)(weight, bias, x),
        "jacrev_params": api.jacrev(predict, argnums=(0, 1))(weight, bias, x),
        "batched_jacobian": api.vmap(api.jacrev(predict, argnums=2),
                                     in_dims=(None, None, 0))(weight, bias, x.expand(3, -1) * 2),
        "hessian": api.hessian(loss, argnums=2)(weight, bias, x),
        "hessian_by_jacfwd_jacrev": api.jacfwd(api.jacrev(loss, argnums=2), argnums=2)(
            weight, bias, x),
        "hvp": hvp(lambda x: loss(weight, bias, x), (x,), (v,)),
        "vhp": vhp(lambda x: loss(weight, bias, x), x, v),
    }


def test_jacobians_and_hessians_of_an_mlp():
    torch.manual_seed(0)
    weight, bias = torch.randn(16, 16), torch.randn(16)
    x, v = torch.randn(16), torch.randn(16)
    ours, theirs = run_both(jacobians_and_hessians, weight, bias, x, v)
    assert_same(ours, theirs, rtol=1e-4, atol=1e-5)


# --- 5. MAML with an outer backward --------------------------------------------------------------
def sine_tasks(n_tasks, k, generator):
    amplitude = torch.rand(n_tasks, 1, 1, generator=generator) * 4.9 + 0.1
    phase = torch.rand(n_tasks, 1, 1, generator=generator) * torch.pi
    x = torch.rand(n_tasks, 2 * k, 1, generator=generator) * 10 - 5
    y = amplitude * torch.sin(x - phase)
    return x[:, :k], y[:, :k], x[:, k:], y[:, k:]


def maml(api, steps=3):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(1, 40), nn.ReLU(), nn.Linear(40, 40), nn.ReLU(),
                        nn.Linear(40, 1))
    params = dict(net.named_parameters())
    optimizer = torch.optim.Adam(params.values(), lr=1e-3)
    generator = torch.Generator().manual_seed(1)

    def loss_for_task(x1, y1, x2, y2):
        def inner_loss(params, x, y):
            return F.mse_loss(api.functional_call(net, params, (x,)), y)

        grads = api.grad(inner_loss)(params, x1, y1)
        adapted = {k: params[k] - 1e-2 * grads[k] for k in params}
        return inner_loss(adapted, x2, y2)

    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        query_losses = api.vmap(loss_for_task)(*sine_tasks(4, 5, generator))
        query_losses.mean().backward()  # through the transforms, into the real parameters
        optimizer.step()
        losses.append(query_losses.detach())
    return losses, {k: p.detach().clone() for k, p in params.items()}


def test_maml_with_an_outer_backward():
    ours, theirs = run_both(maml)
    assert_same(ours, theirs, rtol=1e-5, atol=1e-6)
