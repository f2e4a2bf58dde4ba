"""Benchmarks of minifunctorch side by side with torch.func (issue 7).

``python -m benchmarks.run`` (or ``make bench``) runs the full suite and writes
``benchmarks/RESULTS.md`` and ``benchmarks/results.png``; ``--quick`` checks every case and
contender for correctness on small sizes and times nothing.

Modules: ``harness`` (contenders, correctness checks, interleaved timing, profiles),
``cases`` (the cases S1-S10), ``report`` (tables, targets, plot), ``run`` (the command line).
"""
