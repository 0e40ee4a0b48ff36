"""The ranks' work, one room: what a host's several processes do together or apart.

- :mod:`.shared_build`: the ranks of one host build a missing combination together, once
  (:mod:`.faults`: what they say when a rank dies or the disk is full; :mod:`.fold`: the
  base hashed while they build);
- :mod:`.tp_shards`: a tensor-parallel rank merges its own part of each weight;
- :mod:`.process_group`: the one question a merge asks torch.distributed first.

The merge (:mod:`lora_cache.orchestrate`) calls into this room; nothing here calls back.
"""
