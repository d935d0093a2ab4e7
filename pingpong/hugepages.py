"""Host tables on 2 MiB pages, for fewer TLB and IOMMU misses when rows are read at random.

A zero-copy gather reads scattered rows of a host table over PCIe; each read
needs the row's host address translated (CPU TLB for the CPU gather, the
IOMMU / GPU's address translation for the GPU's reads). With 4 KiB pages a
4 GiB table spans a million pages; with 2 MiB pages, 2048. This module
allocates tables on 2 MiB pages:

- ``pages="thp"`` (default): an anonymous mapping whose table part starts on a
  2 MiB boundary, advised ``MADV_HUGEPAGE`` (transparent huge pages; works
  when ``/sys/kernel/mm/transparent_hugepage/enabled`` is ``always`` or
  ``madvise``). The kernel backs each 2 MiB of it with a huge page when the
  memory is first touched, if it has one free; otherwise with 4 KiB pages.
- ``pages="hugetlb"``: ``MAP_HUGETLB`` from the pre-reserved pool
  (``vm.nr_hugepages``); falls back to ``"thp"`` when the pool is too small.
- ``pages="normal"``: the same mapping advised ``MADV_NOHUGEPAGE`` -- 4 KiB
  pages even where THP is ``always`` (the "off" of an A/B comparison).

Nothing here fails for want of huge pages: when they cannot be asked for
(THP ``never``, no ``madvise``), the table is allocated on normal pages and
a :class:`HugePageWarning` says why (a hugetlb pool too small falls back to
``"thp"``, with a warning too). Whether
the kernel actually *gave* huge pages is known only after the memory was
touched: :func:`page_report` reads ``/proc/self/smaps`` for the table.

The result is an ordinary C-contiguous, writable CPU tensor (storage offset
0, start 2 MiB-aligned) that pingpong can page-lock in place
(``gather="zerocopy"`` registers it with ``cudaHostRegister``). Its storage
holds the mapping: the memory lives exactly as long as the tensor, or any
view or NumPy array of it, and is unmapped when the last of them is freed.
(``tensor.share_memory_()`` moves it into shared memory: a copy on normal
pages.)
"""

from __future__ import annotations

import math
import mmap
import sys
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ._integers import Count, integer
from .errors import ConfigError

__all__ = [
    "HUGE_PAGE_BYTES",
    "PAGE_KINDS",
    "HugePageWarning",
    "PageReport",
    "empty_table",
    "page_report",
    "table_like",
    "thp_mode",
]

#: The huge page size asked for (x86-64 and arm64 with 4 KiB base pages).
HUGE_PAGE_BYTES = 2 * 2**20
#: What ``pages=`` accepts.
PAGE_KINDS = ("thp", "hugetlb", "normal")
#: Where the kernel says whether transparent huge pages are on.
THP_ENABLED_PATH = Path("/sys/kernel/mm/transparent_hugepage/enabled")
#: ``MAP_HUGETLB`` (Linux, every architecture pingpong runs on); Python's mmap
#: module does not export it before 3.13.
MAP_HUGETLB = getattr(mmap, "MAP_HUGETLB", 0x40000)


class HugePageWarning(RuntimeWarning):
    """Huge pages could not be asked for; the table is on normal pages."""


def thp_mode(path: Path | None = None) -> str | None:
    """The bracketed word of the THP ``enabled`` file: ``"always"``, ``"madvise"``,
    ``"never"``, or ``None`` where the file is missing or unreadable (no THP).

    ``path`` defaults to :data:`THP_ENABLED_PATH` (looked up at each call).
    """
    try:
        text = (THP_ENABLED_PATH if path is None else path).read_text()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    if start < 0 or end < start:
        return None
    return text[start + 1 : end]


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _warn(message: str, stacklevel: int) -> None:
    """Warn from :func:`_allocate`; ``stacklevel=1`` names the caller of the public function."""
    warnings.warn(message, HugePageWarning, stacklevel=stacklevel + 3)


def _map(length: int, extra_flags: int = 0) -> mmap.mmap:
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | extra_flags
    return mmap.mmap(-1, length, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)


def _address(mapping: mmap.mmap) -> int:
    probe = torch.frombuffer(mapping, dtype=torch.uint8, count=1)
    address = int(probe.data_ptr())
    del probe  # releases the buffer export at once
    return address


def _advise(mapping: mmap.mmap, option_name: str, start: int, length: int) -> str | None:
    """``madvise`` a part of ``mapping``; the reason it could not, or None."""
    option = getattr(mmap, option_name, None)
    madvise = getattr(mapping, "madvise", None)
    if option is None or madvise is None:
        return f"this Python has no mmap.{option_name} (not Linux?)"
    try:
        madvise(option, start, length)
    except OSError as exc:
        return f"madvise({option_name}) failed: {exc}"
    return None


def _hugetlb_mapping(nbytes: int) -> mmap.mmap | str:
    """A ``MAP_HUGETLB`` mapping of ``nbytes`` rounded up, or why there is none."""
    if not sys.platform.startswith("linux"):
        return "MAP_HUGETLB is Linux-only"
    mapped = _round_up(nbytes, HUGE_PAGE_BYTES)
    try:
        return _map(mapped, MAP_HUGETLB)
    except OSError as exc:
        return (
            f"mmap(MAP_HUGETLB) of {mapped // 2**20} MiB failed ({exc}); "
            "reserve huge pages with `sysctl vm.nr_hugepages=N`"
        )


def empty_table(
    shape: Count | Sequence[Count] | torch.Size,
    dtype: torch.dtype = torch.float32,
    *,
    pages: str = "thp",
) -> torch.Tensor:
    """An uninitialised C-contiguous CPU tensor on 2 MiB pages (see the module docstring).

    Args:
        shape: the table's shape, ``(N, ...)``.
        dtype: any torch dtype.
        pages: ``"thp"``, ``"hugetlb"`` or ``"normal"`` (see the module docstring).

    Warns:
        HugePageWarning: huge pages could not be asked for; the tensor is on
            normal pages (it is still returned).

    Raises:
        ValueError: an unknown ``pages``, a negative dimension, or a ``shape`` that
            is not an int (NumPy integers count; bools do not) or a sequence of them
            (:class:`~pingpong.ConfigError`).
        MemoryError / OSError: the memory itself could not be mapped.
    """
    return _allocate(shape, dtype, pages, stacklevel=1)


def _allocate(
    shape: Count | Sequence[Count] | torch.Size, dtype: torch.dtype, pages: str, stacklevel: int
) -> torch.Tensor:
    """:func:`empty_table`; ``stacklevel=1``: warnings name the public function's caller."""
    if pages not in PAGE_KINDS:
        raise ConfigError(f"pages must be one of {PAGE_KINDS}, got {pages!r}")
    if getattr(shape, "ndim", None) == 0:  # a 0-d array or tensor: one dimension
        shape = shape.item()  # type: ignore[union-attr]
    dims: list[object] = [shape] if integer(shape) is not None or isinstance(shape, bool) else (
        list(shape) if isinstance(shape, Iterable) and not isinstance(shape, str) else [None])
    ints = [integer(dim) for dim in dims]
    if any(dim is None for dim in ints):
        raise ConfigError(f"shape must be an int or a sequence of ints, got {shape!r}")
    size = torch.Size(dim for dim in ints if dim is not None)
    if any(dim < 0 for dim in size):
        raise ConfigError(f"negative dimension in shape {tuple(size)}")
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = math.prod(size) * itemsize
    if nbytes == 0:
        return torch.empty(size, dtype=dtype)
    mapping: mmap.mmap | None = None
    offset = 0
    if pages == "hugetlb":
        result = _hugetlb_mapping(nbytes)
        if isinstance(result, str):
            _warn(f"{result}; falling back to transparent huge pages", stacklevel)
            pages = "thp"
        else:
            mapping = result  # the kernel aligns hugetlb mappings to the huge page size
    if mapping is None:
        # One huge page more than needed, so the table can start on a 2 MiB
        # boundary (the slack is never touched: no memory behind it).
        span = _round_up(nbytes, HUGE_PAGE_BYTES)
        mapping = _map(span + HUGE_PAGE_BYTES)
        offset = -_address(mapping) % HUGE_PAGE_BYTES
        if pages == "normal":
            _advise(mapping, "MADV_NOHUGEPAGE", offset, span)  # a hint: never warned
        else:
            mode = thp_mode()
            if mode == "never":
                _warn(
                    "transparent huge pages are disabled (/sys/kernel/mm/transparent_hugepage/"
                    "enabled is [never]); the table is on 4 KiB pages",
                    stacklevel,
                )
            else:
                reason = _advise(mapping, "MADV_HUGEPAGE", offset, span)
                if reason is not None:
                    _warn(f"{reason}; the table is on 4 KiB pages", stacklevel)
    window = memoryview(mapping)[offset : offset + nbytes]
    # torch.frombuffer keeps `window` (and through it the mapping) alive for as
    # long as the tensor's storage lives; the mapping is unmapped with it.
    flat = torch.frombuffer(window, dtype=torch.uint8)
    return flat.view(dtype).view(size)


def table_like(tensor: torch.Tensor, *, pages: str = "thp") -> torch.Tensor:
    """A copy of ``tensor`` (any device) in a new host table from :func:`empty_table`.

    Shape and dtype are kept; the copy is C-contiguous and on the CPU.  ``pages``
    as for :func:`empty_table`.
    """
    table = _allocate(tensor.shape, tensor.dtype, pages, stacklevel=1)
    table.copy_(tensor.detach())
    return table


@dataclass(frozen=True)
class PageReport:
    """What ``/proc/self/smaps`` says about the mappings that hold a tensor.

    Attributes:
        mapped_bytes: size of the mappings (VMAs) overlapping the tensor's
            bytes; a VMA can be larger than the tensor (THP advice splits a
            mapping exactly at the advised range, so for ``empty_table``
            tables it is the table rounded up to 2 MiB).
        resident_bytes: ``Rss`` of those mappings (memory touched so far).
        anon_huge_bytes: ``AnonHugePages``: resident bytes on transparent huge pages.
        hugetlb_bytes: ``Private_Hugetlb + Shared_Hugetlb`` (``MAP_HUGETLB`` pages).
        kernel_page_bytes: the mappings' ``KernelPageSize`` (largest).
        huge_advised: ``MADV_HUGEPAGE`` is set on every mapping (``hg`` in ``VmFlags``).
    """

    mapped_bytes: int
    resident_bytes: int
    anon_huge_bytes: int
    hugetlb_bytes: int
    kernel_page_bytes: int
    huge_advised: bool

    @property
    def huge_bytes(self) -> int:
        """Resident bytes on 2 MiB pages of either kind."""
        return self.anon_huge_bytes + self.hugetlb_bytes

    @property
    def huge_fraction(self) -> float:
        """Share of the resident bytes on huge pages (0.0 when nothing is resident)."""
        resident = max(self.resident_bytes, self.hugetlb_bytes)
        return self.huge_bytes / resident if resident else 0.0

    @property
    def page_bytes(self) -> int:
        """The page size that backs most of the resident bytes: 2 MiB or 4 KiB."""
        if self.kernel_page_bytes >= HUGE_PAGE_BYTES or self.huge_fraction > 0.5:
            return HUGE_PAGE_BYTES
        return self.kernel_page_bytes or mmap.PAGESIZE


_KB_FIELDS = {
    "Rss": "resident_bytes",
    "AnonHugePages": "anon_huge_bytes",
    "Private_Hugetlb": "hugetlb_bytes",
    "Shared_Hugetlb": "hugetlb_bytes",
    "KernelPageSize": "kernel_page_bytes",
}


def page_report(tensor: torch.Tensor, smaps: Path | str = "/proc/self/smaps") -> PageReport:
    """Sum the ``smaps`` entries of the mappings holding ``tensor``'s bytes (Linux).

    Call it after the table was written (untouched memory has no pages yet).

    Raises:
        OSError: ``smaps`` cannot be read (not Linux).
        ValueError: ``tensor`` is not on the CPU, or no mapping holds it.
    """
    if tensor.device.type != "cpu":
        raise ConfigError(f"page_report needs a CPU tensor, got one on {tensor.device}")
    start = int(tensor.data_ptr())
    end = start + max(1, tensor.numel() * tensor.element_size())
    totals = dict.fromkeys(("resident_bytes", "anon_huge_bytes", "hugetlb_bytes"), 0)
    page = 0
    mapped = 0
    advised: list[bool] = []
    inside = False
    with open(smaps) as lines:  # a /proc file, read line by line
        for line in lines:
            head = line.split(maxsplit=1)[0] if line.strip() else ""
            if "-" in head and not head.endswith(":"):
                low, high = (int(part, 16) for part in head.split("-"))
                inside = low < end and high > start
                if inside:
                    mapped += high - low
                continue
            if not inside:
                continue
            key, _, value = line.partition(":")
            if key == "VmFlags":
                advised.append("hg" in value.split())
                continue
            field = _KB_FIELDS.get(key)
            if field is None:
                continue
            kib = int(value.split()[0]) * 1024
            if field == "kernel_page_bytes":
                page = max(page, kib)
            else:
                totals[field] += kib
    if not mapped:
        raise ConfigError(f"no mapping in {smaps} holds address {start:#x}")
    return PageReport(
        mapped_bytes=mapped,
        kernel_page_bytes=page,
        huge_advised=bool(advised) and all(advised),
        **totals,
    )
