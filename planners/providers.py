"""The provider step of a plan: ask every provider for its offer, and plan with and without it.

The protocol (:class:`Offer`, :class:`Provider`, :class:`OfferRecord`) lives below every
provider, in :mod:`hostmem.providers`, and is re-exported here: ``lora_cache`` supplies
the LoRA merge cache, ``hostmem.remapping.offer`` the checkpoint remap
(:func:`remap_providers`), and neither imports ``planners``.

The planner plans with and without each offer (:func:`apply_offer`): the offered
bytes come off the component's anonymous weights first (they become file-backed:
mapped back read-only) and then off the anonymous memory it holds besides its
weights (the unmerge snapshot of weights loaded copied, which the mapped base makes
unnecessary).
"""

from __future__ import annotations

from hostmem.errors import InputError
from hostmem.providers import Offer, OfferRecord, Provider

from .sizes import ComponentSizes, spread, with_residency

__all__ = ["Offer", "Provider", "OfferRecord", "apply_offer", "collect_offers", "remap_providers"]


def collect_offers(providers, components: set[str]) -> list[OfferRecord]:
    """Ask every provider for its offer; an offer for an unknown component is an error."""
    records = []
    for provider in providers:
        if not isinstance(provider, Provider):
            raise TypeError(f"{type(provider).__name__} is not a provider: it needs name and offer()")
        offer = provider.offer()
        if offer is None:
            continue
        record = OfferRecord.of(offer)
        if record.component not in components:
            raise InputError(
                f"provider {record.provider} offers for component {record.component!r}, which the config "
                f"does not name (components: {', '.join(sorted(components))})"
            )
        records.append(record)
    return records


def apply_offer(sizes: ComponentSizes, offer: OfferRecord) -> ComponentSizes:
    """``sizes`` after the offer: anonymous weights become file-backed, then extra anonymous goes."""
    units = list(sizes.units)
    from_weights = min(offer.anonymous_bytes, sum(u.residency.anonymous for u in units))
    shares = spread(from_weights, [u.residency.anonymous for u in units])
    units = [
        u._replace(residency=with_residency(u.residency, anonymous=u.residency.anonymous - s,
                                            file_backed=u.residency.file_backed + s))
        for u, s in zip(units, shares)
    ]
    from_extra = min(offer.anonymous_bytes - from_weights, sizes.extra.anonymous)
    extra = with_residency(sizes.extra, anonymous=sizes.extra.anonymous - from_extra)
    return sizes.with_units(units)._replace(extra=extra)


def remap_providers(components, files=None, *, spill: bool = False) -> list:
    """Checkpoint remap offered for each loaded component (``{config name: nn.Module}``).

    Pass them to ``plan_loaded(config, components, providers=...)`` beside the LoRA
    cache's. A component whose checkpoint its config does not name (and no ``files``)
    is skipped: remap has nothing to compare it with. ``spill``: the offers also count
    the weights cast at load, which ``hostmem.remap(spill=True)`` writes once to the
    cache and maps back (their disk and first-start time in the offer).
    """
    from hostmem.remapping.files import CheckpointNotFound
    from hostmem.remapping.offer import RemapProvider

    providers = []
    for name, module in components.items():
        try:
            providers.append(RemapProvider.from_model(name, module, files, spill=spill))
        except CheckpointNotFound:
            continue
    return providers
