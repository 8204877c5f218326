"""slimckpt.storage: the POSIX backend through the `Storage` interface, on real files (no mocks)."""

from __future__ import annotations

import errno
import mmap
import os

import pytest

from slimckpt.storage import BACKENDS, LOCAL, Storage, for_path, posix, scheme_of
from slimckpt.storage.base import DIRECT_ALIGN
from slimckpt.storage.posix import PosixStorage


@pytest.fixture
def store() -> Storage:
    return for_path("/tmp")


def _names(d) -> list[str]:
    return sorted(os.listdir(d))


def test_a_plain_path_is_the_posix_backend_and_a_scheme_picks_its_own(monkeypatch):
    assert isinstance(for_path("/tmp/x"), PosixStorage) and isinstance(for_path("relative/dir"), PosixStorage)
    assert for_path("/a") is for_path("/b")
    assert scheme_of("s3://bucket/key") == "s3" and scheme_of("/tmp/s3:/x") == LOCAL
    with pytest.raises(ValueError, match="no storage backend for gs://"):
        for_path("gs://bucket/step")

    class Other(PosixStorage):
        pass

    monkeypatch.setitem(BACKENDS, "mem", Other)
    assert type(for_path("mem://x")) is Other


def test_the_posix_backend_says_what_its_medium_can_do(store):
    assert store.supports_inplace_writes and store.supports_dir_rename and store.supports_leases_that_die_with_holder


def test_ranges_are_written_into_a_file_made_at_its_final_size(store, tmp_path):
    path = str(tmp_path / "w.bin")
    out = store.create_ranges(path, 1000)
    try:
        out.write(b"HEAD", 0)
    finally:
        out.close()
    assert os.path.getsize(path) == 1000  # at its final size before any writer wrote its ranges
    writers = [store.open_ranges(path) for _ in range(2)]
    writers[1].write(memoryview(b"b" * 300), 700)  # out of order, by two writers
    writers[0].write(b"a" * 496, 4)
    for w in writers:
        w.sync()
        w.close()
    data = (tmp_path / "w.bin").read_bytes()
    assert data == b"HEAD" + b"a" * 496 + b"\0" * 200 + b"b" * 300
    assert store.read_range(path, 698, 4) == b"\0\0bb"
    assert store.read_range(path, 990, 100) == b"b" * 10  # fewer at the end of the file
    assert store.list_files(str(tmp_path)) == ["w.bin"]


def _aligned(n: int, at: int) -> memoryview:
    """n bytes of a buffer whose address is congruent to file offset `at` modulo DIRECT_ALIGN."""
    raw = mmap.mmap(-1, n + 2 * DIRECT_ALIGN)  # page-aligned
    shift = at % DIRECT_ALIGN
    view = memoryview(raw)[shift : shift + n]
    view[:] = bytes((at + k) % 251 for k in range(n))
    return view


def test_direct_ranges_send_whole_blocks_around_the_page_cache_and_the_ends_through_it(store, tmp_path, monkeypatch):
    path = str(tmp_path / "d.bin")
    size = 5 * DIRECT_ALIGN + 123
    store.create_ranges(path, size).close()
    sent = []
    real = posix.pwrite_all
    monkeypatch.setattr(posix, "pwrite_all", lambda fd, d, o: sent.append((fd, o, len(d))) or real(fd, d, o))
    writers = [store.open_ranges_direct(path) for _ in range(2)]
    if writers[0].direct_fd is None:
        pytest.skip("this filesystem refuses O_DIRECT")
    direct_fds = {w.direct_fd for w in writers}
    cut = 2 * DIRECT_ALIGN + 100  # two writers meet inside a block: its bytes go through the page cache
    writers[0].write_direct(_aligned(cut - 7, 7), 7)
    writers[1].write_direct(_aligned(size - cut, cut), cut)
    for w in writers:
        w.sync()
        w.close()
    data = (tmp_path / "d.bin").read_bytes()
    assert data[:7] == b"\0" * 7 and data[7:] == bytes((k % 251) for k in range(7, size))
    direct = [(o, n) for fd, o, n in sent if fd in direct_fds]
    assert direct == [(DIRECT_ALIGN, DIRECT_ALIGN), (3 * DIRECT_ALIGN, 2 * DIRECT_ALIGN)]  # the whole blocks
    assert sum(n for _, _, n in sent) == size - 7  # every byte once


def test_direct_ranges_fall_back_to_the_page_cache_where_o_direct_is_refused(store, tmp_path, monkeypatch):
    path = str(tmp_path / "f.bin")
    store.create_ranges(path, 3 * DIRECT_ALIGN).close()
    monkeypatch.setattr(posix, "open_direct", lambda p: None)  # tmpfs, some network mounts
    out = store.open_ranges_direct(path)
    out.write_direct(_aligned(3 * DIRECT_ALIGN, 0), 0)
    out.close()
    assert (tmp_path / "f.bin").read_bytes() == bytes(k % 251 for k in range(3 * DIRECT_ALIGN))
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        shm = f"/dev/shm/slimckpt-direct-{os.getpid()}"
        open(shm, "wb").close()
        try:
            fd = posix.open_direct(shm)
            assert fd is None or os.close(fd) is None  # tmpfs refuses it on the kernels in use; either way no error
        finally:
            os.unlink(shm)


def test_a_direct_write_the_filesystem_refuses_is_redone_through_the_page_cache(store, tmp_path, monkeypatch):
    path = str(tmp_path / "e.bin")
    store.create_ranges(path, 2 * DIRECT_ALIGN).close()
    out = store.open_ranges_direct(path)
    if out.direct_fd is None:
        pytest.skip("this filesystem refuses O_DIRECT")
    real, direct_fd = posix.pwrite_all, out.direct_fd

    def refusing(fd, d, o):
        if fd == direct_fd:
            raise OSError(errno.EINVAL, "Invalid argument")
        real(fd, d, o)

    monkeypatch.setattr(posix, "pwrite_all", refusing)
    out.write_direct(_aligned(2 * DIRECT_ALIGN, 0), 0)
    assert out.direct_fd is None  # not tried again
    out.write_direct(_aligned(DIRECT_ALIGN, DIRECT_ALIGN), DIRECT_ALIGN)
    out.close()
    assert (tmp_path / "e.bin").read_bytes() == bytes(k % 251 for k in range(2 * DIRECT_ALIGN))


def test_create_ranges_truncates_an_old_file_and_used_bytes_counts_written_blocks(store, tmp_path):
    path = tmp_path / "old.bin"
    path.write_bytes(b"x" * 10)
    store.create_ranges(str(path), 3).close()
    assert path.read_bytes() == b"\0\0\0"
    assert store.free_bytes(str(tmp_path)) > 0
    assert store.used_bytes(str(tmp_path / "missing")) == 0
    assert store.used_bytes(str(tmp_path)) >= 0


def test_an_atomic_put_replaces_the_whole_file_and_leaves_no_tmp(store, tmp_path):
    path = str(tmp_path / "tracker.txt")
    store.put_atomic(path, b"1")
    store.put_atomic(path, b"22")
    assert (tmp_path / "tracker.txt").read_bytes() == b"22" and _names(tmp_path) == ["tracker.txt"]


def test_a_failed_atomic_put_keeps_the_old_file_and_leaves_no_tmp(store, tmp_path):
    path = str(tmp_path / "state.pt")
    store.put_atomic(path, b"old")
    with pytest.raises(RuntimeError), store.open_atomic(path) as f:  # the writer fails midway
        f.write(b"half")
        raise RuntimeError("serializer failed")
    assert (tmp_path / "state.pt").read_bytes() == b"old" and _names(tmp_path) == ["state.pt"]
    busy = tmp_path / "a_dir"  # the rename itself fails: a non-empty directory is in the way
    busy.mkdir()
    (busy / "f").write_text("x")
    with pytest.raises(OSError):
        store.put_atomic(str(busy), b"new", tmp=str(tmp_path / "a_dir.tmp"))
    assert _names(tmp_path) == ["a_dir", "state.pt"]


def test_put_if_absent_never_overwrites_a_committed_manifest(store, tmp_path):
    path = str(tmp_path / "manifest.json")
    assert store.put_if_absent(path, b'{"step": 1}')
    assert not store.put_if_absent(path, b'{"step": 2}')
    assert (tmp_path / "manifest.json").read_bytes() == b'{"step": 1}'
    assert _names(tmp_path) == ["manifest.json"]  # no tmp left, either time


def _tree(root, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


def test_publish_puts_the_partial_dir_in_place_of_an_old_one(store, tmp_path):
    final, partial, aside = tmp_path / "out", tmp_path / "out.partial", tmp_path / "out.old"
    _tree(final, {"a": "old", "sub/b": "old"})
    _tree(partial, {"a": "new"})
    store.sync_tree(str(partial))
    with pytest.raises(OSError):  # a non-empty dir is replaced only when set aside
        store.atomic_publish(str(partial), str(final))
    assert (final / "a").read_text() == "old" and partial.is_dir()
    store.atomic_publish(str(partial), str(final), aside=str(aside))
    assert store.list_files(str(final)) == ["a"] and (final / "a").read_text() == "new"
    assert not partial.exists() and (aside / "sub" / "b").read_text() == "old"
    assert store.remove_tree(str(aside)) == []
    assert _names(tmp_path) == ["out"]


def test_publish_replaces_an_empty_dir_and_puts_the_old_one_back_when_it_fails(store, tmp_path):
    final, partial = tmp_path / "out", tmp_path / "out.partial"
    final.mkdir()
    _tree(partial, {"a": "new"})
    store.atomic_publish(str(partial), str(final))
    assert store.list_files(str(final)) == ["a"] and not partial.exists()
    with pytest.raises(FileNotFoundError):  # no partial: the old output comes back from aside
        store.atomic_publish(str(partial), str(final), aside=str(tmp_path / "out.old"))
    assert store.list_files(str(final)) == ["a"] and _names(tmp_path) == ["out"]


def test_tree_and_file_deletes(store, tmp_path):
    _tree(tmp_path / "step", {"dcp/__0_0.distcp": "x", "extra.pt": "y"})
    store.remove(str(tmp_path / "step" / "extra.pt"))
    with pytest.raises(FileNotFoundError):
        store.remove(str(tmp_path / "step" / "extra.pt"))
    store.remove_tree(str(tmp_path / "step"))
    assert _names(tmp_path) == []
    with pytest.raises(FileNotFoundError):
        store.remove_tree(str(tmp_path / "step"))
    errors = store.remove_tree(str(tmp_path / "step"), ignore_errors=True)
    assert len(errors) == 1 and str(tmp_path / "step") in errors[0]


def test_a_lease_refuses_a_conflicting_holder_until_released(store, tmp_path):
    key = str(tmp_path / ".step.slimckpt-lock")
    writer = store.lease(key, exclusive=True)
    assert writer is not None
    writer.note("pid 1 on host h: saving\n")
    assert store.lease(key, exclusive=True) is None and store.lease(key, exclusive=False) is None
    assert store.lease_note(key) == "pid 1 on host h: saving"
    writer.release()
    writer.release()  # idempotent
    assert not os.path.exists(key)  # the holder's release removes its key
    readers = [store.lease(key, exclusive=False) for _ in range(2)]
    assert all(r is not None for r in readers)
    assert store.lease(key, exclusive=True) is None
    readers[0].release()
    assert os.path.exists(key) and store.lease(key, exclusive=True) is None  # one reader still in
    readers[1].release()
    assert not os.path.exists(key) and store.lease_note(key) == ""


def test_the_sync_calls_accept_files_dirs_and_open_files(store, tmp_path):
    path = tmp_path / "f"
    with open(path, "wb") as f:
        f.write(b"x")
        f.flush()
        store.sync_open(f)
        store.sync_open(f.fileno())
    store.sync(str(path))
    store.sync(str(tmp_path))
    store.make_dirs(str(tmp_path / "a" / "b"))
    store.make_dirs(str(tmp_path / "a" / "b"), exist_ok=True)
    with pytest.raises(FileExistsError):
        store.make_dirs(str(tmp_path / "a" / "b"))
