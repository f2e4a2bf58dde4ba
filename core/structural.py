"""Reductions, scans, sorting and reshaping: prod, var, norms, cumsum/cumprod, sort, topk,
max/min with indices, flip, roll, repeat, split, unbind. (Being written: see CONTRIBUTING.md,
"A family of primitives".)"""
