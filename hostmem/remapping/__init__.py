"""Checkpoint remap, the lowest provider: anonymous weights turned back into read-only
mappings of files.

:mod:`.files` finds the safetensors files a loaded model came from; :mod:`.checkpoint`
maps weights that still equal their checkpoint back onto it (:func:`remap`, comparing
with :mod:`.same_bytes`); :mod:`.spill` writes the weights that differ once, into the
vault, and maps them back, naming what a fused weight was made from (:mod:`.origin`);
:mod:`.offer` is what all that could give back, as the planner's
:class:`hostmem.providers.Offer`. A new provider implements the protocol in
:mod:`hostmem.providers` as :mod:`.offer` does.
"""
