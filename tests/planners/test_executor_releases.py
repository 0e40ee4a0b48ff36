"""planners.execute's releases on a CPU host, which run on the executor's worker thread beside
the pass: a layer read again first waits for its release, a hook that waited for its turn
while the executor closed does nothing, and a release that fails there is counted, not
raised into a forward that has run on."""

from __future__ import annotations

import ctypes
import threading
import time

import pytest
import torch

from hostmem.procfs import PAGE_SIZE
from hostmem.residency import classify_range
from planners.executor import execute, plan_roles
from planners.executor.synthetic import load_synthetic_dit

from .test_executor_orders import FULL, _run, _same, _x
from .test_executor_orders import checkpoint, plan  # noqa: F401 - the fixtures: the same model and plan

pytestmark = pytest.mark.usefixtures("one_thread")


def test_a_layer_run_again_before_its_release_ran_computes_from_the_pages_it_read(checkpoint, plan):
    """On a CPU host a shared mapping's release runs on the executor's worker. A layer that runs
    again before its release ran (a repeat, a short pass, the next pass's first layers) waits for
    it: run after the layer's read, the release would drop the pages the layer computes from,
    and they would be read twice. The worker is held busy (a timer frees it) while the layer runs
    twice; the second time, once every release has run, its pages are still mapped."""
    model = load_synthetic_dit(checkpoint)
    layer = int(plan_roles(plan, 2)["dit"].released[-1].split(".")[1])
    weight = model.blocks[layer].proj.weight
    start = weight.data_ptr() + (-weight.data_ptr()) % PAGE_SIZE
    end = (weight.data_ptr() + weight.numel() * weight.element_size()) // PAGE_SIZE * PAGE_SIZE
    seen = []

    def look(module, args):
        if len(seen) == 1:
            run.settle()  # every release handed to the worker so far has run
        seen.append(classify_range(start, end))

    gate = threading.Event()
    with execute(plan, {"dit": model}, prefetch=2, read_ahead="madvise") as run:
        handle = model.blocks[layer].register_forward_pre_hook(look)  # after the executor's own
        run.pipelines["dit"].worker.submit(gate.wait)  # the worker busy: releases wait behind this
        timer = threading.Timer(0.5, gate.set)
        timer.start()
        try:
            with torch.no_grad():
                model(_x(), order=[layer, layer])
        finally:
            gate.set()
            timer.cancel()
            handle.remove()
    assert [r.not_resident for r in seen] == [0, 0], seen
    assert seen[1].file_backed == end - start


def test_a_pass_that_waits_for_its_turn_while_the_executor_closes_runs_on_the_weights_put_back(checkpoint, plan):
    """A forward on another thread reaches a layer's hook while ``close()`` runs (the hook waits
    for the pipelines' turn, which the exit holds): the hook does nothing (the worker that would
    take its release is gone) and the pass ends with the model's own output."""
    model = load_synthetic_dit(checkpoint)
    layer = int(plan_roles(plan, 2)["dit"].released[0].split(".")[1])
    inside, go, got = threading.Event(), threading.Event(), []
    block = model.blocks[layer]
    plain = block.forward

    def held(*args, **kwargs):
        inside.set()
        go.wait(10)
        return plain(*args, **kwargs)

    def request():
        try:
            with torch.no_grad():
                got.append(model(_x()))
        except BaseException as exc:  # noqa: BLE001 - reported below
            got.append(exc)

    run = execute(plan, {"dit": model}, prefetch=2, read_ahead="madvise").__enter__()
    block.forward = held
    thread = threading.Thread(target=request)
    thread.start()
    try:
        assert inside.wait(10)
        with run.pipelines["dit"].clock.lock:  # the layer's after-hook will wait for this
            go.set()
            time.sleep(0.3)
            run.close()
    finally:
        go.set()
        thread.join(10)
        del block.forward
    (out,) = got
    assert isinstance(out, torch.Tensor), out
    assert torch.equal(out, _run(load_synthetic_dit(checkpoint), [None])[0])


def test_a_release_that_fails_on_the_worker_is_counted_and_its_bytes_are_not(checkpoint, plan, caplog):
    """A released layer whose pages another holder locked (mlock: MADV_DONTNEED refuses them)
    cannot be released on the worker: the pass runs on, the failure is logged once and counted
    in ``failed_releases``, and its bytes are not in ``released_bytes``."""
    from .test_pin_apply import require_mlock

    model = load_synthetic_dit(checkpoint)
    layer = int(plan_roles(plan, 2)["dit"].released[0].split(".")[1])
    weight = model.blocks[layer].proj.weight
    nbytes = weight.numel() * weight.element_size()
    require_mlock(nbytes + 2 * PAGE_SIZE)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mlock.argtypes = libc.munlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    expected = _run(load_synthetic_dit(checkpoint), [FULL] * 6)
    with execute(plan, {"dit": model}, prefetch=2, read_ahead="madvise") as run:
        outs = _run(model, [FULL] * 3)
        assert libc.mlock(weight.data_ptr(), nbytes) == 0, ctypes.get_errno()
        try:
            for _ in range(3):
                run.settle()  # the worker's failures are in: the next pass's first release counts them
                outs += _run(model, [FULL])
        finally:
            libc.munlock(weight.data_ptr(), nbytes)
        passes = run.stats().passes
    _same(outs, expected)
    before, after = passes[2], passes[3:]
    assert before.failed_releases == 0 and sum(p.failed_releases for p in after) >= 2
    assert sum(p.released_bytes for p in after) < 3 * before.released_bytes
    assert len([r for r in caplog.records if "failed_releases" in r.getMessage()]) == 1


def test_a_read_ahead_dropped_before_the_readers_began_it_is_never_read(checkpoint, plan):
    """A step cache runs the first block and skips the rest: the layers read ahead after it
    leave the window unrun. Those the ``parallel`` reader's threads had not begun are not
    read at all (the threads are held busy meanwhile): read after the drop, their pages
    would stay in the page cache, beyond what the plan makes room for, until the layer's
    next release."""
    roles = plan_roles(plan, 2)["dit"]
    first, far = (int(name.split(".")[1]) for name in (roles.kept[0], roles.kept[2]))
    dropped = [f"blocks.{first + 1}", f"blocks.{first + 2}"]
    assert set(dropped) <= set(roles.released)
    model = load_synthetic_dit(checkpoint)
    gate = threading.Event()
    with execute(plan, {"dit": model}, prefetch=2, read_ahead="parallel") as run:
        _run(model, [FULL, FULL])  # the order learned, the kept layers read
        pool = run.pipelines["dit"].handles.pool()
        busy = [pool.submit(gate.wait, 10) for _ in range(8)]  # every reader thread, and more
        try:
            _run(model, [[first], [far]])  # the first's window (the two after it) is dropped at the far one
        finally:
            gate.set()
            for job in busy:
                job.result()
    for name in dropped:
        weight = model.get_submodule(name).proj.weight
        start = weight.data_ptr() + (-weight.data_ptr()) % PAGE_SIZE
        end = (weight.data_ptr() + weight.numel() * weight.element_size()) // PAGE_SIZE * PAGE_SIZE
        assert classify_range(start, end).file_backed == 0, name
