"""Benchmarks of minifunctorch side by side with torch.func (issue 7).

``python -m benchmarks.run`` (or ``make bench``) runs the full suite and writes
``benchmarks/RESULTS.md`` and ``benchmarks/results.png``; ``--quick`` checks every case and
contender for correctness on small sizes and times nothing.

``python -m benchmarks.programs`` times the five tutorial-style programs of
``tests/test_tutorials.py`` (per-sample CNN gradients, ensembling, NTK, Jacobians/Hessians,
MAML) whole, minifunctorch side by side with torch.func in one process, and writes
``benchmarks/PROGRAMS.md``; ``--check`` only checks them. Both scripts record the glibc
allocator settings they ran with; ``make bench`` sets them
(``MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=1000000000000``), set them the same way here.

``python -m benchmarks.floor`` prints the least one op can cost in a Python engine whose
values are tensor subclasses (unwrap, call torch, wrap), beside torch.func's and
minifunctorch's per-op times (NOTE [The floor of a tensor-subclass engine]).

Modules: ``harness`` (contenders, correctness checks, interleaved timing, profiles),
``cases`` (the cases S1-S10), ``report`` (tables, targets, plot), ``run`` (the command line),
``programs`` (the tutorial programs), ``floor`` (the per-op floor).
"""
