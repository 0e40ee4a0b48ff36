"""``hostmem cache ls | verify | prune | rm KEY``: look after the LoRA merge cache.

The cache root is ``--root DIR``, else the environment variable
``HOSTMEM_CACHE_ROOT``, else ``~/.cache/hostmem``. Sizes are human-readable in text
and plain bytes in JSON.

A ``--root`` that is not a folder, a ``HOSTMEM_CACHE_ROOT`` that is a file, empty or
relative, and a ``lora_merge_cache`` that is not a folder are refused (exit 2): each is a mistake, not an
empty cache. A default root that does not exist yet is a cache never used: nothing cached
yet, exit 0.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from hostmem.errors import InputError
from hostmem.units import format_size, parse_size, size_option
from hostmem.vault.combinations import ROOT_ENV

_ROOT_HELP = "cache root (default: $HOSTMEM_CACHE_ROOT, else ~/.cache/hostmem)"


def register(subparsers) -> None:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--root", metavar="DIR", default=None, help=_ROOT_HELP)
    parser = subparsers.add_parser(
        "cache",
        help="list, verify, prune or remove cached LoRA merges",
        description=(
            "Look after the LoRA merge cache in <root>/lora_merge_cache. The root is --root DIR, "
            "else $HOSTMEM_CACHE_ROOT, else ~/.cache/hostmem."
        ),
    )
    sub = parser.add_subparsers(dest="cache_command", metavar="ACTION")
    sub.required = True
    ls = sub.add_parser("ls", parents=[common], help="list combinations, least recently used first")
    ls.add_argument("--json", action="store_true", help="print JSON (sizes in bytes, times in unix seconds)")
    ls.set_defaults(run=run_ls)
    verify = sub.add_parser("verify", parents=[common], help="check every layer's checksum; record what is damaged")
    verify.add_argument("keys", nargs="*", metavar="KEY", help="keys or unique prefixes (default: all)")
    verify.add_argument("--json", action="store_true", help="print JSON")
    verify.add_argument("--deep", action="store_true",
                        help="also read every input (base, adapters) again and compare it with the key")
    verify.set_defaults(run=run_verify)
    prune = sub.add_parser(
        "prune",
        parents=[common],
        help="remove damaged and partial combinations, dead writers' temporary files and records no combination "
             "left needs (and LRU combinations beyond --max-size)",
    )
    prune.add_argument("--max-size", metavar="SIZE", default=None, type=size_option, help="then evict least recently used down to SIZE, e.g. 200GiB")
    prune.add_argument("--all", action="store_true", help="remove every combination not in use")
    prune.add_argument("--dry-run", action="store_true", help="say what would go, remove nothing")
    prune.set_defaults(run=run_prune)
    rm = sub.add_parser("rm", parents=[common], help="remove one combination")
    rm.add_argument("key", metavar="KEY", help="its key or a unique prefix (see `hostmem cache ls`)")
    rm.set_defaults(run=run_rm)


def _cache(args) -> tuple[str, str | None]:
    from hostmem.vault import default_cache_root
    from hostmem.vault.admin import existing_cache_dir

    if args.root is not None:
        _check_given_root(args.root)
        root = args.root
    else:
        root = default_cache_root()
        _check_default_root(root)
    _check_cache_folder(root)
    return root, existing_cache_dir(root)


def _check_given_root(root: str) -> None:
    """A ``--root`` that is not a folder is a typo, not an empty cache: say so (exit 2)."""
    path = os.path.expanduser(root)
    if os.path.isdir(path):
        return
    if os.path.lexists(path):
        raise InputError(f"--root {root}: is a file, not a folder; give the cache root folder (the one holding lora_merge_cache)")
    raise InputError(f"--root {root}: no such folder; check the path (the default root is $HOSTMEM_CACHE_ROOT, else ~/.cache/hostmem)")


def _check_default_root(root: str) -> None:
    """The default root (:func:`hostmem.vault.default_cache_root`) may be missing: nothing was
    cached yet (:func:`_nothing_cached`); one that is not a folder is refused, naming where it
    came from (exit 2)."""
    path = os.path.expanduser(root)
    if os.path.isdir(path) or not os.path.lexists(path):
        return
    what = "a file, not a folder" if os.path.isfile(path) else "not a folder"
    if os.environ.get(ROOT_ENV):
        raise InputError(f"{ROOT_ENV}={root}: is {what}; point it at the cache root folder (the one holding "
                         "lora_merge_cache), or give --root DIR")
    raise InputError(f"{root}: the default cache root is {what}; move it away, or set {ROOT_ENV} to the cache "
                     "root folder")


def _check_cache_folder(root: str) -> None:
    """``<root>/lora_merge_cache`` that is there but not a folder is no empty cache: say so (exit 2)."""
    from hostmem.vault.combinations import CACHE_DIR

    path = os.path.join(os.path.expanduser(root), CACHE_DIR)
    if os.path.lexists(path) and not os.path.isdir(path):
        what = "a file" if os.path.isfile(path) else "not a folder"
        raise InputError(f"{path}: is {what}, where the LoRA merge cache's folder belongs; move it away (the next "
                         "build makes the folder), or give the cache root that holds the cache")


def _check_changeable(root: str, cache: str, action: str) -> None:
    """Before ``rm`` or ``prune`` changes a thing: a cache nothing may be written to (a root baked
    into an image and mounted read-only, or another user's) is refused in one line (exit 2)."""
    from hostmem.vault.safety import root_is_read_only

    if not root_is_read_only(cache):
        return
    if os.statvfs(cache).f_flag & os.ST_RDONLY:
        raise InputError(f"{root}: a read-only root (a cache baked into an image, or a read-only mount) cannot be "
                         f"changed; run `hostmem cache {action}` where the image is built, before its root is made "
                         "read-only, or give a writable root (--root DIR, HOSTMEM_CACHE_ROOT)")
    raise InputError(f"{cache}: not writable by this user: `hostmem cache {action}` cannot change it; run it as "
                     "the user who owns the cache")


def _damaged_advice(root: str, cache: str, count: int, keys: str) -> str:
    """What to do with ``count`` damaged combinations: remove them, or where the root cannot be
    changed (an image mounted read-only), build them again where the image is built."""
    from hostmem.vault.safety import root_is_read_only

    if root_is_read_only(cache):
        return (f"{count} damaged combination(s) ({keys}) in {root}, which this user cannot change: a start never "
                "serves them from here (it builds them in a writable root, or merges in place); rebuild the image "
                "where it is built (`hostmem lora merge`)")
    return f"{count} damaged combination(s); remove them with `hostmem cache rm KEY` ({keys}) or `hostmem cache prune`"


def _nothing_cached(args, root: str) -> str:
    """The line for a root without a combination: one that does not exist was never used."""
    if os.path.isdir(os.path.expanduser(root)):
        return f"no cached LoRA merges under {root}"
    named = f" ({ROOT_ENV})" if args.root is None and os.environ.get(ROOT_ENV) else ""
    return (f"nothing cached yet under {root}{named}: the folder does not exist; the first build (a server's "
            "start, `hostmem lora merge`) makes it")


def _when(stamp) -> str:
    """A manifest's time as a person reads it; "?" for one no clock has (hand-edited: NaN, 1e300)."""
    try:
        return time.strftime("%Y-%m-%d %H:%M", time.localtime(stamp)) if stamp else "-"
    except (OverflowError, ValueError, TypeError, OSError):
        return "?"


def _inputs_summary(inputs) -> str:
    """One line a person can recognise a combination by ("?" for what a hand-edited
    manifest no longer says)."""
    import os

    if not inputs:
        return "-"
    if not isinstance(inputs, dict):
        return "?"
    base_record = inputs.get("base")
    shards = base_record.get("shards") if isinstance(base_record, dict) else None
    shards = [s for s in shards if isinstance(s, dict)] if isinstance(shards, list) else []
    base = os.path.basename(str(shards[0].get("path", "?"))) if shards else "?"
    if len(shards) > 1:
        base += f" (+{len(shards) - 1} shards)"
    adapters = inputs.get("adapters")
    adapters = ", ".join(
        f"{os.path.basename(str(a.get('path', '?')))} x{a.get('strength')}"
        + (f" alpha={a['alpha_override']}" if a.get("alpha_override") is not None else "")
        for a in (adapters if isinstance(adapters, list) else []) if isinstance(a, dict)
    )
    return f"{base} + [{adapters}] -> {inputs.get('target_dtype')}, {inputs.get('merge_policy')}"


def _flat(value, prefix: str = "") -> dict[str, str]:
    """An inputs record as ``dotted.key -> text``, digests cut to 12 digits."""
    if isinstance(value, dict):
        return {k: v for key, item in value.items() for k, v in _flat(item, f"{prefix}{key}.").items()}
    if isinstance(value, list):
        return {k: v for i, item in enumerate(value) for k, v in _flat(item, f"{prefix}{i}.").items()}
    text = str(value)
    algorithm, colon, digits = text.rpartition(":")  # digests name their algorithm: "blake3:<hex>"
    return {prefix.rstrip("."): f"{algorithm}{colon}{digits[:12]}" if len(digits) == 64 else text}


_PEOPLE_ONLY = ("path", "mtime_ns", "size")  # recorded for people, not part of what makes a combination


def _differences(combos) -> dict[str, str]:
    """For combinations listed with the same one-line summary: the inputs that tell them apart."""
    groups: dict[str, list] = {}
    for c in combos:
        groups.setdefault(_inputs_summary(c.inputs), []).append(c)
    found = {}
    for group in groups.values():
        if len(group) < 2:
            continue
        flats = [_flat(c.inputs) for c in group]
        keys = sorted({k for f in flats for k in f if not k.endswith(_PEOPLE_ONLY)})
        differing = [k for k in keys if len({f.get(k) for f in flats}) > 1]
        for c, flat in zip(group, flats):
            found[c.key] = ", ".join(f"{k}={flat.get(k, '-')}" for k in differing) or "inputs look the same"
    return found


def _records(cache: str | None, combos) -> dict:
    """The providers' records under ``cache``: how many, their bytes, and those no
    combination needs (what ``prune`` would remove); a problem with their folder, in words."""
    from hostmem.vault import VaultError
    from hostmem.vault.records import records_under, stale_records

    found, stale, problem = [], [], None
    try:
        if cache is not None:
            found = records_under(cache)
            stale = stale_records(cache, combos, found=found)  # the same scan
    except (OSError, VaultError) as exc:
        problem = str(exc)
    kinds: dict[str, int] = {}
    for path, _ in found:
        kind = os.path.basename(os.path.dirname(path))
        kinds[kind] = kinds.get(kind, 0) + 1
    records = {"count": len(found), "bytes": sum(st.st_size for _, st in found), "stale": len(stale),
               "stale_bytes": sum(r.bytes for r in stale), "kinds": kinds}
    return records if problem is None else {**records, "problem": problem}


def _records_line(records: dict) -> str | None:
    if "problem" in records:
        return f"records: {records['problem']}"
    if not records["count"]:
        return None
    kinds = ", ".join(f"{count} {kind.removesuffix('s')}" for kind, count in sorted(records.get("kinds", {}).items()))
    line = f"records: {records['count']} ({kinds}), {format_size(records['bytes'])}"
    if records["stale"]:
        line += (f"; {records['stale']} of them ({format_size(records['stale_bytes'])}) no combination needs: "
                 "`hostmem cache prune` removes them")
    return line


def run_ls(args) -> int:
    from hostmem.vault.combinations import list_combinations

    root, cache = _cache(args)
    combos = list_combinations(cache) if cache else []
    total = sum(c.bytes for c in combos)
    records = _records(cache, combos)
    if args.json:
        json.dump({"root": root, "cache": cache, "total_bytes": total, "combinations": [c.to_dict() for c in combos],
                   "records": records}, sys.stdout)
        sys.stdout.write("\n")
        return 0
    records_line = _records_line(records)
    if not combos:
        print(_nothing_cached(args, root))
        if records_line:
            print(records_line)
        return 0
    print(f"{cache}: {len(combos)} combination(s), {format_size(total)}")
    shown = unique_prefixes([c.key for c in combos])
    width = max(len(k) for k in shown.values())
    print(f"{'KEY':<{width}}  {'STATE':<11}  {'SIZE':>10}  {'LAYERS':>6}  {'LAST USED':<16}  INPUTS")
    differences = _differences(combos)
    for c in combos:
        print(
            f"{shown[c.key]:<{width}}  {c.state:<11}  {format_size(c.bytes):>10}  {c.layers:>6}  "
            f"{_when(c.last_used):<16}  {_inputs_summary(c.inputs)}"
        )
        if c.key in differences:
            print(f"{'':<{width}}  differs: {differences[c.key]}")
        if c.problem:
            print(f"{'':<{width}}  {c.problem}")
    if records_line:
        print(records_line)
    return 0


def unique_prefixes(keys: list[str], least: int = 12) -> dict[str, str]:
    """Each key's shortest prefix of at least ``least`` characters that no other of ``keys``
    starts with (a folder renamed by hand may share its first twelve with the real one), so
    what is shown is what ``hostmem cache rm`` takes."""
    out = {}
    for key in keys:
        length = least
        while length < len(key) and any(o != key and o.startswith(key[:length]) for o in keys):
            length += 1
        out[key] = key[:length]
    return out


def run_verify(args) -> int:
    from hostmem.vault.admin import verify_all

    root, cache = _cache(args)
    if cache is None:
        if args.keys:
            raise InputError(f"{root}: holds no LoRA merge cache, so no key {args.keys[0]!r}")
        reports = []
    else:
        reports = verify_all(cache, args.keys, deep=args.deep)
    bad = [r for r in reports if r.state == "bad"]
    if args.json:
        json.dump({"root": root, "ok": not bad, "combinations": [r.to_dict() for r in reports]}, sys.stdout)
        sys.stdout.write("\n")
        return 1 if bad else 0
    shown = unique_prefixes([r.key for r in reports])
    for r in reports:
        print(f"{shown[r.key]}  {r.state:<6}  {r.layers} layers, {format_size(r.bytes)} checked")
        for line in r.problems + r.notes:
            print(f"    {line}")
    damaged = [r for r in bad if len(r.problems) > r.inputs_changed]
    if damaged:
        keys = " ".join(shown[r.key] for r in damaged)
        print(_damaged_advice(root, cache, len(damaged), keys))
    stale = [r for r in bad if r.inputs_changed]
    if stale:
        print(f"{len(stale)} combination(s) made from an input whose bytes changed below the filesystem's notice; "
              "they stay (the right merge of the bytes their keys name), and the next start hashes the input again "
              "and builds the merge of what it holds now")
    if not reports:
        print(_nothing_cached(args, root))
    return 1 if bad else 0


def run_prune(args) -> int:
    from hostmem.vault.admin import prune, prune_records
    from hostmem.vault.records import check_record_folders

    root, cache = _cache(args)
    max_size = None if args.max_size is None else parse_size(args.max_size)
    if cache and not args.dry_run:
        _check_changeable(root, cache, "prune")
    if cache:
        check_record_folders(cache)  # an unsafe one stops the prune before anything is removed
    removed = prune(cache, max_size, everything=args.all, dry_run=args.dry_run) if cache else []
    records = prune_records(cache, {c.key for c, _ in removed}, dry_run=args.dry_run) if cache else []
    verb = "would remove" if args.dry_run else "removed"
    for combo, reason in removed:
        print(f"{verb} {combo.key[:12]}  {format_size(combo.bytes):>10}  ({reason})")
    for record in records:
        name = os.path.relpath(record.path, cache)
        print(f"{verb} {name}  {format_size(record.bytes):>10}  ({record.reason})")
    print(f"{verb} {len(removed)} combination(s), {format_size(sum(c.bytes for c, _ in removed))}")
    if records:
        print(f"{verb} {len(records)} record(s) no combination left needs, "
              f"{format_size(sum(r.bytes for r in records))}")
    return 0


def run_rm(args) -> int:
    from hostmem.vault.admin import remove

    root, cache = _cache(args)
    if cache is None:
        raise InputError(f"{root}: holds no LoRA merge cache, so no key {args.key!r}")
    _check_changeable(root, cache, "rm")
    combo = remove(cache, args.key)
    print(f"removed {combo.key}  {format_size(combo.bytes)}")
    return 0
