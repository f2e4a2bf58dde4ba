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
import threading

import optree
from torch.utils._pytree import SUPPORTED_NODES

NAMESPACE = "minifunctorch"
# optree's own containers (namedtuple and PyStructSequence classes are recognized by kind)
_BUILTIN = (tuple, list, dict, collections.OrderedDict, collections.defaultdict,
            collections.deque)
_mirrored: set = set()  # the classes registered here
_size, _last = 0, None  # torch's registry when last mirrored: its size and last class
_lock = threading.Lock()  # (transforms may run in several threads: one mirrors at a time)


def _mirror_torchs_registry():
    global _size, _last
    with _lock:
        # (one snapshot for the work and the state it records: a class that another thread
        # registers meanwhile changes the registry's size, and the next check mirrors it)
        nodes = list(SUPPORTED_NODES.items())
        for cls in _mirrored - {cls for cls, _ in nodes}:  # deregistered in torch since
            optree.unregister_pytree_node(cls, namespace=NAMESPACE)
            _mirrored.discard(cls)
        for cls, node in nodes:
            if (cls in _mirrored or not isinstance(cls, type) or cls in _BUILTIN
                    or optree.is_namedtuple_class(cls) or optree.is_structseq_class(cls)):
                continue
            optree.register_pytree_node(
                cls, node.flatten_fn,
                lambda context, children, unflatten=node.unflatten_fn: unflatten(children,
                                                                                 context),
                namespace=NAMESPACE)
            _mirrored.add(cls)
        _size, _last = len(nodes), (nodes[-1][0] if nodes else None)


def _check_registry():
    """Mirror torch's registry again if it changed since it was last mirrored."""
    if len(SUPPORTED_NODES) != _size or next(reversed(SUPPORTED_NODES), None) is not _last:
        _mirror_torchs_registry()


def tree_flatten(tree, is_leaf=None, *, none_is_leaf=False):
    _check_registry()
    return optree.tree_flatten(tree, is_leaf, none_is_leaf=none_is_leaf, namespace=NAMESPACE)


def tree_leaves(tree, is_leaf=None, *, none_is_leaf=False):
    _check_registry()
    return optree.tree_leaves(tree, is_leaf, none_is_leaf=none_is_leaf, namespace=NAMESPACE)


def tree_structure(tree, is_leaf=None, *, none_is_leaf=False):
    _check_registry()
    return optree.tree_structure(tree, is_leaf, none_is_leaf=none_is_leaf, namespace=NAMESPACE)


def tree_map(func, tree, *rests, is_leaf=None, none_is_leaf=False):
    _check_registry()
    return optree.tree_map(func, tree, *rests, is_leaf=is_leaf, none_is_leaf=none_is_leaf,
                           namespace=NAMESPACE)


def tree_broadcast_prefix(prefix_tree, full_tree, is_leaf=None, *, none_is_leaf=False):
    _check_registry()
    return optree.tree_broadcast_prefix(prefix_tree, full_tree, is_leaf,
                                        none_is_leaf=none_is_leaf, namespace=NAMESPACE)


tree_unflatten = optree.tree_unflatten  # (a treespec keeps the namespace it was made in)
