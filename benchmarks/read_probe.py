"""The machine's streaming read bandwidth, as the benchmarks that report a share of it measure it:
an AVX2 read of 1 GiB on 2 MB pages on every thread, best of 5 (a buffer past the L3 cache, so
the figure is memory's), the faster of two loops: plain loads, and the same loads with each
line prefetched 2 KB ahead, as the kernels prefetch their weights (on a machine where the
plain loop read 27 GB/s, the kernels read bfloat16 weights at up to 32, "119%" of it). A
`torch.sum` over a large tensor reads at about 60% of this, which made weights look faster
than the machine.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

_PROBE = r"""
#include <torch/extension.h>
#include <immintrin.h>
#include <omp.h>
__attribute__((target("avx2"))) static long long read_avx2(const char* p, long long n) {
  __m256i acc = _mm256_setzero_si256();
  for (long long i = 0; i + 128 <= n; i += 128) {
    acc = _mm256_xor_si256(acc, _mm256_load_si256((const __m256i*)(p + i)));
    acc = _mm256_xor_si256(acc, _mm256_load_si256((const __m256i*)(p + i + 32)));
    acc = _mm256_xor_si256(acc, _mm256_load_si256((const __m256i*)(p + i + 64)));
    acc = _mm256_xor_si256(acc, _mm256_load_si256((const __m256i*)(p + i + 96)));
  }
  return _mm256_extract_epi64(acc, 0);
}
__attribute__((target("avx2"))) static long long read_avx2_prefetch(const char* p, long long n) {
  __m256i acc = _mm256_setzero_si256();
  for (long long i = 0; i + 128 <= n; i += 128) {
    _mm_prefetch(p + i + 2048, _MM_HINT_T0);
    _mm_prefetch(p + i + 2048 + 64, _MM_HINT_T0);
    acc = _mm256_xor_si256(acc, _mm256_load_si256((const __m256i*)(p + i)));
    acc = _mm256_xor_si256(acc, _mm256_load_si256((const __m256i*)(p + i + 32)));
    acc = _mm256_xor_si256(acc, _mm256_load_si256((const __m256i*)(p + i + 64)));
    acc = _mm256_xor_si256(acc, _mm256_load_si256((const __m256i*)(p + i + 96)));
  }
  return _mm256_extract_epi64(acc, 0);
}
double probe_loop(torch::Tensor buf, int64_t repeats, bool prefetch) {
  const char* p = (const char*)buf.data_ptr();
  const long long n = buf.numel();
  double best = 1e30;
  for (int r = 0; r < repeats; ++r) {
    long long sink = 0;
    double t0 = omp_get_wtime();
#pragma omp parallel reduction(^ : sink)
    {
      int t = omp_get_thread_num(), nt = omp_get_num_threads();
      long long chunk = (n / nt) & ~127LL;
      sink ^= prefetch ? read_avx2_prefetch(p + t * chunk, chunk) : read_avx2(p + t * chunk, chunk);
    }
    double dt = omp_get_wtime() - t0;
    if (sink == 42) dt += 1e-9;
    if (dt < best) best = dt;
  }
  return (double)n / best / 1e9;
}
double probe(torch::Tensor buf, int64_t repeats) {
  return std::max(probe_loop(buf, repeats, false), probe_loop(buf, repeats, true));
}
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("probe", &probe); }
"""


def read_bandwidth() -> float:
    """GB/s of a streaming read over 1 GiB on torch's threads (best of 5), measured in a child
    process so the caller's peak RSS does not count the buffer."""
    import torch

    code = (
        "import sys, torch; sys.path.insert(0, sys.argv[1]); import read_probe; "
        "torch.set_num_threads(int(sys.argv[2])); print(read_probe.probe_here())"
    )
    here = str(Path(__file__).resolve().parent)
    out = subprocess.run(
        [sys.executable, "-c", code, here, str(torch.get_num_threads())],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return float(out.strip().splitlines()[-1])


def probe_here() -> float:
    """`read_bandwidth` in this process."""
    return Prober().read(5)


class Prober:
    """The probe kept ready in this process (its module built, its 1 GiB buffer held), for a
    benchmark that reads the bandwidth between its own timings, so the machine's drifting
    speed cancels in the shares it reports."""

    def __init__(self) -> None:
        import torch
        from torch.utils.cpp_extension import load_inline

        self._mod = load_inline(
            "stallfree_bench_read_probe",
            cpp_sources=_PROBE,
            extra_cflags=["-O3", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
        )
        self._buf = on_huge_pages([torch.ones(1 << 30, dtype=torch.uint8)])[0]

    def read(self, repeats: int = 1) -> float:
        """GB/s: the faster loop's best of `repeats` passes over the buffer."""
        return float(self._mod.probe(self._buf, repeats))


def on_huge_pages(tensors: list) -> list:  # type: ignore[type-arg]
    """The tensors moved to 2 MB pages as the engine moves a model's weights (unless
    STALLFREE_HUGE_PAGES=0)."""
    import torch

    from stallfree.runtime.memory.huge_pages import move_to_huge_pages

    holder = torch.nn.Module()
    holder.tensors = tensors
    move_to_huge_pages(holder)
    return tensors
