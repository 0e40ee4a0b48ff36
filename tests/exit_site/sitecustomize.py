"""Every process the suite starts skips the interpreter's last garbage collection.

At exit the interpreter collects once more over every object alive, and a process that
imported torch holds hundreds of thousands: a third of a second per process, and the
suite starts about four hundred (a sixth of its time). ``gc.freeze`` spares them that
collection, as ``hostmem``'s read-only commands spare themselves
(``planners.cli._skip_exit_collection``). Registered first, so it runs after every other
exit handler (they run last-registered first; ``weakref.finalize``'s included). A
finalizer of an object in a cycle then does not run at exit: the tests of the write
commands' exit (``tests/test_exit_collection.py``) start their processes without this
folder (``tests.conftest.env_with_exit_collection``). The ``sitecustomize`` next on the
path (a distribution's own) still runs.

The tests' conftest puts this folder first on ``PYTHONPATH`` for the processes they start.
"""

import atexit
import gc
import importlib.machinery
import importlib.util
import os
import sys

atexit.register(gc.freeze)


def _next_sitecustomize() -> None:
    """Run the ``sitecustomize`` Python would have found without this folder (a module, a
    package or compiled), once: this folder on the path twice (a link) is skipped too."""
    here = os.path.realpath(os.path.dirname(os.path.abspath(__file__)))
    path = [entry for entry in sys.path if os.path.realpath(entry or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


_next_sitecustomize()
