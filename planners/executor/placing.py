"""What the device path places on the device for the whole run, and puts back on exit.

Resident layers and every tensor a component holds outside its streamed layers (embeddings,
norms, a head) stand on the device for the run; the moved layers come and go through
:mod:`.device_copy`'s slots.
"""

from __future__ import annotations

import torch

__all__ = ["bring_home", "on_device", "place_outside", "put_back"]

_PAGE = 4096  # the twin's copies keep a tensor's address modulo a page


def place_outside(components: dict, roles: dict, layouts: dict, device: torch.device) -> list:
    """Resident layers and each component's tensors outside its layers go to ``device``: each
    tensor once, however many modules hold it (a tied weight: T5's ``shared`` and
    ``encoder.embed_tokens``), and every holder, a moved layer too, then holds that one
    placed tensor, so a change through one name reaches the others. Returns what
    :func:`put_back` takes: ``(host tensor, placed, its state, [(table, name), ...])``."""
    from .device_copy import standing_in

    placed_all: list = []
    made: set[int] = set()  # the placed tensors: a nested component's are placed once
    for name, component_roles in roles.items():
        root = components[name]
        inside = {id(m) for k, l in layouts[name].items() if k not in component_roles.resident
                  for m in l.module.modules()}
        theirs = _nested_modules(root, [r for n, r in components.items() if n != name])
        holders: dict[int, list] = {}  # id(tensor) -> [tensor, kind, held outside the layers, [(table, key)]]
        for module in root.modules():
            if id(module) in theirs:  # a component nested in this one places its own (its layers streamed)
                continue
            for kind, table in (("p", module._parameters), ("b", module._buffers)):
                for key, tensor in table.items():
                    if tensor is None or tensor.device.type != "cpu" or id(tensor) in made:
                        continue
                    entry = holders.setdefault(id(tensor), [tensor, kind, False, []])
                    entry[2] = entry[2] or id(module) not in inside
                    entry[3].append((table, key))
        for tensor, kind, outside, where in holders.values():
            if not outside:
                continue
            placed = standing_in(tensor, _copy(tensor, device), kind)
            for table, key in where:
                table[key] = placed
            made.add(id(placed))
            placed_all.append((tensor, placed, _state(placed), where))
    return placed_all


def put_back(placed_all: list) -> None:
    """The host tensors back where the device's stood. A weight replaced since is the
    caller's and stays; one changed through the placed tensor (``param.data = ...``, as
    ``module.to(dtype)`` and peft's safe merge do, or a write into it, ``weight.data +=``
    as peft's ``fuse_lora`` does, which no version counter sees) comes back to the host as
    it is now, never reverted to what it was at entry, keeping its ``requires_grad``.
    Every holder that still holds the placed tensor gets the one tensor back: a tie stays
    a tie."""
    from .device_copy import same_bits, standing_in

    for tensor, placed, state, where in reversed(placed_all):
        still = [(table, key) for table, key in where if table.get(key) is placed]
        if not still:
            continue
        back = tensor
        if _state(placed) != state or not same_bits(placed, tensor):
            kind = "p" if isinstance(tensor, torch.nn.Parameter) else "b"
            back = standing_in(tensor, placed.detach().to("cpu"), kind, requires_grad=tensor.requires_grad)
        for table, key in still:
            table[key] = back


def _copy(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` on ``device``: a copy on the twin too, as on a GPU, so a write into it
    (peft's ``weight.data +=``) is the device's alone and comes back at exit as on a GPU. The
    twin's copy keeps the host tensor's address modulo a page, as the twin's slots do
    (:mod:`.device_copy`): a CPU kernel's choice, and so its rounding, may depend on it."""
    source = tensor.detach()
    if device.type != "cpu":
        return source.to(device)
    if type(source) is not torch.Tensor:
        source = source.as_subclass(torch.Tensor)
    if not source.is_contiguous():
        return source.clone()
    nbytes = source.numel() * source.element_size()
    raw = torch.empty(nbytes + _PAGE, dtype=torch.uint8)
    start = (source.data_ptr() - raw.data_ptr()) % _PAGE
    out = raw[start:start + nbytes].view(source.dtype).view(source.shape)
    out.copy_(source)
    return out


def on_device(components: dict, device: torch.device) -> dict[int, torch.Tensor]:
    """The tensors the components hold on ``device`` (not the host) before a run: the
    caller's, which :func:`bring_home` leaves where they are."""
    if device.type == "cpu":
        return {}
    return {id(t): t for root in components.values() for module in root.modules()
            for table in (module._parameters, module._buffers) for t in table.values()
            if t is not None and t.device == device}


def bring_home(components: dict, device: torch.device, before: dict[int, torch.Tensor]) -> None:
    """Tensors made on ``device`` during the run, where a placed weight stood (the LoRA
    factors ``load_lora_weights`` adds beside a placed layer's weight), back to the host
    with the weights they compute with: a forward after exit would otherwise mix devices."""
    from .device_copy import standing_in

    if device.type == "cpu":
        return
    moved: dict[int, torch.Tensor] = {}
    for root in components.values():
        for module in root.modules():
            for kind, table in (("p", module._parameters), ("b", module._buffers)):
                for key, tensor in list(table.items()):
                    if tensor is None or tensor.device != device or id(tensor) in before:
                        continue
                    if id(tensor) not in moved:
                        moved[id(tensor)] = standing_in(tensor, tensor.detach().to("cpu"), kind,
                                                        requires_grad=tensor.requires_grad)
                    table[key] = moved[id(tensor)]


def _nested_modules(root: torch.nn.Module, others: list[torch.nn.Module]) -> set[int]:
    """Ids of the modules of every component of ``others`` whose root lies inside ``root``."""
    within = {id(m) for m in root.modules()} - {id(root)}
    return {id(m) for other in others if id(other) in within for m in other.modules()}


def _state(tensor: torch.Tensor) -> tuple:
    """What tells a tensor changed in place or re-pointed (``.data =``): its storage, dtype,
    shape and version (none for an inference tensor)."""
    return (tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), None if tensor.is_inference() else tensor._version)
