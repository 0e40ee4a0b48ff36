"""A fresh process per call, forked from a server that has only imported the libraries.

A test of what a second start finds on disk needs each start in a process of its own: a
start in the test's own process would inherit what other tests left in memory there
(kernel choices, memos). A new interpreter gives that, and spends most of its few
seconds importing torch, diffusers and peft. Here one server per test process (a child
interpreter) imports :data:`PRELOAD` once and runs nothing else; for each call it forks,
and the fork runs the function and exits: a process with those imports done and nothing
else in memory. The server ends when the test process closes its stdin (at its exit).
"""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import threading

__all__ = ["PRELOAD", "fresh_call"]

PRELOAD = ["torch", "diffusers", "peft", "lora_cache", "lora_cache.diffusers_entry", "tests.conformance.models"]

_SERVER = r"""
import importlib, json, os, sys, traceback
for name in sys.argv[1:]:
    importlib.import_module(name)
out = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)  # what a call prints goes to stderr; stdout carries one JSON line per call
for line in sys.stdin:
    request = json.loads(line)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            module, _, name = request["function"].rpartition(".")
            answer = {"result": getattr(importlib.import_module(module), name)(*request["args"])}
        except BaseException:
            answer = {"error": traceback.format_exc()}
        with os.fdopen(write, "w") as pipe:
            pipe.write(json.dumps(answer))
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        text = pipe.read()
    _, status = os.waitpid(pid, 0)
    answer = json.loads(text) if text else {"error": f"the child ended with wait status {status} and no answer"}
    out.write(json.dumps(answer) + "\n")
    out.flush()
"""

_server: subprocess.Popen | None = None
_lock = threading.Lock()


def _started() -> subprocess.Popen:
    global _server
    if _server is None or _server.poll() is not None:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
        _server = subprocess.Popen([sys.executable, "-c", _SERVER, *PRELOAD], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, text=True, env=env)
        atexit.register(_stop, _server)
    return _server


def _stop(server: subprocess.Popen) -> None:
    if server.poll() is None:
        server.stdin.close()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def fresh_call(function, *args):
    """``function(*args)`` in a new process forked from the preloaded server; its result.

    ``function`` is a module-level function of an importable module; ``args`` and the
    result travel as JSON. An exception in the child is raised here with its traceback."""
    with _lock:
        server = _started()
        server.stdin.write(json.dumps({"function": f"{function.__module__}.{function.__qualname__}",
                                       "args": list(args)}) + "\n")
        server.stdin.flush()
        line = server.stdout.readline()
    if not line:
        raise RuntimeError(f"the fork server ended (exit status {server.poll()})")
    answer = json.loads(line)
    if "error" in answer:
        raise RuntimeError(f"{function.__qualname__} failed in a fresh process:\n{answer['error']}")
    return answer["result"]
