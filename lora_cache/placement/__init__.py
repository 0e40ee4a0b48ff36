"""The weights placed on the model: mapped, as run-time terms, or in place; and taken back.

- :mod:`.layers`: the layer operations, one job each: a merged weight computed
  (``compute_merged``), installed as a read-only mapped view (``install``), merged in
  place where the cache cannot hold it (``merge_in_place``), and ``unmerge``;
- :mod:`.runtime_lora`: a layer's terms kept at run time on its untouched base, the
  mechanism both the merge and :mod:`lora_cache.switching` use;
- :mod:`.rounding`: which layers would lose their update to rounding, and so are placed
  as run-time terms; :mod:`.rounding_memo`: that decision recorded once per combination.

The last stage: it takes the targets (:mod:`lora_cache.targets`) and sums through the
build's math (:mod:`lora_cache.compute`); nothing here knows the merge that calls it.
"""
