"""What an adapter's tensors must look like before anything is merged with them.

A malformed part (an empty alpha, a rank-0 pair, a 3-D up matrix, an integer tensor)
would otherwise surface as an IndexError or a shape error deep inside a merge, and a NaN
or an infinity would be merged silently into every weight it touches. Each is refused
here with the file and key named. The finiteness check reads every value of the file's
tensors once, so it runs where the values are first consumed (:class:`FiniteCheck`,
carried by every delta the file yields and run by :func:`check_before_use` before the
first layer is computed, merged in place or applied at run time), not where the file is
read: a start whose every layer is a cache hit never pages the adapter's values in. Its
verdict is kept per file identity (path, and the device, inode, size, mtime and ctime
the cache's digests are memoised by), so a second merge of the same file does not read
it again.
"""

from __future__ import annotations

import os

import torch

from hostmem.vault.content_hash import stamp_of
from .lycoris_parts import ROLES, check_parts
from .read_stamps import read_as
from .spec import AdapterError

__all__ = ["NARROW", "FiniteCheck", "check_before_use", "check_change", "check_finite", "forget_checked", "widened"]

NARROW = tuple(getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
                                                  "float8_e8m0fnu") if hasattr(torch, name))
_PIECE = 1 << 24  # values widened at a time (64 MiB of float32)
_CHECKED: set[tuple] = set()  # identities of files whose every value is known finite


def _identity(path: str) -> tuple | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (os.path.realpath(path), *stamp_of(st))


def forget_checked() -> None:
    """Drop the memo of files known finite (tests, or a file rewritten within one mtime tick)."""
    _CHECKED.clear()


def check_finite(path: str, tensors: dict[str, torch.Tensor], memo: bool = True) -> None:
    """Refuse NaN or infinite values, naming the first key that holds one."""
    identity = _identity(path) if memo else None
    if identity is not None and identity in _CHECKED:
        return
    for key in sorted(tensors):
        tensor = tensors[key]
        if tensor.is_floating_point() and tensor.numel() and not _all_finite(tensor):
            bad = int((~torch.isfinite(widened(tensor))).sum())
            raise AdapterError(
                f"{path}: {key!r} holds {bad} NaN or infinite value(s) of {tensor.numel()}; merging it "
                "would write them into the model's weights. The adapter file is damaged (or trained "
                "into overflow): use another copy of it"
            )
    if identity is not None:
        _CHECKED.add(identity)


def _all_finite(tensor: torch.Tensor) -> bool:
    """Whether every value is finite, told by the smallest and the largest (a NaN anywhere
    makes both NaN; an infinity is one of them): one pass with no bool tensor, on bf16
    tens of times faster than ``isfinite(tensor).all()``, which a first start paid for
    every adapter value (a second per 43 MiB on a 2-core EPYC)."""
    if tensor.dtype in NARROW:  # torch has neither aminmax nor isfinite for fp8: its values widened, in pieces
        flat = tensor.reshape(-1)
        return all(_all_finite(flat[i:i + _PIECE].float()) for i in range(0, flat.numel(), _PIECE))
    try:
        low, high = torch.aminmax(tensor)
    except (NotImplementedError, RuntimeError):  # other dtypes without it
        return bool(torch.isfinite(tensor.float()).all())
    return bool(torch.isfinite(low)) and bool(torch.isfinite(high))


def widened(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` in float32 where it is stored in a narrow float (fp8) that torch's CPU
    kernels do not compute with (no isfinite, no multiply): the same values, as diffusers
    reads them (peft's layers copy them into the model's dtype); any other tensor as it is."""
    return tensor.float() if tensor.dtype in NARROW else tensor


class FiniteCheck:
    """The finiteness check of one file's values, run once, when they are first consumed.

    Holds the file's tensors (views of its read-only mapping: nothing is read until the
    check runs) and lets go of them once they are known finite. Calling it again is free.
    """

    def __init__(self, path: str, tensors: dict[str, torch.Tensor], memo: bool = True):
        self.path, self.memo = path, memo
        self.read_as = read_as(path)  # the file as the read that made these tensors found it
        self._tensors: dict[str, torch.Tensor] | None = tensors

    @property
    def done(self) -> bool:
        return self._tensors is None

    def __call__(self) -> None:
        tensors = self._tensors
        if tensors is not None:
            check_finite(self.path, tensors, memo=self.memo)
            self._tensors = None


def check_before_use(deltas) -> None:
    """Run the finiteness check of every file ``deltas`` come from, each file once.

    Called before a layer's values are consumed, ahead of the first one, so that a
    refused file leaves every weight as it was.
    """
    seen: set[int] = set()
    for delta in deltas:
        check = delta.values_check
        if check is not None and id(check) not in seen:
            seen.add(id(check))
            check()


def _check_alpha(path: str, key: str, alpha: torch.Tensor) -> None:
    if alpha.numel() != 1:
        raise AdapterError(
            f"{path}: {key!r} has {alpha.numel()} values (shape {tuple(alpha.shape)}); an alpha is one "
            "number. Remove the key to use alpha = rank, or write the trainer's alpha into it"
        )


def _check_factor(path: str, key: str, tensor: torch.Tensor, role: str) -> None:
    if not tensor.is_floating_point():
        raise AdapterError(f"{path}: {key!r} is {tensor.dtype}; LoRA matrices are floating point")
    if tensor.dim() not in (2, 3, 4, 5):
        raise AdapterError(
            f"{path}: {key!r} is {tensor.dim()}-D {tuple(tensor.shape)}; a LoRA {role} matrix is 2-D "
            "(linear) or 3-D to 5-D (a 1-D, 2-D or 3-D conv). Is the file a LoRA of another kind?"
        )


def check_change(path: str, parts: dict[str, torch.Tensor], keys: dict[str, str]) -> None:
    """The parts of one module's change fit together; raise :class:`AdapterError` if not."""
    if not ROLES.isdisjoint(parts):  # LoHa, LoKr, LoCon's Tucker core: their own parts
        check_parts(path, parts, keys)
    up, down = parts.get("up"), parts.get("down")
    if (up is None) != (down is None):
        have, lacking = ("up", "down") if down is None else ("down", "up")
        raise AdapterError(f"{path}: {keys[have]!r} has no matching {lacking} matrix (truncated adapter?)")
    if "alpha" in parts:
        _check_alpha(path, keys["alpha"], parts["alpha"])
    if "dora_scale" in parts and up is None and ROLES.isdisjoint(parts):
        raise AdapterError(f"{path}: {keys['dora_scale']!r} has no LoRA pair beside it (truncated adapter?)")
    if "up_b" in parts and up is None:
        raise AdapterError(f"{path}: {keys['up_b']!r} has no lora_B.weight beside it (truncated adapter?)")
    for role in ("diff", "diff_b", "up_b", "dora_scale"):
        if role in parts and not parts[role].is_floating_point():
            raise AdapterError(f"{path}: {keys[role]!r} is {parts[role].dtype}; a weight change is floating point")
    if up is None:
        if "diff" not in parts and "diff_b" not in parts and ROLES.isdisjoint(parts):
            raise AdapterError(f"{path}: {keys['alpha']!r} has no lora_up/lora_down or diff beside it")
        return
    _check_factor(path, keys["up"], up, "up")
    _check_factor(path, keys["down"], down, "down")
    if down.shape[0] == 0:
        raise AdapterError(f"{path}: {keys['down']!r} has rank 0 (shape {tuple(down.shape)}); the pair changes nothing")
    if up.shape[1] != down.shape[0]:
        raise AdapterError(
            f"{path}: {keys['up']!r} {tuple(up.shape)} and {keys['down']!r} "
            f"{tuple(down.shape)} do not multiply (rank mismatch)"
        )
