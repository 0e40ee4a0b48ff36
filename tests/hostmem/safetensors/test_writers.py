"""Writes into read-only hostmem weights: make_writable on purpose, a fatal report otherwise."""

from __future__ import annotations

import signal

import torch
from torch import nn

import hostmem
from hostmem.slots import MappedAreas
from hostmem.safetensors.writers import read_only_weights
from tests.conftest import run_python, write_safetensors


def _mapped_module(tmp_path):
    path = write_safetensors(tmp_path / "w.safetensors", {"weight": torch.randn(256, 256), "bias": torch.randn(256)})
    tensors = hostmem.load_readonly(path)
    layer = nn.Linear(256, 256)
    layer.weight = nn.Parameter(tensors["weight"], requires_grad=False)
    layer.bias = nn.Parameter(tensors["bias"], requires_grad=False)
    return layer, path


def test_make_writable_copies_mapped_weights_into_anonymous_memory(tmp_path):
    layer, path = _mapped_module(tmp_path)
    assert [n for n, _ in read_only_weights(layer.named_parameters())] == ["weight", "bias"]
    before = layer.weight.clone()
    ledger = hostmem.account(layer)
    assert ledger.totals.anonymous == 0

    copied = hostmem.make_writable(layer)

    assert copied == (256 * 256 + 256) * 4
    assert read_only_weights(layer.named_parameters()) == []
    assert hostmem.account(layer).totals.anonymous >= copied
    with torch.no_grad():
        layer.weight.add_(1)  # writable now: no fault
    assert torch.equal(layer.weight, before + 1)
    assert hostmem.make_writable(layer) == 0  # nothing read-only is left


def test_make_writable_of_a_tensor_returns_a_writable_copy_or_the_tensor(tmp_path):
    layer, _ = _mapped_module(tmp_path)
    mapped = layer.weight.detach()
    copy = hostmem.make_writable(mapped)
    assert copy is not mapped and torch.equal(copy, mapped)
    assert MappedAreas().read_only_file(copy) is None
    plain = torch.ones(4)
    assert hostmem.make_writable(plain) is plain


_WRITE_INTO_MAPPED = """
import sys, torch, hostmem
path = sys.argv[1]
hostmem.save_file({"blocks.0.attn.to_q.weight": torch.zeros(2048, 1024), "head.bias": torch.zeros(8)}, path)
weight = hostmem.load_readonly(path)["blocks.0.attn.to_q.weight"]
print("mapped", flush=True)
weight.copy_(torch.ones(2048, 1024))   # a writer hostmem knows nothing about, on every thread
"""


def test_an_unknown_writer_gets_a_fatal_report_naming_the_weight(tmp_path):
    done = run_python(_WRITE_INTO_MAPPED, str(tmp_path / "w.safetensors"))
    assert done.returncode == -signal.SIGSEGV  # it still dies of the signal, as before
    assert done.stdout == "mapped\n"
    assert done.stderr.count("hostmem: fatal SIGSEGV") == 1
    assert "'blocks.0.attn.to_q.weight'" in done.stderr and "w.safetensors" in done.stderr
    assert "hostmem.make_writable(model)" in done.stderr


def test_the_report_comes_before_faulthandler_traceback(tmp_path):
    done = run_python("import faulthandler; faulthandler.enable()\n" + _WRITE_INTO_MAPPED, str(tmp_path / "w.safetensors"))
    assert done.returncode == -signal.SIGSEGV
    report, traceback = done.stderr.find("hostmem: fatal SIGSEGV"), done.stderr.find("Fatal Python error")
    assert 0 <= report < traceback


def test_a_fault_elsewhere_gets_no_report(tmp_path):
    code = _WRITE_INTO_MAPPED.replace("weight.copy_(torch.ones(2048, 1024))", "import ctypes; ctypes.string_at(0)")
    done = run_python(code, str(tmp_path / "w.safetensors"))
    assert done.returncode == -signal.SIGSEGV
    assert "hostmem" not in done.stderr


def test_a_truncated_mapped_file_gets_a_sigbus_report(tmp_path):
    code = _WRITE_INTO_MAPPED.replace(
        "weight.copy_(torch.ones(2048, 1024))", "import os; os.truncate(path, 4096); print(float(weight.sum()))"
    )
    done = run_python(code, str(tmp_path / "w.safetensors"))
    assert done.returncode == -signal.SIGBUS
    assert "hostmem: fatal SIGBUS reading a weight mapped from" in done.stderr  # the header is gone too
    assert "was truncated" in done.stderr
