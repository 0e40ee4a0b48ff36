"""A merged layer computed: base + the sum of its terms, rounded once.

- :mod:`.merge_math`: the row blocks, the fp32 and bf16 kernels, DoRA's norms, the
  order the terms are added in (the in-place path, the cached path and a
  tensor-parallel part all sum through it);
- :mod:`.buffers`: the host buffers the build reuses (one scratch, a ring on huge pages)
  and where the sum runs.

The build stage's math; which kernel sums each shape on this machine, and the policy the
key records, are :mod:`lora_cache.kernels`'.
"""
