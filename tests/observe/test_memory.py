"""observe/memory: RssAnon read in process and sampled on a thread."""

from slimckpt.observe.memory import RssSampler, rss_anon_bytes


def test_in_process_sampler_sees_a_plateau():
    with RssSampler(interval_s=0.002) as sampler:
        block = bytearray(128 * 2**20)
        block[::4096] = b"y" * len(block[::4096])
        import time

        # 25 of the sampler's 2 ms intervals: the plateau is sampled however the threads are scheduled
        time.sleep(0.05)
    assert sampler.result.extra >= 120 * 2**20
    del block
    assert rss_anon_bytes() > 0
