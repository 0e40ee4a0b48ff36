"""One merged layer as one self-describing safetensors file.

Each layer file holds one tensor under its real name, and its header metadata
carries the CRC-32 of the tensor bytes. A file under its final name was renamed
there only after an fsync, so its presence plus a header that checks out means
the layer is sealed: a build killed mid-way resumes from these files alone, with
no journal to keep consistent. The data section starts on a page boundary so
that the tensor's pages are the file's pages (residency per layer is exact).

File names come from a hash of the tensor name, never from the name itself: a
tensor name may hold characters a path must not, and the name is not a path.

The content checksum is there to catch corruption (a torn write, a bad block, a file
changed behind the cache's back), not an adversary: the cache folder is private and
owner-checked. CRC-32 catches every burst up to 32 bits and random damage with odds of
2^-32 of missing it, at over 20 GiB/s on one core with ISA-L and 4-5 GiB/s with zlib
(sha256: under 2); see :mod:`hostmem.crc32`.

Reading and checking a layer file needs no torch (``hostmem cache`` imports this module
and must start light); only writing one does, and imports it then.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import stat
import struct
from collections import namedtuple
from math import prod

from hostmem.safetensors.header import DTYPE_SIZES, SafetensorsError, SafetensorsHeader, read_header

from .content_hash import read_chunks, stamp_of
from .handoff import Handoff
from .durable import discard, open_tmp, seal, write_all, write_cached, write_uncached
from .safety import VaultError, check_not_symlink

__all__ = [
    "LayerEntry",
    "view_matches",
    "layer_file_name",
    "layer_file_bytes",
    "is_layer_file_name",
    "write_layer",
    "write_layer_data",
    "seal_layer",
    "complete_layer",
    "seal_completed",
    "discard_layer",
    "UnsealedLayer",
    "read_layer_file",
    "layer_problem",
    "data_crc32",
    "known_layout",
]

LAYER_FORMAT = "hostmem-lora-merge-cache-layer/2"
_ALIGN = 4096
_CHUNK = 4 * 1024 * 1024
_SUFFIX = ".safetensors"


_STAMP_FIELDS = 5  # (device, inode, size, mtime_ns, ctime_ns): content_hash.stamp_of


# Named tuples, not dataclasses: every start with the cache imports this module, and a
# dataclass compiles its methods at import (about 1 ms each on a small core).
class LayerEntry(namedtuple("LayerEntry", "name file size header_sha256 crc32 dtype shape data_offset stamp",
                            defaults=(None, None))):
    """What the manifest records of one layer file.

    ``crc32`` is 8 hex digits, of the tensor bytes (the data section). ``data_offset``
    (where those bytes start) and ``stamp`` (the file's (device, inode, size, mtime_ns,
    ctime_ns) when its bytes last matched ``crc32``: written by this cache, or verified)
    let a start map a file that still has that stamp at that offset without reading its
    header. Either is None where it is not known (a manifest of an older release, a file
    not verified yet).
    """

    __slots__ = ()

    @property
    def torch_dtype(self) -> torch.dtype:
        from hostmem.safetensors.mapping import DTYPES

        return DTYPES[self.dtype]

    @property
    def data_bytes(self) -> int:
        return prod(self.shape) * DTYPE_SIZES[self.dtype]

    def with_stamp(self, stamp) -> "LayerEntry":
        return self._replace(stamp=None if stamp is None else tuple(stamp))

    def to_dict(self) -> dict:
        """The manifest's record (``data_offset`` and ``stamp`` only where known)."""
        data = dict(self._asdict(), shape=list(self.shape), stamp=self.stamp and list(self.stamp))
        return {k: v for k, v in data.items() if v is not None}

    @classmethod
    def from_dict(cls, data: dict) -> "LayerEntry":
        """The entry a manifest records; ``KeyError``/``TypeError``/``ValueError`` when it is
        not one (an offset or stamp that does not fit the recorded size is not one either)."""
        entry = cls(
            name=str(data["name"]),
            file=str(data["file"]),
            size=int(data["size"]),
            header_sha256=str(data["header_sha256"]),
            crc32=str(data["crc32"]),
            dtype=str(data["dtype"]),
            shape=tuple(int(d) for d in data["shape"]),
            data_offset=None if data.get("data_offset") is None else int(data["data_offset"]),
            stamp=None if data.get("stamp") is None else tuple(int(v) for v in data["stamp"]),
        )
        if entry.file != layer_file_name(entry.name):  # a path, or another layer's file: never opened
            raise ValueError(f"layer {entry.name!r}: file {entry.file!r} is not the name the cache gives it "
                             f"({layer_file_name(entry.name)})")
        if entry.dtype not in DTYPE_SIZES:
            raise ValueError(f"layer {entry.name!r}: dtype {entry.dtype!r}")
        if entry.data_offset is not None and not 8 <= entry.data_offset == entry.size - entry.data_bytes:
            raise ValueError(f"layer {entry.name!r}: data offset {entry.data_offset} does not fit its "
                             f"{entry.size} bytes of {list(entry.shape)} {entry.dtype}")
        if entry.stamp is not None and (len(entry.stamp) != _STAMP_FIELDS or entry.stamp[2] != entry.size):
            raise ValueError(f"layer {entry.name!r}: stamp {list(entry.stamp)} is not one of a {entry.size}-byte file")
        return entry


def layer_file_name(name: str) -> str:
    """The file of tensor ``name``: 32 hex digits of sha256(name)."""
    return hashlib.sha256(name.encode("utf-8")).hexdigest()[:32] + _SUFFIX


def layer_file_bytes(shape, dtype: torch.dtype) -> int:
    """Bytes the layer file of a tensor takes: one page of header (names under ~3.9 KiB) plus the data."""
    return _ALIGN + prod(shape) * dtype.itemsize


def is_layer_file_name(file: str) -> bool:
    stem = file[: -len(_SUFFIX)] if file.endswith(_SUFFIX) else ""
    return len(stem) == 32 and all(c in "0123456789abcdef" for c in stem)


def _header_bytes(name: str, dtype: str, shape: tuple[int, ...], nbytes: int, checksum: str) -> bytes:
    """Length prefix + JSON header, padded with spaces so the data starts page-aligned."""
    header = {
        "__metadata__": {"format": LAYER_FORMAT, "crc32": checksum},
        name: {"dtype": dtype, "shape": list(shape), "data_offsets": [0, nbytes]},
    }
    body = json.dumps(header, separators=(",", ":")).encode("utf-8")
    padded = -(-(8 + len(body)) // _ALIGN) * _ALIGN - 8
    return struct.pack("<Q", padded) + body.ljust(padded, b" ")


class _Crc32:
    """A running CRC-32, fed in order (see :func:`hostmem.crc32.crc32`)."""

    def __init__(self):
        from ..crc32 import crc32  # here: a start served from the cache takes no checksum

        self._crc32 = crc32
        self.value = 0

    def update(self, data) -> None:
        self.value = self._crc32(data, self.value)


def _hex(crc32: int) -> str:
    """A CRC-32 as the header and the manifest record it: 8 hex digits."""
    return f"{crc32:08x}"


def _is_crc32(text: str) -> bool:
    return len(text) == 8 and all(c in "0123456789abcdef" for c in text)


def _all_ready(nbytes: int) -> Handoff:
    """A handoff for bytes that are all final already."""
    handoff = Handoff(nbytes)
    handoff.publish(nbytes)
    return handoff


def _write_streamed(fd: int, path: str, tensor: torch.Tensor, offset: int, handoff: Handoff, writer=None,
                    write=write_uncached) -> int:
    """Write ``tensor``'s bytes at ``offset`` as ``handoff`` says they are final, handing each
    piece back once it and every piece before it are written; return their CRC-32
    (see :mod:`hostmem.vault.piece_writer`). With a ``writer`` (a session's
    :class:`~hostmem.vault.piece_writer.PieceWriter`), return once the last piece is on
    its way: ``writer.started`` holds them. Each piece goes by ``write``."""
    from hostmem.safetensors.mapping import tensor_bytes

    from .piece_writer import write_pieces  # here: a start served from the cache writes nothing

    digest = _Crc32()
    args = (fd, path, memoryview(tensor_bytes(tensor)).cast("B"), offset, tensor.data_ptr(), handoff, digest, write)
    if writer is None:
        write_pieces(*args)
    else:
        writer.started = writer.start(*args)
    return digest.value


def _reserve(fd: int, nbytes: int) -> None:
    """Allocate the file's blocks before writing: a full disk fails here, before any data
    is written, and the filesystem can lay the layer out in one extent."""
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            raise


def _cpu_contiguous(merged: torch.Tensor) -> torch.Tensor:
    tensor = merged.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.to("cpu")
    return tensor.contiguous()


class UnsealedLayer(namedtuple("UnsealedLayer", "fd tmp final entry header dir_fd cached", defaults=(None, False))):
    """A layer file whose data is written (or on its way), under its temporary name, its
    descriptor open (``fd``): what :func:`seal_layer` completes with ``header``, makes
    durable and names ``final`` (or :func:`discard_layer` removes). Never served: only
    a sealed file has its final name. ``dir_fd``: its folder's descriptor, where the
    writer holds one (the writer's to close), else None (the folder walked for each step).
    ``cached``: its data was written through the page cache (and stays there)."""

    __slots__ = ()


def write_layer(folder: str, name: str, merged: torch.Tensor, crc32: int | None = None,
                handoff: Handoff | None = None) -> LayerEntry:
    """Write ``merged`` as the sealed layer file of ``name`` in ``folder``; return its entry
    (:func:`write_layer_data`, then :func:`seal_layer`)."""
    return seal_layer(write_layer_data(folder, name, merged, crc32, handoff))


def write_layer_data(folder: str, name: str, merged: torch.Tensor, crc32: int | None = None,
                     handoff: Handoff | None = None, writer=None, dir_fd: int | None = None,
                     cached: bool = False) -> UnsealedLayer:
    """Write ``merged``'s layer file of ``name`` in ``folder`` under a temporary name, unsealed.

    The data goes in first (its whole pages with O_DIRECT when ``merged`` starts on a
    page and the filesystem allows: see :func:`~hostmem.vault.durable.write_uncached`;
    with ``cached``, through the page cache, where the bytes then stay: ``write_cached``),
    checksummed as it is written unless ``crc32``, the CRC-32 of its bytes
    (:func:`hostmem.crc32.crc32_of`), is given. The header, with the checksum, is left
    for :func:`seal_layer` to write over the room kept for it: a buffered write to a
    file with direct writes on their way waits for them all (ext4 takes the file's
    lock and drains its direct I/O), which here would hold up the next layer's first
    pieces until this one's last is on disk. With a ``handoff`` (see :mod:`hostmem.vault.handoff`),
    ``merged`` is a contiguous CPU buffer still being computed: its bytes are written as
    they are published; with a ``writer`` too, its pieces may still be on their way when
    this returns (see :func:`_write_streamed`). ``dir_fd``: ``folder``'s descriptor, held
    by the caller for its many layers (:func:`~hostmem.vault.durable.open_tmp`). On any
    error the temporary file is removed and the error is raised.
    """
    from hostmem.safetensors.mapping import DTYPE_NAMES, tensor_bytes

    if handoff is not None and (merged.device.type != "cpu" or not merged.is_contiguous()):
        raise ValueError("a streamed layer must be a contiguous CPU tensor (the buffer being computed)")
    tensor = _cpu_contiguous(merged)
    try:
        dtype = DTYPE_NAMES[tensor.dtype]
    except KeyError:
        raise VaultError(f"layer {name!r}: dtype {tensor.dtype} cannot be stored in safetensors") from None
    shape = tuple(tensor.shape)
    data = tensor_bytes(tensor)
    header = _header_bytes(name, dtype, shape, len(data), _hex(0))  # same length as the real one
    write = write_cached if cached else write_uncached
    fd, tmp = open_tmp(folder, _SUFFIX, dir_fd)
    try:
        _reserve(fd, len(header) + len(data))
        if handoff is None and crc32 is not None:
            write(fd, tmp, data, len(header), tensor.data_ptr())
        else:  # checksummed as written: a ready tensor is all published at once
            crc32 = _write_streamed(fd, tmp, tensor, len(header), handoff or _all_ready(len(data)),
                                    writer if handoff is not None else None, write)
        header = _header_bytes(name, dtype, shape, len(data), _hex(crc32))
    except BaseException:
        discard(tmp, dir_fd)  # before the close: the writer's lock covers the temporary name while it exists
        os.close(fd)
        raise
    final = os.path.join(folder, layer_file_name(name))
    entry = LayerEntry(name=name, file=os.path.basename(final), size=len(header) + len(data),
                       header_sha256=hashlib.sha256(header).hexdigest(), crc32=_hex(crc32), dtype=dtype, shape=shape,
                       data_offset=len(header))
    return UnsealedLayer(fd, tmp, final, entry, header, dir_fd, cached)


def seal_layer(layer: UnsealedLayer) -> LayerEntry:
    """Write the header of the file :func:`write_layer_data` wrote (its data all on disk by
    now), fsync it and rename it to its final name; return its entry. On any error the
    temporary file is removed and the error is raised."""
    complete_layer(layer)
    return seal_completed(layer)


def complete_layer(layer: UnsealedLayer) -> None:
    """Write the header of the file :func:`write_layer_data` wrote: the file is whole, under
    its temporary name, not yet durable (:func:`seal_completed` makes it so). On any error
    the temporary file is removed and the error is raised."""
    try:
        write_all(layer.fd, layer.header, 0)
    except BaseException:
        discard_layer(layer)
        raise


def seal_completed(layer: UnsealedLayer) -> LayerEntry:
    """fsync the whole file :func:`complete_layer` left and rename it to its final name;
    return its entry. On any error the temporary file is removed and the error is raised."""
    # the manifest's seal fsyncs the folder once
    seal(layer.fd, layer.tmp, layer.final, sync_dir=False, dir_fd=layer.dir_fd)
    return layer.entry


def discard_layer(layer: UnsealedLayer) -> None:
    """Remove and close a layer file that will not be sealed."""
    discard(layer.tmp, layer.dir_fd)
    os.close(layer.fd)


def _open_layer_file(path: str) -> int:
    """Open layer file ``path`` for reading in its folder's descriptor, walked from the
    root's (:mod:`.anchor`): never through a link, never hanging on a FIFO."""
    from .anchor import in_folder

    with in_folder(path) as (folder_fd, name):
        try:
            return os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=folder_fd)
        except OSError as exc:
            if exc.errno == errno.ELOOP:  # a link: refused by name, never followed
                check_not_symlink(path, os.stat(name, dir_fd=folder_fd, follow_symlinks=False))
            raise


def header_of_open_file(fd: int, path: str) -> SafetensorsHeader:
    """The header of the very file ``fd`` is open on (not of whatever ``path`` names by now)."""
    import dataclasses

    via = f"/proc/self/fd/{fd}"
    try:
        header = read_header(via)
    except SafetensorsError as exc:
        raise SafetensorsError(str(exc).replace(via, path)) from None
    return dataclasses.replace(header, path=path)


def read_layer_file(path: str) -> LayerEntry:
    """Read a layer file's header into its entry; raise ``SafetensorsError`` if it is not one.

    Checks what adoption must: a regular file (never a link: opened in its folder's
    descriptor with ``O_NOFOLLOW``), exactly header + data long, one tensor whose name
    hashes to this file name, and our format's checksum metadata.
    """
    fd = _open_layer_file(path)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise SafetensorsError(f"{path}: not a regular file")
        header = header_of_open_file(fd, path)
    finally:
        os.close(fd)
    if len(header.tensors) != 1:
        raise SafetensorsError(f"{path}: holds {len(header.tensors)} tensors, a layer file holds one")
    (info,) = header.tensors.values()
    if header.metadata.get("format") != LAYER_FORMAT or not _is_crc32(header.metadata.get("crc32", "")):
        raise SafetensorsError(f"{path}: not a layer file of this cache (format {header.metadata.get('format')!r})")
    if layer_file_name(info.name) != os.path.basename(path):
        raise SafetensorsError(f"{path}: holds tensor {info.name!r}, whose file would be {layer_file_name(info.name)}")
    if header.file_size != header.data_offset + info.end:
        raise SafetensorsError(
            f"{path}: {header.file_size} bytes, expected {header.data_offset + info.end} (torn or appended to)"
        )
    return LayerEntry(
        name=info.name,
        file=os.path.basename(path),
        size=header.file_size,
        header_sha256=header.header_sha256,
        crc32=header.metadata["crc32"],
        dtype=info.dtype,
        shape=tuple(info.shape),
        data_offset=header.data_offset + info.begin,
    )


def known_layout(st: os.stat_result, entry: LayerEntry) -> int | None:
    """Where ``entry``'s data starts in the open file whose ``fstat`` is ``st``, without reading its header:
    the recorded offset, while the file still has the stamp it had when its bytes last
    matched their checksum; None when it has not (or either is not recorded), and the
    caller reads the header as for any file."""
    if entry.data_offset is None or entry.stamp is None or entry.data_offset + entry.data_bytes != entry.stamp[2]:
        return None
    return entry.data_offset if tuple(stamp_of(st)) == entry.stamp else None


def layer_problem(folder: str, entry: LayerEntry) -> str | None:
    """Why the file of ``entry`` cannot be adopted as is (size, header), or None if it can."""
    path = os.path.join(folder, entry.file)
    try:
        found = read_layer_file(path)
    except FileNotFoundError:
        return f"{path}: missing"
    except (SafetensorsError, OSError) as exc:  # a symlink (VaultError) is refused, not dropped
        return str(exc)
    if found.size != entry.size:
        return f"{path}: {found.size} bytes, the manifest says {entry.size}"
    if found.header_sha256 != entry.header_sha256 or found.name != entry.name:
        return f"{path}: header differs from the one the manifest recorded"
    return None


def view_matches(view, entry: LayerEntry) -> bool:
    """Whether a mapped layer's bytes still have the checksum its entry recorded at the seal."""
    from hostmem.crc32 import crc32_of
    from hostmem.safetensors.mapping import tensor_bytes

    return _hex(crc32_of(tensor_bytes(view))) == entry.crc32


def data_crc32(path: str) -> str:
    """CRC-32 of a layer file's data section, read from disk (what `cache verify` checks)."""
    fd = _open_layer_file(path)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise SafetensorsError(f"{path}: not a regular file")
        header = header_of_open_file(fd, path)
        digest = _Crc32()
        read_chunks(fd, header.data_offset, header.file_size, digest.update)
    finally:
        os.close(fd)
    return _hex(digest.value)
