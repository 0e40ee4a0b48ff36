"""A fresh process per call, forked from a server that has only imported the libraries.

A test of what a second start finds on disk needs each start in a process of its own: a
start in the test's own process would inherit what other tests left in memory there
(kernel choices, memos). A new interpreter gives that, and spends most of its few
seconds importing torch (1.3-1.9 s), diffusers and peft (3-4 s more). Here one server per
test process and set of libraries (a child interpreter) imports them once and runs
nothing else; for each call it forks, and the fork runs the call and exits: a process
with those imports done and nothing else in memory. A server ends when the test process
closes its stdin (at its exit).

Two kinds of call:

- :func:`fresh_call`: a module-level function, arguments and result as JSON;
- :func:`forked_python`: what ``python -c CODE ARGS`` does, with the caller's
  environment and folder, stdin empty, stdout and stderr captured, the exit status as
  the interpreter gives it (``SystemExit``, a traceback and 1, a signal's negative
  number, the non-daemon threads and ``atexit`` handlers run before it exits).

What a fork is not: a child of the test process (its parent is the server), a process
whose memory starts empty (it shares the server's imports copy-on-write), or one that
imports a library after the test set something up (they are imported already). Tests of
process trees, of a process's peak memory, of import hooks or of the interpreter's own
shutdown start a real interpreter (``tests.conftest.run_python``).
"""

from __future__ import annotations

import atexit
import functools
import json
import multiprocessing
import os
import select
import subprocess
import sys
import tempfile
import threading
import time

__all__ = ["CLI", "CLIENTS", "PRELOAD", "TORCH", "forked_python", "fresh_call", "rank_context", "with_parent_stdio"]

PRELOAD = ("torch", "diffusers", "peft", "lora_cache", "lora_cache.diffusers_entry", "tests.conformance.models")
TORCH = ("torch", "safetensors.torch")  # what nearly every child imports first, and no module of ours
CLIENTS = (*TORCH, "diffusers", "peft")  # the real clients a test compares with, and no module of ours
CLI = "import runpy\nrunpy.run_module('planners.cli', run_name='__main__', alter_sys=True)\n"  # python -m planners.cli

_SERVER = r"""
import atexit, importlib, json, os, signal, sys, threading, traceback, types, warnings
for name in sys.argv[1:]:
    importlib.import_module(name)
out = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)  # what a call prints goes to stderr; stdout carries the JSON lines of each call


def _exit_status(exc):
    if exc is None:
        return 0
    if isinstance(exc, SystemExit):
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        print(exc.code, file=sys.stderr)
        return 1
    traceback.print_exception(exc)
    return 1


def run_script(request):
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    for fd, (path, flags) in enumerate([(os.devnull, os.O_RDONLY), (request["out"], os.O_WRONLY),
                                        (request["err"], os.O_WRONLY)]):
        opened = os.open(path, flags)
        os.dup2(opened, fd)
        os.close(opened)
    for option in filter(None, request["env"].get("PYTHONWARNINGS", "").split(",")):
        warnings._setoption(option)  # as the interpreter reads it at its start
    sys.argv = ["-c", *request["args"]]
    main = types.ModuleType("__main__")
    sys.modules["__main__"] = main
    exc = None
    try:
        exec(compile(request["script"], "<string>", "exec"), main.__dict__)
    except BaseException as caught:
        exc = caught
    interrupted = isinstance(exc, KeyboardInterrupt)
    status = 0 if interrupted else _exit_status(exc)
    if interrupted:
        traceback.print_exception(exc)
    threading._shutdown()  # what the interpreter does at exit: non-daemon threads, then atexit
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    if interrupted:  # as the interpreter ends on an uncaught KeyboardInterrupt
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(status)


def run_function(request, write):
    try:
        module, _, name = request["function"].rpartition(".")
        answer = {"result": getattr(importlib.import_module(module), name)(*request["args"])}
    except BaseException:
        answer = {"error": traceback.format_exc()}
    with os.fdopen(write, "w") as pipe:
        pipe.write(json.dumps(answer))
    os._exit(0)


for line in sys.stdin:
    request = json.loads(line)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        if "script" in request:
            os.close(write)
            run_script(request)
        run_function(request, write)
    os.close(write)
    if "script" in request:
        out.write(json.dumps({"pid": pid}) + "\n")
        out.flush()
    with os.fdopen(read) as pipe:
        text = pipe.read()
    _, status = os.waitpid(pid, 0)
    if "script" in request:
        answer = {"returncode": os.waitstatus_to_exitcode(status)}
    else:
        answer = json.loads(text) if text else {"error": f"the child ended with wait status {status} and no answer"}
    out.write(json.dumps(answer) + "\n")
    out.flush()
"""

_servers: dict[tuple[str, ...], subprocess.Popen] = {}
_lock = threading.Lock()
_unread: dict[int, bytes] = {}  # a server's stdout (its descriptor) -> bytes read past the last whole line


def _started(preload: tuple[str, ...]) -> subprocess.Popen:
    server = _servers.get(preload)
    if server is None or server.poll() is not None:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
        server = _servers[preload] = subprocess.Popen([sys.executable, "-c", _SERVER, *preload],
                                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        _unread.pop(server.stdout.fileno(), None)  # a dead server's descriptor number, taken again
        atexit.register(_stop, server)
    return server


def _stop(server: subprocess.Popen) -> None:
    if server.poll() is None:
        server.stdin.close()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def _ask(server: subprocess.Popen, request: dict) -> None:
    server.stdin.write(json.dumps(request) + "\n")
    server.stdin.flush()


def _answer(server: subprocess.Popen, deadline: float | None = None) -> dict | None:
    """The server's next line, or None once ``deadline`` (monotonic) passed first. Read from
    the descriptor itself: a buffered reader could take the next line along with this one,
    and a wait on the descriptor would then miss it."""
    fd = server.stdout.fileno()
    got = _unread.pop(fd, b"")
    while b"\n" not in got:
        if deadline is not None and not select.select([fd], [], [], max(0.0, deadline - time.monotonic()))[0]:
            _unread[fd] = got
            return None
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            raise RuntimeError(f"the fork server ended (exit status {server.wait()})")
        got += chunk
    line, _, rest = got.partition(b"\n")
    _unread[fd] = rest
    return json.loads(line)


def fresh_call(function, *args):
    """``function(*args)`` in a new process forked from the preloaded server; its result.

    ``function`` is a module-level function of an importable module; ``args`` and the
    result travel as JSON. An exception in the child is raised here with its traceback."""
    with _lock:
        server = _started(PRELOAD)
        _ask(server, {"function": f"{function.__module__}.{function.__qualname__}", "args": list(args)})
        answer = _answer(server)
    if "error" in answer:
        raise RuntimeError(f"{function.__qualname__} failed in a fresh process:\n{answer['error']}")
    return answer["result"]


def forked_python(code: str, *args: str, cwd: str | None = None, env: dict | None = None, timeout: float = 120,
                  preload: tuple[str, ...] = TORCH) -> subprocess.CompletedProcess:
    """``python -c code args`` in a process forked from a server that imported ``preload``:
    the finished process, its output as text (see the module's docstring for what differs
    from a new interpreter). Past ``timeout`` seconds it is killed and
    :class:`subprocess.TimeoutExpired` raised, as :func:`subprocess.run` does."""
    command = [sys.executable, "-c", code, *args]
    with tempfile.TemporaryDirectory(prefix="hostmem-fork-") as folder, _lock:
        out, err = os.path.join(folder, "out"), os.path.join(folder, "err")
        for path in (out, err):
            open(path, "w").close()
        server = _started(preload)
        _ask(server, {"script": code, "args": list(args), "cwd": os.fspath(cwd or os.getcwd()),
                      "env": dict(os.environ if env is None else env), "out": out, "err": err})
        pid = _answer(server)["pid"]
        answer = _answer(server, time.monotonic() + timeout)
        if answer is None:
            os.kill(pid, 9)
            _answer(server)
        with open(out) as o, open(err) as e:
            stdout, stderr = o.read(), e.read()
    if answer is None:
        raise subprocess.TimeoutExpired(command, timeout, stdout, stderr)
    return subprocess.CompletedProcess(command, answer["returncode"], stdout, stderr)


def rank_context():
    """The multiprocessing context for ranks of a process group: each forked from
    multiprocessing's fork server, which imports :data:`TORCH` once per test process (a
    rank spawned anew spends 1.3-1.9 s importing torch). A rank still prepares as a
    spawned one does (the parent's ``sys.path`` and folder, its target's module
    imported); its output goes where the fork server's does unless its target is wrapped
    by :func:`with_parent_stdio`."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(TORCH))
    return context


class _ParentStdio:
    """Pickled into a process being started: unpickled in it, that process's stdout and
    stderr become the parent's at the start (where ``capfd`` reads them)."""

    def __reduce__(self):
        from multiprocessing import reduction

        return _adopt_stdio, (reduction.DupFd(1), reduction.DupFd(2))


def _adopt_stdio(out, err) -> str:
    for fd, passed in ((1, out), (2, err)):
        got = passed.detach()
        os.dup2(got, fd)
        os.close(got)
    return "adopted"


def _run_with(stdio: str, target, *args):
    return target(*args)


def with_parent_stdio(target):
    """``target`` as a process of :func:`rank_context` runs it, writing to this process's
    stdout and stderr as they are now."""
    return functools.partial(_run_with, _ParentStdio(), target)
