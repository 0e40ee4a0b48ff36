"""The device path (its CPU twin, ``device="cpu"``) beside the host path where a server can
part them: a weight tied between two modules and changed through one name, the executor
entered inside ``torch.inference_mode()``, a forward left by a ``KeyboardInterrupt`` and
served next from another thread, and forwards with gradients. Each run equals, bit for
bit, the same steps on the model without the executor, or is refused saying what to do."""

from __future__ import annotations

import threading

import pytest
import torch

from hostmem.errors import InputError
from planners.executor import execute
from planners.executor.synthetic import load_synthetic_dit, write_synthetic_dit

from .conftest import EXECUTOR_PATHS, synthetic_plan

LAYERS, D = 8, 64  # blocks of 16 KiB (fp32): embed and head are D x D too, so any two may be tied
ROOM = 64 << 10  # page cache for half the blocks
PATHS = EXECUTOR_PATHS
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_synthetic_dit(tmp_path_factory.mktemp("device_path") / "dit.safetensors", LAYERS, D, torch.float32)


def _x(requires_grad: bool = False):
    return torch.randn(3, 64, generator=torch.Generator().manual_seed(7)).requires_grad_(requires_grad)


def _tied(checkpoint, where: str):
    """The head tied to the embedding (two modules outside the layers, as T5's ``shared`` and
    ``encoder.embed_tokens``) or to the last block's weight (a layer and a module outside)."""
    model = load_synthetic_dit(checkpoint)
    model.head.weight = model.embed.weight if where == "outside" else model.blocks[LAYERS - 1].proj.weight
    return model


def _doubled_through_the_head(model):
    model.head.weight.data = model.head.weight.data * 2.0  # what peft's safe merge and module.to(dtype) do


@pytest.mark.parametrize("where", ["outside", "layer"])
@pytest.mark.parametrize("path", PATHS)
def test_a_tied_weight_stays_one_tensor_during_the_run_and_after_exit(checkpoint, path, where):
    reference = _tied(checkpoint, where)
    with torch.no_grad():
        expected = [reference(_x())]
        _doubled_through_the_head(reference)
        expected.append(reference(_x()))
    model = _tied(checkpoint, where)
    other = (lambda m: m.embed.weight) if where == "outside" else (lambda m: m.blocks[LAYERS - 1].proj.weight)
    with execute(synthetic_plan(checkpoint, ROOM, model), {"dit": model}, prefetch=2, **PATHS[path]) as run:
        with torch.no_grad():
            got = [model(_x())]
            run.settle()
            _doubled_through_the_head(model)
            got.append(model(_x()))
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert model.head.weight is other(model)  # still one tensor: a change through one name reaches the other
    with torch.no_grad():
        _doubled_through_the_head(model)
        _doubled_through_the_head(reference)
        assert torch.equal(model(_x()), reference(_x()))


class _Counted(torch.nn.Module):
    """A block whose forward counts its calls in a buffer of its own, the count scaling its output."""

    def __init__(self, block):
        super().__init__()
        self.inner = block.proj
        self.register_buffer("calls", torch.zeros(1), persistent=False)

    def forward(self, h):
        self.calls += 1
        return h + torch.tanh(self.inner(h)) * self.calls


def _counted(checkpoint):
    model = load_synthetic_dit(checkpoint)
    model.blocks = torch.nn.ModuleList(_Counted(b) for b in model.blocks)
    return model


@pytest.mark.parametrize("path", PATHS)
def test_entered_inside_inference_mode_reads_ahead_and_keeps_what_a_forward_writes(checkpoint, path):
    """A server that runs its whole serve loop under ``torch.inference_mode()`` enters the
    executor there too: its buffers must still take the worker's copies and the forward's writes."""
    reference = _counted(checkpoint)
    with torch.inference_mode():
        expected = [reference(_x()) for _ in range(3)]
    model = _counted(checkpoint)
    plan = synthetic_plan(checkpoint, ROOM, model)
    with torch.inference_mode(), execute(plan, {"dit": model}, prefetch=2, **PATHS[path]) as run:
        got = [model(_x()) for _ in range(3)]
        passes = run.stats().passes
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert [b.calls.item() for b in model.blocks] == [3.0] * LAYERS
    assert [p.failed_read_aheads for p in passes] == [0, 0, 0]
    if path == "twin":
        assert [p.late_layers for p in passes] == [0, 0, 0]  # every copy was made ahead, by the worker


@pytest.mark.parametrize("path", PATHS)
def test_a_forward_left_by_keyboard_interrupt_leaves_the_next_request_from_another_thread_free(checkpoint, path):
    with torch.no_grad():
        expected = load_synthetic_dit(checkpoint)(_x())
    model = load_synthetic_dit(checkpoint)
    block, armed = model.blocks[5], []
    weight, forward = block.proj.weight, block.forward

    def interrupted(h):
        if armed:
            armed.clear()
            raise KeyboardInterrupt("Ctrl+C while a request runs")
        return forward(h)

    block.forward = interrupted
    served = {}

    def serve():
        with torch.no_grad():
            served["out"] = model(_x())

    with torch.no_grad(), execute(synthetic_plan(checkpoint, ROOM, model), {"dit": model}, prefetch=2,
                                  **PATHS[path]):
        model(_x())
        armed.append(True)
        with pytest.raises(KeyboardInterrupt):
            model(_x())
        assert block.proj.weight is weight  # the interrupted layer has its host tensor back
        again = model(_x())
        other = threading.Thread(target=serve, daemon=True)
        other.start()
        other.join(timeout=10)
        assert not other.is_alive(), "the other thread's request waits for a turn the interrupted pass held"
    assert torch.equal(again, expected) and torch.equal(served["out"], expected)


@pytest.mark.parametrize("wanted", ["input", "weights"])
@pytest.mark.parametrize("path", PATHS)
def test_gradients_on_the_host_path_and_inference_on_the_device_path(checkpoint, path, wanted):
    """A gradient with respect to the input (guidance) or to the weights (training a part):
    the host path gives torch's own. The device path, whose slots are refilled before a
    backward could read them, serves inference: an input that requires grad is refused
    naming what to run under; weights that require grad (as from_pretrained leaves them)
    are no wish for gradients, so a plain call with grad enabled serves the model's output
    with none recorded (a backward then says there is no graph, rather than giving the
    weights outside the layers gradients and the moved ones none), and serves on after."""
    def build():
        model = load_synthetic_dit(checkpoint)
        return model.requires_grad_(True) if wanted == "weights" else model

    def gradients(model):
        x = _x(requires_grad=wanted == "input")
        model(x).square().sum().backward()
        return [x.grad] if wanted == "input" else [p.grad for p in model.parameters()]

    expected = gradients(build())
    with torch.no_grad():
        output = build()(_x())
    model = build()
    with execute(synthetic_plan(checkpoint, ROOM, model), {"dit": model}, prefetch=2, **PATHS[path]):
        if path == "twin" and wanted == "input":
            with pytest.raises(InputError, match=r"dit\.blocks\.0: .*torch\.no_grad\(\) or torch\.inference_mode"):
                gradients(model)
        elif path == "twin":
            served = model(_x())  # grad enabled, no torch.no_grad(): what a plain call serves
            assert torch.equal(served, output) and not served.requires_grad
            with pytest.raises(RuntimeError, match="does not require grad"):
                gradients(model)
        else:
            assert all(torch.equal(a, b) for a, b in zip(gradients(model), expected))
        with torch.no_grad():
            assert torch.equal(model(_x()), output)


def test_a_weight_changed_on_the_device_path_keeps_its_requires_grad_after_exit(checkpoint):
    """``module.to(dtype)`` inside the run: the weights outside the layers come back changed,
    and as trainable as they were (diffusers' ``from_pretrained`` leaves them requiring grad)."""
    model = load_synthetic_dit(checkpoint).requires_grad_(True)
    with execute(synthetic_plan(checkpoint, ROOM, model), {"dit": model}, device="cpu", prefetch=2):
        model.to(torch.float64)
    assert all(p.requires_grad and p.dtype == torch.float64 for p in model.parameters())


def test_an_input_that_requires_grad_inside_a_dict_or_list_counts_as_one():
    """SDXL's ``added_cond_kwargs``: a dict among the arguments; such an input asks for
    gradients as a plain one does (and is refused on the device path, not run without)."""
    from planners.executor.forward_guard import _wants_grad

    leaf = torch.ones(2, requires_grad=True)
    assert _wants_grad((), {"added_cond_kwargs": {"text_embeds": [torch.ones(2), leaf]}})
    assert _wants_grad(((torch.ones(1), (leaf,)),), {})
    assert not _wants_grad((torch.ones(2),), {"added_cond_kwargs": {"time_ids": torch.ones(2)}, "n": 3})


def _another_threads_request(model) -> torch.Tensor | None:
    """A request served from another thread, as a server's next one; None where it waits for good."""
    served = {}

    def serve():
        with torch.no_grad():
            served["out"] = model(_x())

    other = threading.Thread(target=serve, daemon=True)
    other.start()
    other.join(timeout=20)
    return None if other.is_alive() else served["out"]


@pytest.mark.parametrize("where", ["pre-hook", "forward set back"])
def test_an_interrupt_no_wrapper_sees_leaves_the_turn_to_the_next_request(checkpoint, where):
    """Ctrl+C in a pre-hook that runs after the executor's (the turn taken, the forward not
    begun), or in the first call after another library set the component's forward back to
    one it kept from before the executor (its wrapper gone for that call): the turn is taken
    back by the next request of any thread, and every output is the model's."""
    import types

    with torch.no_grad():
        expected = load_synthetic_dit(checkpoint)(_x())
    model = load_synthetic_dit(checkpoint)
    armed = []

    def pre_hook(module, args):
        if armed and where == "pre-hook":
            armed.clear()
            raise KeyboardInterrupt("Ctrl+C in a pre-hook")

    block, forward = model.blocks[5], model.blocks[5].forward

    def interrupted(h):
        if armed:
            armed.clear()
            raise KeyboardInterrupt("Ctrl+C while a request runs")
        return forward(h)

    with torch.no_grad(), execute(synthetic_plan(checkpoint, ROOM, model), {"dit": model}, prefetch=2,
                                  **PATHS["twin"]):
        model(_x())
        if where == "pre-hook":
            model.register_forward_pre_hook(pre_hook)  # after the executor's: it runs once the turn is taken
        else:
            block.forward = interrupted
            model.forward = types.MethodType(type(model).forward, model)  # a library's hook, taken off
        armed.append(True)
        with pytest.raises(KeyboardInterrupt):
            model(_x())
        served = _another_threads_request(model)
        assert served is not None, "the other thread's request waits for a turn the interrupted pass held"
        again = model(_x())
        assert _another_threads_request(model) is not None  # and this thread's pass gave its turn back
    assert torch.equal(served, expected) and torch.equal(again, expected)
    assert all(p.is_cpu and not p.is_inference() for p in model.parameters())


@pytest.mark.parametrize("where", ["in a layer", "before the executor's pre-hook"])
@pytest.mark.parametrize("path", PATHS)
def test_leaving_the_executor_while_another_thread_is_mid_pass_lets_that_pass_end_right(checkpoint, path, where):
    """A server that shuts down with a request in flight: the exit waits for a pass under
    way on the device path (its layers compute from slots the exit takes down), and a call
    whose hooks torch gathered before the exit took them off runs on the weights put back;
    neither raises (it raised "cannot schedule new futures after shutdown")."""
    with torch.no_grad():
        expected = load_synthetic_dit(checkpoint)(_x())
    model = load_synthetic_dit(checkpoint)
    entered, go = threading.Event(), threading.Event()

    def hold():
        if not entered.is_set():
            entered.set()
            go.wait(10)

    if where == "in a layer":
        block, forward = model.blocks[3], model.blocks[3].forward
        block.forward = lambda h: (hold(), forward(h))[1]
    run = execute(synthetic_plan(checkpoint, ROOM, model), {"dit": model}, prefetch=2, **PATHS[path])
    if where != "in a layer":  # put first, so the executor's own pre-hook runs after it
        model._forward_pre_hooks[-1] = lambda module, args: hold()
        model._forward_pre_hooks.move_to_end(-1, last=False)
    served, errors = [], []
    run.__enter__()
    request = _request_in_a_thread(model, served, errors)
    assert entered.wait(10)
    closing = _exit_in_a_thread(run)
    closing.join(0.5 if where == "in a layer" else 20)  # the gathered hooks' case: the exit is done first
    go.set()
    request.join(20)
    closing.join(20)
    assert not request.is_alive() and not closing.is_alive()
    assert errors == [] and torch.equal(served[0], expected)
    with torch.no_grad():
        assert torch.equal(model(_x()), expected)  # after the exit: the model as it was


def test_a_request_that_comes_while_the_exit_waits_for_a_pass_waits_and_runs_on_the_weights_put_back(checkpoint):
    """The exit holds the component's turn while it waits for a pass in flight; a request
    that comes meanwhile waits for the turn (it took the turn back from the exit as from an
    interrupted pass, and began a pass on the pipeline being taken down), then runs on the
    weights put back."""
    with torch.no_grad():
        expected = load_synthetic_dit(checkpoint)(_x())
    model = load_synthetic_dit(checkpoint)
    entered, go = threading.Event(), threading.Event()
    block, forward = model.blocks[3], model.blocks[3].forward

    def held(h):
        if not entered.is_set():
            entered.set()
            go.wait(10)
        return forward(h)

    block.forward = held
    served, errors = [], []
    run = execute(synthetic_plan(checkpoint, ROOM, model), {"dit": model}, prefetch=2, **PATHS["twin"])
    run.__enter__()
    first = _request_in_a_thread(model, served, errors)
    assert entered.wait(10)
    closing = _exit_in_a_thread(run)
    closing.join(0.3)  # the exit waits for the first request's pass
    later = _request_in_a_thread(model, served, errors)
    later.join(1.2)  # past the turn's look for a holder with no call under way
    go.set()
    for thread in (first, closing, later):
        thread.join(20)
        assert not thread.is_alive()
    assert errors == [] and len(served) == 2 and all(torch.equal(out, expected) for out in served)


def _request_in_a_thread(model, served: list, errors: list) -> threading.Thread:
    """A request from another thread, started: its output goes to ``served``, what it raised to ``errors``."""
    def serve():
        try:
            with torch.no_grad():
                served.append(model(_x()))
        except Exception as exc:  # noqa: BLE001 (what the request would have raised)
            errors.append(exc)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return thread


def _exit_in_a_thread(run) -> threading.Thread:
    """The executor's exit, started in a thread of its own (a server shutting down)."""
    thread = threading.Thread(target=run.__exit__, args=(None, None, None), daemon=True)
    thread.start()
    return thread
