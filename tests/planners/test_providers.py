"""Providers: the interface by attribute names, and plans with and without each offer."""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest

from hostmem.residency import Residency
from planners.budget import HostLimit
from planners.config import load_config
from planners.deployment import plan_deployment
from planners.providers import Offer, OfferRecord, Provider, apply_offer
from planners.sizes import ComponentSizes, Layer
from planners.whatif import what_if_components

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GiB = 1024**3


@dataclass(frozen=True)
class CacheOffer:  # written without importing planners, as a provider package would
    provider: str
    component: str
    anonymous_bytes: int
    disk_bytes: int
    one_time_s: float
    note: str


class MergeCache:
    name = "merge_cache"

    def __init__(self, component: str, lora_target_bytes: int):
        self.component, self.targets = component, lora_target_bytes

    def offer(self):
        if not self.targets:
            return None
        return CacheOffer(self.name, self.component, 2 * self.targets, self.targets, 60.0, "merged once, mapped back")


@pytest.fixture
def seed_case():
    config = load_config(os.path.join(REPO, "configs", "minimax-h3-32g.yaml"), environ={})
    return config, HostLimit(config.host.limit, "config", 64 * GiB, None)


def test_the_interface_is_met_by_attribute_names():
    provider = MergeCache("dit", 10)
    assert isinstance(provider, Provider) and isinstance(provider.offer(), Offer)
    assert not isinstance(object(), Provider)


def test_the_lora_cache_provider_meets_the_interface():
    from lora_cache.provider import LoraCacheProvider

    provider = LoraCacheProvider("dit", 38 * 10**9, layers=208)
    offer = provider.offer()
    assert isinstance(provider, Provider) and isinstance(offer, Offer)
    assert OfferRecord.of(offer).anonymous_bytes == 2 * 38 * 10**9


def test_the_seed_case_plans_with_and_without_the_cache_offer(seed_case):
    config, host = seed_case
    sizes, _ = what_if_components(config, "in-place")
    plan = plan_deployment(config, sizes, host, merge="in-place",
                           providers=[MergeCache("dit", sizes["dit"].lora_target_bytes)])
    assert plan.budget.bytes == 0 and plan.pins.pinned_bytes == 0
    (outcome,) = plan.offers
    assert outcome.offer.provider == "merge_cache" and outcome.offer.disk_bytes == 38 * 10**9
    assert outcome.budget_bytes == 24 * GiB  # max_pinned: 75% of 32 GiB
    assert outcome.pinned_bytes > 20 * GiB
    cached, _ = what_if_components(config, "cached")
    assert outcome.budget_bytes == plan_deployment(config, cached, host).budget.bytes


def test_an_offer_turns_anonymous_weights_mapped_then_drops_the_snapshot():
    layers = (Layer("b.0", 100, Residency(anonymous=60, file_backed=40)),
              Layer("b.1", 100, Residency(anonymous=60, file_backed=40)))
    sizes = ComponentSizes("dit", "layerwise", "declared", layers, extra=Residency(anonymous=120))
    record = OfferRecord("c", "dit", 150, 0, 0.0, "")
    after = apply_offer(sizes, record)
    assert [u.residency.anonymous for u in after.layers] == [0, 0]
    assert after.extra.anonymous == 90
    assert after.residency.total == sizes.residency.total - 30
    assert sum(u.nbytes for u in after.layers) == 200


def test_offers_for_unknown_components_and_non_offers_are_errors(seed_case):
    config, host = seed_case
    sizes, _ = what_if_components(config, "in-place")
    with pytest.raises(ValueError, match="component 'vae', which the config does not name"):
        plan_deployment(config, sizes, host, providers=[MergeCache("vae", 1)])

    class Broken:
        name = "broken"

        def offer(self):
            return object()

    with pytest.raises(TypeError, match="is not an offer: it lacks provider"):
        plan_deployment(config, sizes, host, providers=[Broken()])
    assert plan_deployment(config, sizes, host, providers=[MergeCache("dit", 0)]).offers == ()
