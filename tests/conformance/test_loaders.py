"""Which diffusers model classes lora_cache converts adapters for: the ones diffusers' own
loader mixins name, found from diffusers rather than listed here."""

from __future__ import annotations

import pytest

diffusers = pytest.importorskip("diffusers", reason="the loader mixins are diffusers'")

from lora_cache.adapters.diffusers_format import _LOADERS, _discovered, diffusers_loader  # noqa: E402


def _bare(name: str):
    """An instance of the diffusers class ``name`` without building it (only its type is asked)."""
    cls = getattr(diffusers, name)
    return cls.__new__(cls)


@pytest.mark.parametrize("model, mixin", [
    ("MiniMaxH3Transformer3DModel", "MiniMaxH3LoraLoaderMixin"), ("ZImageTransformer2DModel", "ZImageLoraLoaderMixin"),
    ("AuraFlowTransformer2DModel", "AuraFlowLoraLoaderMixin"), ("FluxTransformer2DModel", "FluxLoraLoaderMixin"),
    ("WanTransformer3DModel", "WanLoraLoaderMixin"), ("UNet2DConditionModel", "StableDiffusionXLLoraLoaderMixin"),
])
def test_the_model_classes_diffusers_loads_lora_into_are_found(model, mixin):
    assert diffusers_loader(_bare(model)).__name__ == mixin


def test_the_list_holds_only_what_diffusers_docstrings_do_not_say_alone():
    found = _discovered()
    assert len(found) >= 20 and "WanTransformer3DModel" not in found and "UNet2DConditionModel" not in found
    assert not set(_LOADERS) & set(found)
    assert diffusers_loader(_bare("AutoencoderKL")) is None
