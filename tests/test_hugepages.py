"""Host tables on 2 MiB pages: ordinary tensors, honest fallbacks, memory given back."""

from __future__ import annotations

import gc
import mmap
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import make_triples

import pingpong
from pingpong import hugepages as hp

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="huge pages and /proc/self/smaps are Linux's"
)


def _rss_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * mmap.PAGESIZE


def _mappings_overlapping(start: int, end: int) -> list[str]:
    """Lines of /proc/self/maps whose range overlaps ``[start, end)``."""
    found = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        low, high = (int(part, 16) for part in line.split()[0].split("-"))
        if low < end and high > start:
            found.append(line)
    return found


def _vm_flags(table: torch.Tensor, wanted: tuple[str, ...] = ("hg", "nh")) -> list[str]:
    """The THP advice flags (``hg``/``nh``) of the mappings holding ``table``."""
    start, end = table.data_ptr(), table.data_ptr() + table.numel() * table.element_size()
    flags: list[str] = []
    inside = False
    with open("/proc/self/smaps") as lines:
        for line in lines:
            head = line.split(maxsplit=1)[0] if line.strip() else ""
            if "-" in head and not head.endswith(":"):
                low, high = (int(part, 16) for part in head.split("-"))
                inside = low < end and high > start
            elif inside and line.startswith("VmFlags:"):
                flags += [f for f in line.split()[1:] if f in wanted]
    return sorted(set(flags))


def _table_no_warning(*args, **kwargs) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("error", hp.HugePageWarning)
        return hp.empty_table(*args, **kwargs)


THP_ON = hp.thp_mode() in ("always", "madvise")


@pytest.mark.parametrize(
    ("shape", "dtype"),
    [
        ((1000, 128), torch.float32),
        ((3, 5, 7), torch.bfloat16),
        (4097, torch.int64),
        ((1, 1), torch.uint8),
        ((0, 16), torch.float16),
    ],
    ids=str,
)
@pytest.mark.parametrize("pages", ["thp", "normal"])
def test_an_ordinary_contiguous_writable_tensor(shape, dtype, pages):
    with warnings.catch_warnings():
        # THP may be off on a CI machine: a warning there is the documented fallback.
        warnings.simplefilter("ignore", hp.HugePageWarning)
        table = hp.empty_table(shape, dtype, pages=pages)
    expected = torch.Size((shape,) if isinstance(shape, int) else shape)
    assert table.shape == expected
    assert table.dtype == dtype
    assert table.device.type == "cpu"
    assert table.is_contiguous()
    assert table.storage_offset() == 0
    if table.numel():
        assert table.data_ptr() % hp.HUGE_PAGE_BYTES == 0
        table.view(-1)[-1] = 1  # writable
        assert table.numpy().flags.writeable if dtype != torch.bfloat16 else True


def test_data_survives_and_views_keep_the_memory():
    table = hp.empty_table((2048, 256), torch.float32)
    pattern = torch.arange(2048 * 256, dtype=torch.float32).view(2048, 256)
    table.copy_(pattern)
    array = table.numpy()
    rows = table[100:200]
    del table
    gc.collect()
    assert torch.equal(rows, pattern[100:200])  # the view holds the mapping
    assert np.array_equal(array, pattern.numpy())


def test_table_like_copies_shape_dtype_and_bits():
    source = torch.randn(3000, 96).to(torch.bfloat16)
    source.view(torch.int16)[0, :4] = torch.tensor([0x7FC1, -0x7FFF, 0, -0x8000])  # NaN, -0...
    copy = hp.table_like(source)
    assert copy.shape == source.shape
    assert copy.dtype == source.dtype
    assert copy.data_ptr() != source.data_ptr()
    assert torch.equal(copy.view(torch.int16), source.view(torch.int16))


@pytest.mark.skipif(not THP_ON, reason="transparent huge pages are off on this machine")
def test_thp_table_is_advised_and_reports_its_pages():
    table = _table_no_warning((4096, 1024), torch.float32)  # 16 MiB
    before = hp.page_report(table)
    assert before.huge_advised
    assert before.mapped_bytes == 16 * 2**20  # the advice splits the mapping exactly
    table.fill_(1.0)
    report = hp.page_report(table)
    assert report.resident_bytes == 16 * 2**20
    assert report.anon_huge_bytes % hp.HUGE_PAGE_BYTES == 0
    if report.anon_huge_bytes == 0:  # pragma: no cover - depends on the kernel's free memory
        pytest.skip("the kernel had no free huge pages (fragmented memory?)")
    assert report.page_bytes == hp.HUGE_PAGE_BYTES
    assert 0.0 < report.huge_fraction <= 1.0


def test_normal_pages_are_not_advised():
    table = _table_no_warning((4096, 1024), torch.float32, pages="normal")
    table.fill_(1.0)
    report = hp.page_report(table)
    assert not report.huge_advised
    assert report.anon_huge_bytes == 0  # MADV_NOHUGEPAGE: even where THP is "always"
    # Where THP is "madvise" the line above holds without the advice: read it
    # (a kernel without THP refuses the advice, which is only a hint: no flag).
    if hp.thp_mode() is not None:
        assert _vm_flags(table) == ["nh"]
    assert report.page_bytes == mmap.PAGESIZE


def test_madvise_failure_warns_and_still_gives_a_table(monkeypatch):
    monkeypatch.setattr(hp, "thp_mode", lambda path=None: "madvise")
    monkeypatch.setattr(mmap, "MADV_HUGEPAGE", 0x7FFF, raising=False)  # EINVAL from the kernel
    with pytest.warns(hp.HugePageWarning, match=r"madvise\(MADV_HUGEPAGE\) failed") as record:
        table = hp.empty_table((512, 64), torch.float32)
    assert record[0].filename == __file__  # names the caller, not pingpong
    table.fill_(2.0)
    assert float(table.sum()) == 2.0 * 512 * 64
    assert not hp.page_report(table).huge_advised


def test_no_madvise_in_this_python_warns(monkeypatch):
    monkeypatch.setattr(hp, "thp_mode", lambda path=None: "always")
    monkeypatch.delattr(mmap, "MADV_HUGEPAGE", raising=False)
    with pytest.warns(hp.HugePageWarning, match="no mmap.MADV_HUGEPAGE"):
        table = hp.empty_table(1000, torch.int32)
    table[:] = 7
    assert int(table.sum()) == 7000


def test_thp_disabled_warns_and_does_not_advise(monkeypatch, tmp_path):
    enabled = tmp_path / "enabled"
    enabled.write_text("always madvise [never]\n")
    monkeypatch.setattr(hp, "THP_ENABLED_PATH", enabled)
    assert hp.thp_mode() == "never"
    with pytest.warns(hp.HugePageWarning, match=r"disabled .*\[never\]"):
        table = hp.table_like(torch.ones(300, 10))
    assert torch.equal(table, torch.ones(300, 10))
    assert not hp.page_report(table).huge_advised


def test_thp_mode_reads_the_bracketed_word(tmp_path):
    path = tmp_path / "enabled"
    for text, mode in [("[always] madvise never", "always"), ("always [madvise] never", "madvise"),
                       ("garbage", None)]:
        path.write_text(text)
        assert hp.thp_mode(path) == mode
    assert hp.thp_mode(tmp_path / "missing") is None


def test_hugetlb_without_a_pool_falls_back_to_thp(monkeypatch):
    monkeypatch.setattr(hp, "_hugetlb_mapping", lambda nbytes: "mmap(MAP_HUGETLB) failed (test)")
    with pytest.warns(hp.HugePageWarning, match="falling back to transparent huge pages"):
        table = hp.empty_table((256, 256), torch.float32, pages="hugetlb")
    table.fill_(3.0)
    assert float(table[255, 255]) == 3.0
    assert table.data_ptr() % hp.HUGE_PAGE_BYTES == 0
    if THP_ON:  # the fallback is THP, advised: not a silent drop to normal pages
        assert hp.page_report(table).huge_advised


def test_the_table_starts_on_the_first_2mib_boundary_of_its_mapping(monkeypatch):
    """Linux 6.7+ places large anonymous mappings on 2 MiB boundaries itself, so the
    alignment checks above hold even without the offset into the mapping; here the
    mapping's address is reported 4 KiB lower, and the table must start where that
    address plus the table's offset into the mapping is a 2 MiB boundary."""
    real = hp._address
    starts: list[tuple[int, int]] = []

    def shifted(mapping: mmap.mmap) -> int:
        starts.append((real(mapping), real(mapping) - mmap.PAGESIZE))
        return starts[-1][1]

    monkeypatch.setattr(hp, "_address", shifted)
    table = _table_no_warning((512, 64), torch.float32, pages="normal")
    assert len(starts) == 1
    (actual, reported), offset = starts[0], table.data_ptr() - starts[0][0]
    assert 0 <= offset < hp.HUGE_PAGE_BYTES
    assert (reported + offset) % hp.HUGE_PAGE_BYTES == 0
    if actual % hp.HUGE_PAGE_BYTES == 0:  # the kernel aligned it: 4 KiB in
        assert offset == mmap.PAGESIZE
    table.fill_(1.0)  # inside the mapping
    assert float(table.sum()) == 512 * 64


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MAP_HUGETLB is Linux-only")
def test_a_failed_hugetlb_mapping_names_the_size_it_asked_for(monkeypatch):
    """Found in review: a table under 1 MiB was reported as "of 0 MiB"."""
    def refuse(length: int, extra_flags: int = 0) -> mmap.mmap:
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(hp, "_map", refuse)
    for nbytes, mib in [(1, 2), (2**20, 2), (2 * 2**20, 2), (2 * 2**20 + 1, 4)]:
        assert f"mmap(MAP_HUGETLB) of {mib} MiB failed" in hp._hugetlb_mapping(nbytes)


def test_hugetlb_for_real_either_works_or_warns():
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        table = hp.empty_table((512, 1024), torch.float32, pages="hugetlb")  # 2 MiB
    table.fill_(1.0)
    report = hp.page_report(table)
    if record:  # no reserved pool (the usual case)
        assert issubclass(record[0].category, hp.HugePageWarning)
    else:
        assert report.hugetlb_bytes == 2 * 2**20
        assert report.page_bytes == hp.HUGE_PAGE_BYTES


def test_bad_arguments():
    with pytest.raises(ValueError, match="pages must be one of"):
        hp.empty_table((2, 2), pages="gigantic")
    with pytest.raises(ValueError, match="negative"):
        hp.empty_table((2, -1))
    # from a code review: True was shape (1,), np.int64(5) a TypeError from torch
    bad: list[Any] = [True, (2, True), (2, 2.0), 2.0, "3", None]
    for shape in bad:
        with pytest.raises(ValueError, match="shape must be an int or a sequence of ints"):
            hp.empty_table(shape)
    assert hp.empty_table(np.int64(5)).shape == (5,)
    assert hp.empty_table((np.int32(3), 2)).shape == (3, 2)
    # from a code review: a 0-d array was a bare TypeError ("iteration over a 0-d array")
    zero_d: list[Any] = [np.array(5), torch.tensor(4), np.array(5.5)]
    assert hp.empty_table(zero_d[0]).shape == (5,)
    assert hp.empty_table(zero_d[1]).shape == (4,)
    with pytest.raises(ValueError, match="shape must be an int or a sequence of ints"):
        hp.empty_table(zero_d[2])
    with pytest.raises(ValueError, match="CPU tensor"):
        hp.page_report(torch.empty(1, device="meta"))


@pytest.mark.parametrize("pages", ["thp", "normal"])
def test_memory_is_unmapped_when_the_tensor_goes(pages):
    nbytes = 64 * 2**20
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", hp.HugePageWarning)
        table = hp.empty_table(nbytes // 4, torch.float32, pages=pages)
    start, end = table.data_ptr(), table.data_ptr() + nbytes
    table.fill_(1.0)
    assert _mappings_overlapping(start, end)
    rss_full = _rss_bytes()
    array = table.numpy()  # a NumPy view keeps it alive too
    del table
    gc.collect()
    assert _mappings_overlapping(start, end)
    del array
    gc.collect()
    assert not _mappings_overlapping(start, end)
    assert _rss_bytes() < rss_full - nbytes // 2


@pytest.mark.parametrize("id_dtype", [torch.int64, torch.int32])
def test_loader_over_a_huge_page_table_gathers_bit_identically(id_dtype):
    num_rows = 5000
    source = torch.randn(num_rows, 37).to(torch.float16)  # odd row width: 74 bytes
    features = hp.table_like(source)
    labels = hp.table_like(torch.arange(num_rows))
    triples = [
        (inputs.to(id_dtype), outputs.to(id_dtype), blocks)
        for inputs, outputs, blocks in make_triples(num_rows, 12, max_inputs=900)
    ]
    with pingpong.PingPongLoader(triples, features, labels=labels, device="cpu") as loader:
        for _ in range(2):
            seen = 0
            for batch, (inputs, outputs, _) in zip(loader, triples, strict=True):
                assert torch.equal(batch.x.view(torch.int16), source[inputs].view(torch.int16))
                assert torch.equal(batch.y, labels[outputs])
                seen += 1
            assert seen == len(triples)


def test_page_report_sums_every_mapping_holding_the_tensor(tmp_path):
    """A table across two mappings (VMAs), one advised and one not: huge only where
    *every* mapping is advised; sizes summed over both; a mapping elsewhere ignored."""
    table = torch.zeros(1024, dtype=torch.uint8)
    start = table.data_ptr()
    middle, end = start + 512, start + 1024
    smaps = tmp_path / "smaps"
    smaps.write_text(
        f"{start - 4096:x}-{middle:x} rw-p 00000000 00:00 0\n"
        "Rss:                   8 kB\nAnonHugePages:         0 kB\nKernelPageSize:        4 kB\n"
        "VmFlags: rd wr mr mw me ac hg\n"
        f"{middle:x}-{end + 4096:x} rw-p 00000000 00:00 0\n"
        "Rss:                  12 kB\nAnonHugePages:      2048 kB\nKernelPageSize:        4 kB\n"
        "Private_Hugetlb:       0 kB\nVmFlags: rd wr mr mw me ac\n"
        f"{end + 8192:x}-{end + 16384:x} rw-p 00000000 00:00 0\n"
        "Rss:                 100 kB\nVmFlags: rd wr hg\n"
    )
    report = hp.page_report(table, smaps)
    assert not report.huge_advised
    assert report.mapped_bytes == (middle - start + 4096) + (end + 4096 - middle)
    assert report.resident_bytes == 20 * 1024
    assert report.anon_huge_bytes == 2048 * 1024
    smaps.write_text(smaps.read_text().replace("me ac\n", "me ac hg\n"))
    assert hp.page_report(table, smaps).huge_advised
