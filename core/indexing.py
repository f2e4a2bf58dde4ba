"""Indexing with tensors: advanced indexing, index_put, the scatter family, masked ops, take
and put, as_strided. (Being written: see CONTRIBUTING.md, "A family of primitives".)"""
