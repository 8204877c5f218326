"""observe/diskspeed: the disk's write, read and mixed speeds (O_DIRECT at each request size), and the I/O
floor they set."""

from slimckpt.observe.diskspeed import DiskSpeed, measure_disk_speed


def test_disk_speed_and_io_floor(tmp_path):
    speed = measure_disk_speed(str(tmp_path), size_bytes=64 * 2**20)
    assert speed.write_bytes_per_s > 0 and speed.read_bytes_per_s > 0
    assert not list(tmp_path.iterdir())
    floor = DiskSpeed(write_bytes_per_s=1e9, read_bytes_per_s=2e9, size_bytes=0).io_floor_s(4e9, 1e9)
    assert floor == 3.0


def test_fastest_of_takes_each_bandwidth_at_its_best():
    from slimckpt.observe.diskspeed import fastest_of

    a = DiskSpeed(write_bytes_per_s=1e9, read_bytes_per_s=3e9, size_bytes=7, mixed_bytes_per_s=1e9)
    b = DiskSpeed(write_bytes_per_s=2e9, read_bytes_per_s=1e9, size_bytes=7, mixed_bytes_per_s=0.5e9)
    best = fastest_of([a, b])
    assert (best.write_bytes_per_s, best.read_bytes_per_s, best.mixed_bytes_per_s) == (2e9, 3e9, 1e9)
    assert best.io_floor_s(3e9, 2e9) == 2.0 < min(a.io_floor_s(3e9, 2e9), b.io_floor_s(3e9, 2e9))


def test_direct_io_is_measured_at_each_request_size_and_the_faster_kept(tmp_path, monkeypatch):
    """A disk that serves small O_DIRECT requests faster than large ones gets the small ones' speed as
    its floor, not the large ones' (measured: BENCHMARKS.md, Figures quoted in the code)."""
    from slimckpt.observe import diskspeed

    seen = []

    def write(path, size, direct, chunk=diskspeed.CHUNK):
        seen.append((direct, chunk))
        open(path, "wb").close()
        return {False: 1e9, True: 3e9 if chunk == diskspeed.DIRECT_CHUNKS[0] else 2e9}[direct]

    def read(path, direct, chunk=diskspeed.CHUNK):
        return {False: 1e9, True: 5e9 if chunk == diskspeed.DIRECT_CHUNKS[0] else 4e9}[direct]

    monkeypatch.setattr(diskspeed, "_write", write)
    monkeypatch.setattr(diskspeed, "_read", read)
    monkeypatch.setattr(diskspeed, "_mixed", lambda *a: 1e9)
    speed = diskspeed.measure_disk_speed(str(tmp_path), size_bytes=4096, repeats=1)
    assert sorted(set(seen)) == [(False, diskspeed.CHUNK)] + [(True, c) for c in sorted(diskspeed.DIRECT_CHUNKS)]
    assert (speed.direct_write_bytes_per_s, speed.direct_read_bytes_per_s) == (3e9, 5e9)
    assert (speed.write_bytes_per_s, speed.read_bytes_per_s) == (3e9, 5e9)
