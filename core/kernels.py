"""Kernel choices that depend on the CPU: facts about the machine, read once at import.

NOTE [Kernel choices that depend on the CPU]
Two of the engine's rules can compute the same result with two different torch kernels,
and which of the two is faster depends on the CPU's vector instructions, not on the shapes
alone. torch itself dispatches its CPU kernels by that capability
(``torch.backends.cpu.get_cpu_capability()``, "AVX2" or "AVX512" on x86), and oneDNN does the
same inside its convolutions; so do these rules:

- grad_input of a stride-1 convolution (NOTE [grad_input as a forward convolution] in nn.py):
  oneDNN's backward-data kernel (torch.func's choice), or its forward kernel on the flipped
  weight.
- a small batched convolution (NOTE [Small convolutions on a CPU] in nn.py): oneDNN
  (torch.func's choice), or torch's one-example kernels up to a size, which is larger on AVX2.

A large per-example outer product (NOTE [Outer products: ...] in batching.py) was a third
choice: a batched matmul (torch.func's kernel) on Intel CPUs with 512-bit vectors, a
broadcast multiply elsewhere. Measured in the program that makes it, in one process, the
multiply is the faster on every CPU of the table whose measurement interleaved the two, so it
is now the multiply on every CPU; the table keeps what was measured.

Measured, one thread, torch 2.13:

| machine | outer product (256, 128, 784): mul / bmm | S9's grad_input: forward / backward |
|---|---|---|
| AMD EPYC, AVX-512 (family 25, model 17; 2026-12-07) | 4.1 / 9.6 ms | not measured alone |
| AMD EPYC, AVX2 (2026-12-07) | 7.3 / 10.8 ms | 546 / 346 us |
| an Intel Xeon (2026-11-28; model not recorded) | 12.8 / 11.3 ms (1) | not measured |
| Intel Xeon with AMX (family 6, model 207; 2026-12-07) | 16.6 / 16.3 ms (2) | not measured |
| an AMD EPYC (80f0bad) | not measured | 327 / 576 us |

(1) The kernels alone; S2 B=256 then took 1.08x torch.func's time with the multiply and
0.99-1.03x with the matmul, in separate benchmark runs. (2) Medians of 40 interleaved runs of
the kernels alone (the matmul's spread 13-37 ms, the multiply's 15-18); S2 B=256, both in one
process, three times: 0.89x torch.func's time with the multiply, 0.97-1.00x with the matmul.

The two earlier machines' capability was not recorded (benchmarks/RESULTS.md records it now);
the rules below take them to be AVX-512 ones, as those CPU families are. On the AVX-512 AMD
EPYC, the convolution choices made for wide vectors hold (A/B in one process, 7 rounds: with
the AVX2 choices S9 takes 1.04 of its time, S7 1.02), but the batched matmul does not: the
multiply takes 0.43 of its time here, 0.34 at (32, 512, 784), and S2's per-sample gradients
take 0.56 of theirs with it. Where a rule's two kernels differ in rounding (the
convolution's), results agree with torch.func's to float32 rounding on one kind of machine
and bit for bit on the other.
"""
import torch

CPU_CAPABILITY = torch.backends.cpu.get_cpu_capability()


def _first_cpu() -> dict:
    """The first processor's fields of /proc/cpuinfo ("vendor_id", "model name", ...); {}
    where there is none (not Linux)."""
    fields = {}
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if not line.strip():
                    break
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip()
    except OSError:
        pass
    return fields


CPU_INFO = _first_cpu()
# Whether the CPU has 512-bit vectors, where oneDNN's forward kernel is the faster for a
# convolution's grad_input and oneDNN leads from smaller sizes on; on AVX2 and others, torch's
# own backward kernel is, and the small kernels go further.
WIDE_VECTORS = CPU_CAPABILITY == "AVX512"
