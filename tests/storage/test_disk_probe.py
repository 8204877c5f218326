import errno
import os

from slimckpt.storage import disk_probe


def test_a_timed_write_leaves_the_size_asked_and_a_timed_read_reads_it_all(tmp_path):
    path = str(tmp_path / "scratch")
    assert disk_probe.timed_write(path, 3 * 2**20, direct=False, chunk=2**20) > 0
    assert os.path.getsize(path) == 3 * 2**20
    assert disk_probe.timed_read(path, direct=False, chunk=2**20) > 0
    disk_probe.remove_scratch(path, path + ".absent")
    assert not os.path.exists(path)


def test_a_filesystem_refusing_o_direct_is_not_measured_and_not_an_error(tmp_path, monkeypatch):
    real_open = os.open

    def refuse_direct(path, flags, mode=0o777):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "O_DIRECT refused", path)
        return real_open(path, flags, mode)

    monkeypatch.setattr(os, "open", refuse_direct)
    path = str(tmp_path / "scratch")
    assert disk_probe.timed_write(path, 2**20, direct=True, chunk=2**20) == 0.0
    assert disk_probe.timed_write(path, 2**20, direct=False, chunk=2**20) > 0
    assert disk_probe.timed_read(path, direct=True, chunk=2**20) == 0.0
