"""The rules of the house, read from the source: no import circles, arrows only downward, small files.

Every import is read with :mod:`ast`, function-local ones and ``TYPE_CHECKING`` ones
included: an import moved into a function to dodge a circle still makes a circle (it
only fails later, at first use), and a type-only arrow still says the lower layer
knows the upper one. Layers, top to bottom: bench > planners > lora_cache > hostmem;
tests may import anything. Each failure names the files and lines to look at.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYERS = {"hostmem": 0, "lora_cache": 1, "planners": 2, "bench": 3}
MAX_LINES = 450
# Signals that steer control flow inside one function and never reach a caller: not errors.
NOT_ERRORS = {"PeakSamplingWarning", "HostmemError"}  # and the root itself
BUILTIN_ERRORS = {
    "Exception", "ValueError", "TypeError", "RuntimeError", "OSError", "KeyError", "LookupError",
    "IOError", "FileNotFoundError", "PermissionError", "IndexError", "AttributeError",
}


def _modules() -> dict[str, Path]:
    """Every module of the four packages, by dotted name (a package by its own name)."""
    found = {}
    for package in LAYERS:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


MODULES = _modules()


def _absolute(module: str, path: Path, node: ast.ImportFrom) -> str:
    """The dotted name a ``from ... import`` reads from, relative levels resolved."""
    if not node.level:
        return node.module or ""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    base = package[: len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _target(name: str) -> str | None:
    """The project module ``name`` lands in (the longest known prefix), or None outside the project."""
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


def imports(module: str, path: Path) -> list[tuple[str, int]]:
    """(project module imported, line) for every import in ``module``, at any depth."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            source = _absolute(module, path, node)
            names = [f"{source}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            hit = _target(name)
            if hit and hit != module:
                found.append((hit, node.lineno))
    return found


GRAPH = {module: imports(module, path) for module, path in MODULES.items()}


def _where(module: str, line: int) -> str:
    return f"{MODULES[module].relative_to(ROOT)}:{line}"


def _circles() -> list[list[str]]:
    """Strongly connected groups of more than one module, each sorted."""
    return _room_circles({v: {w: [] for w, _ in edges} for v, edges in GRAPH.items()})


def _is_package_of(importer: str, imported: str) -> bool:
    """A package's own ``__init__`` importing its members, or a member its package: not a circle.

    The package face re-exports its members lazily or eagerly; what counts is that no
    two modules with jobs of their own need each other.
    """
    return importer.startswith(imported + ".") or imported.startswith(importer + ".")


def test_no_import_circles():
    report = []
    for group in _circles():
        members = set(group)
        edges = [
            f"    {_where(a, line)} imports {b}"
            for a in group for b, line in GRAPH[a]
            if b in members and not _is_package_of(a, b)
        ]
        if edges:
            report.append("circle: " + " <-> ".join(group) + "\n" + "\n".join(sorted(set(edges))))
    assert not report, "modules that import each other (move what both need into a lower module):\n" + "\n".join(report)


def test_arrows_point_only_down():
    upward = [
        f"{_where(a, line)}: {a} imports {b} ({a.split('.')[0]} is below {b.split('.')[0]})"
        for a, edges in GRAPH.items() for b, line in edges
        if LAYERS[b.split(".")[0]] > LAYERS[a.split(".")[0]]
    ]
    assert not upward, "imports that point up (bench > planners > lora_cache > hostmem):\n" + "\n".join(upward)


# Inside hostmem, rooms in order, bottom first: a room never imports one above it. The
# format and /proc readers are what the store is built on; checkpoint remap stores its
# spill in the store. Modules in no room (the accountant, pinning, the face) may use any.
HOSTMEM_ROOMS = {
    "hostmem.errors": 0, "hostmem.units": 0, "hostmem.file_writes": 0,
    "hostmem.safetensors": 0, "hostmem.procfs": 0,
    "hostmem.vault": 1,
    "hostmem.remapping": 2,
}


def _room(module: str) -> str | None:
    return next((r for r in HOSTMEM_ROOMS if module == r or module.startswith(r + ".")), None)


def test_rooms_inside_hostmem_point_only_down():
    upward = [
        f"{_where(a, line)}: {a} imports {b} ({_room(a)} is below {_room(b)})"
        for a, edges in GRAPH.items() if _room(a)
        for b, line in edges if _room(b) and HOSTMEM_ROOMS[_room(b)] > HOSTMEM_ROOMS[_room(a)]
    ]
    assert not upward, "rooms of hostmem that import a room above them (move what they need down):\n" + "\n".join(upward)


def room_of(module: str) -> str:
    """The room a module sits in, one scale up from files: a subpackage of a package is one
    room (``lora_cache.switching``), a module at a package's top level is a room of its own."""
    parts = module.split(".")
    if len(parts) >= 2 and MODULES.get(".".join(parts[:2]), ROOT).name == "__init__.py":
        return ".".join(parts[:2])
    return module


def room_graph() -> dict[str, dict[str, list[str]]]:
    """``{room: {room it imports: [where]}}``, a package's face and its members left out
    (the face re-exports; what counts is rooms with jobs of their own)."""
    rooms: dict[str, dict[str, list[str]]] = {}
    for a, edges in GRAPH.items():
        for b, line in edges:
            ra, rb = room_of(a), room_of(b)
            if ra == rb or "." not in ra or "." not in rb or _is_package_of(ra, rb):
                continue
            rooms.setdefault(ra, {}).setdefault(rb, []).append(_where(a, line))
    return rooms


def _room_circles(rooms) -> list[list[str]]:
    """Strongly connected groups of more than one node of ``{node: {node it imports: ...}}``
    (Tarjan, iterative), each sorted: modules at one scale, rooms at the other."""
    index, low, on, stack, groups = {}, {}, set(), [], []
    for start in sorted(rooms):
        if start in index:
            continue
        work = [(start, iter(sorted(rooms.get(start, {}))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on.add(start)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(rooms.get(w, {})))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                group = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    group.append(w)
                    if w == v:
                        break
                if len(group) > 1:
                    groups.append(sorted(group))
    return groups


def test_no_circles_between_rooms():
    """One scale up: no two rooms lean on each other, directly or through a third (a
    newcomer who opens one room must not have to hold another that needs it back)."""
    rooms = room_graph()
    report = []
    for group in _room_circles(rooms):
        members = set(group)
        edges = [f"    {a} -> {b}: {', '.join(rooms[a][b][:2])}" for a in group for b in sorted(rooms.get(a, {}))
                 if b in members]
        report.append("rooms in a circle: " + ", ".join(group) + "\n" + "\n".join(edges))
    assert not report, "rooms that import each other (move what both need into a room below):\n" + "\n".join(report)


def test_the_room_check_sees_a_circle_through_a_third():
    """The scan itself, on a made-up graph: a -> b -> c -> a is one circle."""
    assert _room_circles({"p.a": {"p.b": []}, "p.b": {"p.c": []}, "p.c": {"p.a": []}, "p.d": {"p.a": []}}) == \
        [["p.a", "p.b", "p.c"]]


def test_no_module_shares_its_name_with_one_in_a_folder_below_it():
    """``adapters/kohya_flux.py`` beside ``adapters/formats/kohya_flux.py``: a newcomer who
    opens one cannot tell from the name which is the format and which calls it."""
    clashes = []
    for package in ("hostmem", "lora_cache", "planners"):
        for folder in sorted(p for p in (ROOT / package).rglob("*") if p.is_dir() and (p / "__init__.py").exists()):
            here = {p.name for p in folder.glob("*.py")} - {"__init__.py"}
            below = [p for p in folder.rglob("*.py") if p.parent != folder and p.name in here]
            clashes += [f"{(folder / p.name).relative_to(ROOT)} and {p.relative_to(ROOT)}" for p in below]
    assert not clashes, "modules named as one in a folder below them (rename the one that calls the other):\n" + \
        "\n".join(clashes)


def test_no_module_over_the_line_limit():
    files = [p for package in (*LAYERS, "tests") for p in (ROOT / package).rglob("*.py")]
    long = sorted(
        f"{p.relative_to(ROOT)}: {n} lines" for p in files if (n := len(p.read_text().splitlines())) > MAX_LINES
    )
    assert not long, f"modules over {MAX_LINES} lines (split them by job):\n" + "\n".join(long)


def test_every_project_error_derives_from_the_root():
    strays = []
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.ClassDef) or node.name.startswith("_") or node.name in NOT_ERRORS:
                continue
            bases = {b.id for b in node.bases if isinstance(b, ast.Name)}
            if bases & BUILTIN_ERRORS and "HostmemError" not in bases:
                strays.append(f"{_where(module, node.lineno)}: class {node.name}({', '.join(sorted(bases))})")
    assert not strays, "error classes outside the root (add HostmemError as the first base):\n" + "\n".join(strays)


def test_the_planners_face_names_what_a_server_uses_and_imports_no_torch_for_a_config():
    from tests.conftest import run_python

    done = run_python("""
import sys, planners
planners.load_config, planners.ConfigError, planners.report_text
assert "torch" not in sys.modules, "reading a config through the face imported torch"
missing = [name for name in planners.__all__ if getattr(planners, name, None) is None]
assert not missing, missing
""", cwd=str(ROOT))
    assert done.returncode == 0, done.stderr


def test_the_reader_sees_function_local_imports(tmp_path):
    """The scan itself: a function-local import is an arrow like any other."""
    source = tmp_path / "probe.py"
    source.write_text("def f():\n    from planners.cli import main\n    return main\n")
    assert imports("hostmem.probe", source) == [("planners.cli", 2)]


def test_the_layout_page_names_every_room():
    """docs/layout.md's tree is the newcomer's map: a package folder missing from it is a room
    nobody is told about."""
    page = (ROOT / "docs" / "layout.md").read_text()
    tree = page.split("```text", 1)[1].split("```", 1)[0]
    folders = sorted({p.parent for package in ("hostmem", "lora_cache", "planners") for p in (ROOT / package).rglob("*.py")})
    missing = [str(f.relative_to(ROOT)) for f in folders if f"{f.name}/" not in tree]
    assert not missing, "package folders the tree of docs/layout.md does not name:\n" + "\n".join(missing)


# The merge's stages, in the order a layer goes through them, each with its rooms. A stage's
# room imports rooms of its own stage or of earlier ones, never a later stage's, and never
# the rooms that drive the stages (orchestrate, the layer loop, ranks/, switching/): data
# flows forward, calls come from above. Opening (a hit, a shared build or a build) is the
# driver's, and sealing is hostmem.vault's, so neither has a room here.
STAGES = (
    ("read", ("lora_cache.adapters", "lora_cache.terms", "lora_cache.targets")),
    ("key", ("lora_cache.key",)),
    ("build", ("lora_cache.compute", "lora_cache.kernels")),
    ("place", ("lora_cache.placement",)),
)
STAGE_OF = {room: i for i, (_, rooms) in enumerate(STAGES) for room in rooms}
MAX_TOP_LEVEL = 8  # lora_cache's own modules beside its rooms, __init__ included


def test_no_stage_imports_a_later_stage_or_a_driver():
    wrong = []
    for room, imported in room_graph().items():
        if room not in STAGE_OF:
            continue
        for other, where in imported.items():
            if not other.startswith("lora_cache."):
                continue
            later = other in STAGE_OF and STAGE_OF[other] > STAGE_OF[room]
            if later or other not in STAGE_OF:
                what = f"the later stage {STAGES[STAGE_OF[other]][0]!r}" if later else "a room that drives the stages"
                wrong.append(f"{room} ({STAGES[STAGE_OF[room]][0]}) imports {other}, {what}: {', '.join(where[:2])}")
    assert not wrong, "stages that reach forward or up (hand the value down instead):\n" + "\n".join(wrong)


def test_every_stage_room_is_a_room():
    """A stage's room renamed or removed must not leave the stage check passing on nothing."""
    missing = [room for room in STAGE_OF if MODULES.get(room, ROOT).name != "__init__.py"]
    assert not missing, f"stage rooms that are not packages: {missing}"


def test_lora_cache_top_level_stays_small():
    """A newcomer opening lora_cache/ sees the rooms and the few modules that drive them."""
    top = sorted(p.name for p in (ROOT / "lora_cache").glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL, f"{len(top)} modules at lora_cache's top level (at most {MAX_TOP_LEVEL}; " \
        f"move the rest into the stage they serve): {', '.join(top)}"


def test_the_face_and_the_layout_page_list_the_stages_in_order():
    """``lora_cache/__init__`` and docs/layout.md name every stage's rooms, in the stages' order."""
    import lora_cache

    page = (ROOT / "docs" / "layout.md").read_text().split("## The merge, stage by stage", 1)[1].split("\n## ", 1)[0]
    for text, name in ((lora_cache.__doc__, "lora_cache/__init__.py"), (page, "docs/layout.md")):
        found = [text.find(f"{room.split('.')[-1]}/") if text is page else text.find(f":mod:`.{room.split('.')[-1]}`")
                 for _, rooms in STAGES for room in rooms]
        assert -1 not in found, f"{name} does not name every stage room: {found}"
        assert found == sorted(found), f"{name} names the stage rooms out of order"
