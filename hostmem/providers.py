"""Providers: the protocol every way of turning anonymous weights into mapped ones implements.

A provider (checkpoint remap in :mod:`hostmem.remapping.offer`, the LoRA merge cache in
``lora_cache.provider``, or one of your own) has ``name: str`` and ``offer() -> Offer |
None``: everything it needs (which component, how many bytes) it was given when
constructed, and it returns ``None`` when it has nothing to offer. The planner
(``planners.providers``) asks each one and plans with and without its offer. The
protocol sits here, below every provider, so that none of them imports the planner.

An **offer** says::

    provider: str          # the provider's name, for the report
    component: str         # the component (config name) whose bytes it converts
    anonymous_bytes: int   # anonymous bytes it can turn into file-backed ones (or remove)
    disk_bytes: int        # disk it needs (a cache file), 0 if none
    one_time_s: float      # one-time cost (writing the cache), seconds; 0 when warm
    note: str              # one line for the operator ("merged weights cached at ...")

The fields are written once, in :class:`OfferRecord`; :class:`Offer` is any object
that has them (a provider package may write its own class without importing this).
"""

from __future__ import annotations

from typing import NamedTuple, Protocol, runtime_checkable

from .errors import InputError

__all__ = ["Offer", "OfferRecord", "Provider", "OFFER_FIELDS"]


class OfferRecord(NamedTuple):
    """An offer as plain data (see the module docstring): what providers return, and the
    copy a plan holds, so that it holds data and not the provider's objects."""

    provider: str
    component: str
    anonymous_bytes: int
    disk_bytes: int
    one_time_s: float
    note: str

    @classmethod
    def of(cls, offer) -> "OfferRecord":
        """A checked copy of any object with the six fields."""
        missing = [n for n in OFFER_FIELDS if not hasattr(offer, n)]
        if missing:
            raise TypeError(f"{type(offer).__name__} is not an offer: it lacks {', '.join(missing)}")
        if int(offer.anonymous_bytes) < 0 or int(offer.disk_bytes) < 0 or float(offer.one_time_s) < 0:
            raise InputError(f"offer of {offer.provider}: bytes and seconds must not be negative")
        return cls(str(offer.provider), str(offer.component), int(offer.anonymous_bytes),
                   int(offer.disk_bytes), float(offer.one_time_s), str(offer.note))


OFFER_FIELDS: tuple[str, ...] = OfferRecord._fields


@runtime_checkable
class Offer(Protocol):
    """Anything with the fields of :class:`OfferRecord` (an ``isinstance`` check looks for them)."""

    __annotations__ = dict(OfferRecord.__annotations__)


@runtime_checkable
class Provider(Protocol):
    """Anything with a ``name`` and an ``offer()`` returning an :class:`Offer` or None."""

    name: str

    def offer(self) -> Offer | None: ...
