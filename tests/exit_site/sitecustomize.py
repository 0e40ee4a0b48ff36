"""Every process the suite starts skips the interpreter's last garbage collection.

At exit the interpreter collects once more over every object alive, and a process that
imported torch holds hundreds of thousands: a third of a second per process, and the
suite starts about four hundred (a sixth of its time). ``gc.freeze`` spares them that
collection, as ``hostmem``'s read-only commands spare themselves
(``planners.cli._skip_exit_collection``). Registered first, so it runs after every other
exit handler (they run last-registered first). A ``sitecustomize`` further down the path
(a distribution's own) still runs.

The tests' conftest puts this folder first on ``PYTHONPATH`` for the processes they start.
"""

import atexit
import gc
import os
import sys

atexit.register(gc.freeze)


def _next_sitecustomize() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        folder = os.path.abspath(entry or os.curdir)
        candidate = os.path.join(folder, "sitecustomize.py")
        if folder != here and os.path.isfile(candidate):
            with open(candidate, encoding="utf-8") as handle:
                exec(compile(handle.read(), candidate, "exec"), {"__name__": "sitecustomize", "__file__": candidate})
            return


_next_sitecustomize()
