"""Kernel choices that depend on the CPU: facts about the machine, read once at import.

NOTE [Kernel choices that depend on the CPU]
Two batching and derivative rules can compute the same result with two different torch
kernels, and which of the two is faster depends on the CPU's vector instructions, not on the
shapes alone. torch itself dispatches its CPU kernels by that capability
(``torch.backends.cpu.get_cpu_capability()``, "AVX2" or "AVX512" on x86), and oneDNN does the
same inside its convolutions; so do these rules:

- a large per-example outer product (NOTE [Outer products: ...] in batching.py): a broadcast
  multiply, or a batched matmul (torch.func's choice);
- grad_input of a stride-1 convolution (NOTE [grad_input as a forward convolution] in nn.py):
  oneDNN's backward-data kernel (torch.func's choice), or its forward kernel on the flipped
  weight.
- a small batched convolution (NOTE [Small convolutions on a CPU] in nn.py): oneDNN
  (torch.func's choice), or torch's one-example kernels up to a size, which is larger on AVX2.

Measured, one thread, torch 2.13:

| machine | outer product (256, 128, 784): mul / bmm | S9's grad_input: forward / backward |
|---|---|---|
| AMD EPYC, AVX2 (2026-12-07) | 7.3 / 10.8 ms | 546 / 346 us |
| an Intel Xeon (2026-11-28) | 12.8 / 11.3 ms | not measured |
| an AMD EPYC (80f0bad) | not measured | 327 / 576 us |

The two earlier machines' capability was not recorded (benchmarks/RESULTS.md records it now);
the rule below takes them to be AVX-512 ones, as those CPU families are. Where a rule's two
kernels differ in rounding (the convolution's), results agree with torch.func's to float32
rounding on one kind of machine and bit for bit on the other.
"""
import torch

CPU_CAPABILITY = torch.backends.cpu.get_cpu_capability()

# Whether the CPU has 512-bit vectors, where the batched matmul and oneDNN's forward kernel are
# the faster of each pair above; on AVX2 and others, the broadcast multiply and torch's own
# backward kernel are.
WIDE_VECTORS = CPU_CAPABILITY == "AVX512"
