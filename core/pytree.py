"""Pytrees as torch.func sees them: optree's functions, with torch's registered containers.

NOTE [Pytrees are torch's]
torch.func flattens inputs, outputs, in_dims and cotangents with torch.utils._pytree, so a
class that a user registers there (``register_pytree_node``, ``register_dataclass``) is a
container whose tensors every transform reaches, and so are torch's own (torch.Size, fx's
immutable list and dict). The engine flattens with optree, whose builtin containers are the
same (tuple, list, dict, namedtuple, OrderedDict, defaultdict, deque, torch.return_types);
every other class in torch's registry is registered here into optree's namespace
"minifunctorch", adapting torch's unflatten(children, context) to optree's (context,
children), and the functions below flatten in that namespace. A class registered after the
engine was imported is mirrored at the next flatten, and one taken back
(``_deregister_pytree_node``) is taken back here: the check is the registry's size and its
last class. torch keeps its own optree mirror (torch.utils._cxx_pytree) for
register_pytree_node but not for register_dataclass, hence one here. (JAX keeps a single
registry, jax.tree_util's, for the same reason: a container is one to every transform.)
"""
import collections
import functools

import optree
from torch.utils._pytree import SUPPORTED_NODES

NAMESPACE = "minifunctorch"
# optree's own containers (namedtuple and PyStructSequence classes are recognized by kind)
_BUILTIN = (tuple, list, dict, collections.OrderedDict, collections.defaultdict,
            collections.deque)
_mirrored: set = set()  # the classes registered here
_registry_state = None  # (size, last class) of torch's registry when last mirrored


def _state():
    return len(SUPPORTED_NODES), next(reversed(SUPPORTED_NODES), None)


def _mirror_torchs_registry():
    global _registry_state
    for cls in _mirrored - SUPPORTED_NODES.keys():  # deregistered in torch since
        optree.unregister_pytree_node(cls, namespace=NAMESPACE)
        _mirrored.discard(cls)
    for cls, node in list(SUPPORTED_NODES.items()):
        if (cls in _mirrored or not isinstance(cls, type) or cls in _BUILTIN
                or optree.is_namedtuple_class(cls) or optree.is_structseq_class(cls)):
            continue
        optree.register_pytree_node(
            cls, node.flatten_fn,
            lambda context, children, unflatten=node.unflatten_fn: unflatten(children, context),
            namespace=NAMESPACE)
        _mirrored.add(cls)
    _registry_state = _state()


def _with_torchs_containers(function):
    def call(*args, **kwargs):
        if _state() != _registry_state:
            _mirror_torchs_registry()
        return function(*args, namespace=NAMESPACE, **kwargs)
    return functools.update_wrapper(call, function)


tree_flatten = _with_torchs_containers(optree.tree_flatten)
tree_leaves = _with_torchs_containers(optree.tree_leaves)
tree_map = _with_torchs_containers(optree.tree_map)
tree_structure = _with_torchs_containers(optree.tree_structure)
tree_broadcast_prefix = _with_torchs_containers(optree.tree_broadcast_prefix)
tree_unflatten = optree.tree_unflatten  # (a treespec keeps the namespace it was made in)
