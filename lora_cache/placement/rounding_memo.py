"""Which layers of a combination lose their update to rounding, measured once and recorded.

Whether a layer is lossy (:mod:`lora_cache.placement.rounding`) depends on its base weight, its
terms and the policy, all of which the combination's key covers (the content of the
base and of the adapters, strengths, alphas, rules, the policy). So each combination is
measured once: the shares lost are recorded under
``<root>/lora_merge_cache/rounding/<key>.json`` when every layer was measured with its
values, and a later start on that key decides from the record
(:func:`lora_cache.placement.rounding.decide`) instead of measuring every layer again, which was
most of what a cache hit cost after the imports. The record names the combination's key
and an input's digest, so ``hostmem cache prune`` removes it once no combination left
uses that input (:mod:`hostmem.vault.records`). A record of another measure (another
threshold or sample) is no record; one that cannot be read is measured again.

The split a record gives is the one its combination was built with, so the layers the
cache holds are exactly the ones that split merges: a read-only root baked into an image
is served whole by a start that reads that root's record, whatever the last bits of a
measure on this CPU would say of a layer at the threshold. Whether each lossy layer can
run at run time in this model is decided again at every start (a checkpoint's tree,
``hostmem lora merge``, keeps every lossy layer out; a model may not express one).
"""

from __future__ import annotations

import math

from hostmem.vault.records import ROUNDING
from hostmem.vault.shelf import Shelf

from ..targets.layer_target import LayerTarget
from .rounding import SAMPLE_COLUMNS, SAMPLE_ROWS, THRESHOLD, RoundingCheck, decide, measure

__all__ = ["MEASURE", "RoundingSplit"]

RECORD_FORMAT = "lora-cache-rounding-shares"
MEASURE = f"share-lost>{THRESHOLD}@{SAMPLE_ROWS}x{SAMPLE_COLUMNS}-v1"  # change with the measure


def _valid(key_hex: str):
    def valid(record) -> bool:
        if not isinstance(record, dict) or record.get("format") != RECORD_FORMAT or record.get("measure") != MEASURE:
            return False
        lost, measured = record.get("lost"), record.get("measured")
        return (record.get("key") == key_hex and isinstance(measured, int) and measured >= 0
                and isinstance(lost, dict)
                and all(isinstance(n, str) and isinstance(s, float) and math.isfinite(s) for n, s in lost.items()))
    return valid


class RoundingSplit:
    """The rounding split of one merge's ``targets`` under ``policy``: decided once, from
    the record of the combination's key where there is a valid one, else measured."""

    def __init__(self, targets: list[LayerTarget], policy: str):
        self.targets, self.policy = targets, policy
        self._decided: tuple[list, list, RoundingCheck] | None = None
        self._measured: tuple[dict, int] | None = None  # measured here with every value: worth recording
        self._shelf: Shelf | None = None
        self._digest: str | None = None

    def decided(self) -> tuple[list[LayerTarget], list[LayerTarget], RoundingCheck]:
        """``(to merge, to keep at run time, what was found)``, measuring now if not decided yet."""
        if self._decided is None:
            lost, measured, whole = measure(self.targets)
            self._decided = decide(self.targets, lost, measured, self.policy)
            self._measured = (lost, measured) if whole else None
        return self._decided

    def kept_apart_measured(self) -> frozenset[str]:
        """The names kept at run time, measured here (a tensor-parallel or shared build)."""
        return frozenset(t.name for t in self.decided()[1])

    def kept_apart(self, vaults: list, key_hex: str | None, inputs: tuple) -> frozenset[str]:
        """The names kept at run time, decided from the record of ``key_hex`` in ``vaults``
        (None: a key not known yet, a base hashed beside its build) where there is one.
        ``inputs``: the key's inputs besides the base, whose first adapter's digest the
        record names for ``prune``."""
        self._shelf = Shelf(vaults, ROUNDING)
        self._digest = next((a.get("file_digest", a.get("digest")) for a in inputs[0]  # the file's, not its meaning's
                             if isinstance(a.get("file_digest", a.get("digest")), str)), None)
        if self._decided is None and key_hex is not None:
            record = self._shelf.load(key_hex, _valid(key_hex))
            if record is not None and set(record["lost"]) <= {t.name for t in self.targets}:
                self._decided = decide(self.targets, record["lost"], record["measured"], self.policy)
                self._decided[2].recorded = True
        return frozenset(t.name for t in self.decided()[1])

    def remember(self, key_hex: str | None) -> None:
        """Record what was measured here under ``key_hex`` (a hint: skipped where nothing was
        measured whole, no root is writable, or it cannot be written)."""
        if self._measured is None or self._shelf is None or key_hex is None or self._digest is None:
            return
        lost, measured = self._measured
        self._shelf.store(key_hex, {"format": RECORD_FORMAT, "measure": MEASURE, "key": key_hex,
                                    "digest": self._digest, "lost": lost, "measured": measured})
        self._measured = None
