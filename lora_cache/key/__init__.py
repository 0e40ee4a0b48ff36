"""The combination's key: what decides the merged bytes, and so where they are cached.

- :mod:`.combination`: the key of adapters merged into a base, made from the adapters'
  identities (each one's meaning, strength and alpha), the target dtype and the merge
  policy the build hands it (:func:`lora_cache.kernels.policy.merge_policy`);
- :mod:`.canonical_key`: what the key says of the adapters: their canonical form and
  values, not which reader produced them;
- :mod:`.base_shards`: which checkpoint shards hold the targets, the base part of the key.

Made once per merge from the read stage's targets (:mod:`lora_cache.targets`); the
opening, a shared build and the provider's offer all key here and none of them re-keys.
"""
