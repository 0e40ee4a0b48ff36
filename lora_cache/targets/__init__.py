"""The adapters' terms laid on the model: which parameter each adapter key changes.

- :mod:`.layer_target`: :class:`~.layer_target.LayerTarget`, one parameter to merge with
  its terms in order, and where a tensor's bytes live (:class:`~.layer_target.AddressSpace`);
- :mod:`.keys`: each key of a read adapter resolved against the model's parameters (key
  rules, fused projections split or padded), its terms made with their final scale;
- :mod:`.header_targets`: the same names and bytes from the adapters' headers alone, no
  torch, for a plan made before loading; :mod:`.planned_conversion`: the targets of
  adapters only diffusers' converters map, for such a plan.

The end of the read stage: the key (:mod:`lora_cache.key`) is made from these targets.
"""
