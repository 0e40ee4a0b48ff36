"""The corpus's LyCORIS files beyond LoCon: LoHa, LoKr and LoCon's Tucker core, on linear
layers (a Wan) and on an SD 1.x UNet's 3x3 and 1x1 convs, each held to LyCORIS's
definition written here in float64 from ``lycoris/functional`` (``loha.py``, ``lokr.py``,
``locon.py``, ``general.py``), and ComfyUI's ``weight_decompose`` where a ``dora_scale``
sits beside the factors; and the kinds lora_cache refuses by name (IA3, GLoRA, OFT).

Files are written by the trainer's key scheme (``lycoris/modules/*.py``'s
``custom_state_dict``): ``lycoris_<module with underscores>`` on the Wan, kohya's
``lora_unet_`` names on the UNet. The expected change at strength 1 is written beside each
file (``<file>.expected``), computed at write time from the model's own weights.

:func:`rows` gives each file as the keyword arguments of a
:class:`tests.conformance.corpus.Case` (this module does not import it).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from hostmem.safetensors.mapping import save_file

RANK = 4
_EPS = torch.finfo(torch.float32).eps


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _tucker(core, side_b, side_a):
    """LyCORIS's ``rebuild_tucker``: ``einsum("i j ..., i p, j r -> p r ...", core, a, b)``."""
    return torch.einsum("i j ..., i p, j r -> p r ...", core.double(), side_a.double(), side_b.double())


def loha_delta(parts: dict, shape) -> torch.Tensor:
    """``alpha / rank * (w1_a @ w1_b) * (w2_a @ w2_b)`` (each half through its Tucker core where
    one is stored), reshaped to the weight (lycoris/functional/loha.py, ComfyUI's loha.py)."""
    def half(n: int) -> torch.Tensor:
        a, b, core = parts[f"hada_w{n}_a"].double(), parts[f"hada_w{n}_b"].double(), parts.get(f"hada_t{n}")
        return (a @ b).reshape(shape) if core is None else _tucker(core, b, a)
    alpha = float(parts["alpha"]) if "alpha" in parts else RANK
    return half(1) * half(2) * alpha / parts["hada_w1_b"].shape[0]


def lokr_delta(parts: dict, shape) -> torch.Tensor:
    """``scale * kron(w1, w2)`` (lycoris/functional/lokr.py's ``make_kron``: ``w1`` gains unit
    axes up to ``w2``'s dims), each half rebuilt from its pair or Tucker core; alpha / rank
    only where a half is a pair (the rank: that pair's), else 1."""
    p = {k: v.double() for k, v in parts.items()}
    w1 = p["lokr_w1"] if "lokr_w1" in p else p["lokr_w1_a"] @ p["lokr_w1_b"]
    if "lokr_w2" in p:
        w2 = p["lokr_w2"]
    elif "lokr_t2" in p:
        w2 = _tucker(p["lokr_t2"], p["lokr_w2_b"], p["lokr_w2_a"])
    else:
        w2 = (p["lokr_w2_a"] @ p["lokr_w2_b"]).reshape(p["lokr_w2_a"].shape[0], -1, *shape[2:])
    while w1.dim() < w2.dim():
        w1 = w1.unsqueeze(-1)
    pair = p.get("lokr_w1_b", p.get("lokr_w2_b"))
    scale = 1.0 if pair is None else float(p.get("alpha", pair.shape[0])) / pair.shape[0]
    return (torch.kron(w1, w2.contiguous()) * scale).reshape(shape)


def tucker_locon_delta(parts: dict, shape) -> torch.Tensor:
    """``alpha / rank * einsum("i j ..., o i, j n -> o n ...", mid, up, down)``
    (lycoris/functional/general.py's ``tucker_weight_from_conv``)."""
    up, down = parts["lora_up.weight"].double().flatten(1), parts["lora_down.weight"].double().flatten(1)
    delta = torch.einsum("i j ..., o i, j n -> o n ...", parts["lora_mid.weight"].double(), up, down)
    return delta.reshape(shape) * float(parts["alpha"]) / down.shape[0]


def comfyui_decompose(weight: torch.Tensor, change: torch.Tensor, dora_scale: torch.Tensor, strength: float):
    """ComfyUI's ``weight_decompose`` (comfy/weight_adapter/base.py) in float64 for the scaled
    change ``change`` (alpha / rank included): C = W + change; on the output axis (dora_scale's
    first size is the weight's rows) each row normed on W, else each input channel normed on C
    over the rows and the kernel; D = C * dora_scale / (norm + float32's eps); W + strength * (D - W)."""
    w = weight.double()
    c = w + change.reshape(w.shape)
    if dora_scale.shape[0] == w.shape[0]:
        norm = w.reshape(w.shape[0], -1).norm(dim=1).reshape(-1, *[1] * (w.dim() - 1))
    else:
        norm = c.transpose(0, 1).reshape(w.shape[1], -1).norm(dim=1).reshape(1, -1, *[1] * (w.dim() - 2))
    return w + strength * (c * dora_scale.double() / (norm + _EPS) - w)


def _randn(gen, *shape, std: float = 0.15) -> torch.Tensor:
    return torch.randn(*shape, generator=gen) * std


def _loha(gen, shape, tucker: bool = False) -> dict:
    rows, cols, kernel = shape[0], shape[1], tuple(shape[2:])
    parts = {"alpha": torch.tensor(2.0)}
    for n in (1, 2):
        if tucker:
            parts |= {f"hada_t{n}": _randn(gen, RANK, RANK, *kernel), f"hada_w{n}_a": _randn(gen, RANK, rows),
                      f"hada_w{n}_b": _randn(gen, RANK, cols)}
        else:
            parts |= {f"hada_w{n}_a": _randn(gen, rows, RANK), f"hada_w{n}_b": _randn(gen, RANK, cols * _prod(kernel))}
    return parts


def _prod(sizes) -> int:
    out = 1
    for size in sizes:
        out *= size
    return out


def _lokr(w1: str, w2: str, left: tuple[int, int]) -> Callable:
    """A LoKr builder: ``w1`` / ``w2`` each ``whole`` or ``pair`` (``w2`` also ``tucker``),
    ``left`` the first half's (rows, cols); the second half takes the rest of the weight."""
    def build(gen, shape) -> dict:
        (a, c), kernel = left, tuple(shape[2:])
        b, d = shape[0] // a, shape[1] // c
        parts = {"alpha": torch.tensor(1.0)}
        parts |= {"lokr_w1": _randn(gen, a, c)} if w1 == "whole" else \
            {"lokr_w1_a": _randn(gen, a, 2), "lokr_w1_b": _randn(gen, 2, c)}
        if w2 == "whole":
            parts["lokr_w2"] = _randn(gen, b, d, *kernel, std=0.01)
        elif w2 == "tucker":
            parts |= {"lokr_t2": _randn(gen, 2, 2, *kernel), "lokr_w2_a": _randn(gen, 2, b),
                      "lokr_w2_b": _randn(gen, 2, d, std=0.05)}
        else:  # LyCORIS's module stores a conv's second pair flat: (rank, d * kh * kw)
            parts |= {"lokr_w2_a": _randn(gen, b, 2), "lokr_w2_b": _randn(gen, 2, d * _prod(kernel), std=0.05)}
        return parts
    return build


def _tucker_locon(gen, shape) -> dict:
    rows, cols, kernel = shape[0], shape[1], tuple(shape[2:])
    ones = (1,) * len(kernel)
    return {"lora_down.weight": _randn(gen, RANK, cols, *ones), "lora_mid.weight": _randn(gen, RANK, RANK, *kernel),
            "lora_up.weight": _randn(gen, rows, RANK, *ones, std=0.01), "alpha": torch.tensor(2.0)}


def _writer(name: str, kind: str, plan: dict[str, tuple[Callable, Callable]], dora: bool = False,
            seed: int = 41) -> Callable[[str, str], str]:
    """Write ``{module: (build(gen, shape) -> parts, delta(parts, shape))}`` on the ``kind`` model
    by the trainer's names, and beside it the expected change at strength 1 (ComfyUI's
    ``weight_decompose`` of it where ``dora`` adds an output-axis ``dora_scale``)."""
    def write(folder: str, model_folder: str) -> str:
        from tests.conformance.models import load_model, weights

        base, gen, tensors, expected = weights(load_model(kind, model_folder)), _gen(seed), {}, {}
        for module, (build, delta) in plan.items():
            stem = ("lycoris_" if kind == "wan" else "lora_unet_") + module.replace(".", "_")
            weight = base[f"{module}.weight"]
            parts = build(gen, tuple(weight.shape))
            change = delta(parts, tuple(weight.shape))
            if dora:
                norms = weight.reshape(weight.shape[0], -1).norm(dim=1).reshape(-1, *[1] * (weight.dim() - 1))
                parts["dora_scale"] = norms * (1 + 0.02 * torch.randn(norms.shape, generator=gen))  # trained a little
                change = comfyui_decompose(weight, change, parts["dora_scale"], 1.0) - weight.double()
            tensors |= {f"{stem}.{part}": value.contiguous() for part, value in parts.items()}
            expected[f"{module}.weight"] = change.contiguous()
        path = os.path.join(folder, f"{name}.safetensors")
        save_file(tensors, path)
        save_file(expected, path + ".expected")
        return path
    return write


def expected_beside(path: str) -> dict:
    from safetensors.torch import load_file

    return {name: value.double() for name, value in load_file(path + ".expected").items()}


_Q, _FFN_IN, _FFN_OUT, _K = ("blocks.0.attn1.to_q", "blocks.1.ffn.net.0.proj", "blocks.1.ffn.net.2",
                             "blocks.0.attn1.to_k")
_CONV0, _CONV1, _SHORTCUT, _UP_CONV = ("down_blocks.0.resnets.0.conv1", "down_blocks.1.resnets.0.conv1",
                                       "down_blocks.1.resnets.0.conv_shortcut", "up_blocks.1.resnets.0.conv1")
_UNET_Q = "down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q"


def _refused_file(name: str, parts: dict) -> Callable[[str, str], str]:
    def write(folder: str, _model: str) -> str:
        path = os.path.join(folder, f"{name}.safetensors")
        save_file({f"lycoris_blocks_0_attn1_to_q.{part}": value for part, value in parts.items()}, path)
        return path
    return write


_LOHA_WAN = {m: (_loha, loha_delta) for m in (_Q, _FFN_IN, _FFN_OUT)}
_MERGED = [  # (name, kind, layout, alpha from, plan, dora, strength)
    ("wan-lycoris-loha", "wan", "LyCORIS LoHa (`hada_w1_a` ...)", "`.alpha` over `hada_w1_b`'s rank", _LOHA_WAN,
     False, 0.8),
    ("unet-lycoris-loha-conv", "unet", "LyCORIS LoHa on 3x3 convs, Tucker cores (`hada_t1`, `hada_t2`)",
     "`.alpha` over `hada_w1_b`'s rank", {_CONV0: (_loha, loha_delta), _UNET_Q: (_loha, loha_delta),
                                          _CONV1: (lambda g, s: _loha(g, s, tucker=True), loha_delta)}, False, 1.0),
    ("wan-lycoris-lokr", "wan", "LyCORIS LoKr (`lokr_w1`, `lokr_w2_a/_b` ...)",
     "`.alpha` over the rank of a half stored as a pair; none when both are whole",
     {_Q: (_lokr("whole", "pair", (4, 4)), lokr_delta), _K: (_lokr("pair", "pair", (4, 4)), lokr_delta),
      _FFN_IN: (_lokr("pair", "whole", (4, 4)), lokr_delta), _FFN_OUT: (_lokr("whole", "whole", (4, 4)), lokr_delta)},
     False, 0.8),
    ("unet-lycoris-lokr-conv", "unet", "LyCORIS LoKr on 3x3 and 1x1 convs, Tucker core (`lokr_t2`)",
     "`.alpha` over the rank of a half stored as a pair; none when both are whole",
     {_CONV0: (_lokr("whole", "whole", (4, 4)), lokr_delta), _CONV1: (_lokr("whole", "tucker", (8, 4)), lokr_delta),
      _UP_CONV: (_lokr("whole", "pair", (4, 8)), lokr_delta), _SHORTCUT: (_lokr("pair", "pair", (8, 4)), lokr_delta)},
     False, 1.0),
    ("unet-lycoris-locon-tucker", "unet", "LyCORIS LoCon with a Tucker core (`lora_mid`) on 3x3 convs",
     "`.alpha` over `lora_down`'s rank", {_CONV0: (_tucker_locon, tucker_locon_delta),
                                          _UP_CONV: (_tucker_locon, tucker_locon_delta)}, False, 0.7),
    ("wan-lycoris-loha-dora", "wan", "LyCORIS LoHa with DoRA (`.dora_scale` (out, 1))", "`.alpha`", _LOHA_WAN,
     True, 0.8),
]
_REFUSED = [  # (name, layout, parts, the refusal)
    ("wan-lycoris-ia3", "LyCORIS IA3 (`.weight`, `.on_input`)",
     {"weight": torch.zeros(24), "on_input": torch.tensor(0)}, "of a kind lora_cache does not merge, IA3"),
    ("wan-lycoris-glora", "LyCORIS GLoRA (`a1.weight` ...)",
     {f"{p}.weight": torch.zeros(*s) for p, s in (("a1", (24, 4)), ("a2", (4, 24)), ("b1", (24, 4)), ("b2", (4, 24)))},
     "of a kind lora_cache does not merge, GLoRA"),
    ("wan-lycoris-oft", "LyCORIS OFT / BOFT (`oft_blocks`)", {"oft_blocks": torch.zeros(4, 6, 6)},
     "of a kind lora_cache does not merge, OFT or BOFT"),
]


def rows() -> list[dict]:
    merged = [dict(name=name, kind=kind, layout=layout, alpha_from=alpha_from, write=_writer(name, kind, plan, dora),
                   reference="comfyui" if dora else "lycoris", spec={"strength": strength}, expected=expected_beside)
              for name, kind, layout, alpha_from, plan, dora, strength in _MERGED]
    refused = [dict(name=name, kind="wan", layout=layout, alpha_from="-", write=_refused_file(name, parts),
                    reference="refused", refusal=refusal) for name, layout, parts, refusal in _REFUSED]
    return merged + refused
