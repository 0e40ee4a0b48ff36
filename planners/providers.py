"""Providers: anything that can turn a component's anonymous weights into mapped ones.

The interface is a pair of :class:`typing.Protocol` over attribute names, so a
provider (``lora_cache`` supplies the LoRA merge cache, ``hostmem.remap_offer`` the
checkpoint remap: :func:`remap_providers`) implements it without importing
``planners``: any object with these attributes is an offer, and any object with a
``name`` and an ``offer()`` method is a provider.

An **offer** says::

    provider: str          # the provider's name, for the report
    component: str         # the component (config name) whose bytes it converts
    anonymous_bytes: int   # anonymous bytes it can turn into file-backed ones (or remove)
    disk_bytes: int        # disk it needs (a cache file), 0 if none
    one_time_s: float      # one-time cost (writing the cache), seconds; 0 when warm
    note: str              # one line for the operator ("merged weights cached at ...")

A **provider** has ``name: str`` and ``offer() -> Offer | None``: everything it
needs (which component, how many bytes) it was given when constructed, and it
returns ``None`` when it has nothing to offer.

The planner plans with and without each offer (:func:`apply_offer`): the offered
bytes come off the component's anonymous weights first (they become file-backed:
mapped back read-only) and then off the anonymous memory it holds besides its
weights (the unmerge snapshot of weights loaded copied, which the mapped base makes
unnecessary).
"""

from __future__ import annotations

from typing import NamedTuple, Protocol, runtime_checkable

from hostmem.errors import InputError
from .sizes import ComponentSizes, spread, with_residency

__all__ = ["Offer", "Provider", "OfferRecord", "apply_offer", "collect_offers", "remap_providers"]


@runtime_checkable
class Offer(Protocol):
    """What a provider can do for one component (see the module docstring)."""

    provider: str
    component: str
    anonymous_bytes: int
    disk_bytes: int
    one_time_s: float
    note: str


@runtime_checkable
class Provider(Protocol):
    """Anything with a ``name`` and an ``offer()`` returning an :class:`Offer` or None."""

    name: str

    def offer(self) -> Offer | None: ...


class OfferRecord(NamedTuple):
    """A plain copy of an offer, so a plan holds data and not the provider's objects."""

    provider: str
    component: str
    anonymous_bytes: int
    disk_bytes: int
    one_time_s: float
    note: str

    @classmethod
    def of(cls, offer) -> "OfferRecord":
        missing = [n for n in ("provider", "component", "anonymous_bytes", "disk_bytes", "one_time_s", "note")
                   if not hasattr(offer, n)]
        if missing:
            raise TypeError(f"{type(offer).__name__} is not an offer: it lacks {', '.join(missing)}")
        if int(offer.anonymous_bytes) < 0 or int(offer.disk_bytes) < 0 or float(offer.one_time_s) < 0:
            raise InputError(f"offer of {offer.provider}: bytes and seconds must not be negative")
        return cls(str(offer.provider), str(offer.component), int(offer.anonymous_bytes),
                   int(offer.disk_bytes), float(offer.one_time_s), str(offer.note))


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
    from hostmem.checkpoint_files import CheckpointNotFound
    from hostmem.remap_offer import RemapProvider

    providers = []
    for name, module in components.items():
        try:
            providers.append(RemapProvider.from_model(name, module, files, spill=spill))
        except CheckpointNotFound:
            continue
    return providers
