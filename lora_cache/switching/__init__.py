"""Adapter switching: change a served model's adapters while it serves.

:func:`set_adapters` swaps to a combination the cache holds and serves a missing one at
once at run time (:mod:`lora_cache.placement.runtime_lora`) while it is built in the background, swapping at
a safe point between forwards (:mod:`.forward_gate`); :mod:`.switch_state` is what it keeps
per model, :mod:`.diffusers_switch` diffusers' ``set_adapters(names, weights)`` on top.
The environment kill switch is elsewhere: :mod:`lora_cache.settings`.
"""
