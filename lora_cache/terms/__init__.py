"""The canonical form's terms: what every adapter format is read into, per parameter.

- :mod:`.delta`: :class:`~.delta.Delta`, one adapter's change to one parameter with its
  final scale (:func:`~.delta.lora_scale`);
- :mod:`.lycoris_math`: LyCORIS's factored changes (LoHa, LoKr, Tucker LoCon), each asked
  for the rows of one block;
- :mod:`.dora_lycoris`: LyCORIS's DoRA, its axis and its decomposed sum, as ComfyUI merges it.

Part of the read stage: the key (:mod:`lora_cache.key`) covers these terms and the build
(:mod:`lora_cache.compute`) sums them; nothing here knows either.
"""
