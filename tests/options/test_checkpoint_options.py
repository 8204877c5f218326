"""options/checkpoint_options: the engine's settings, as every spelling of the config reads."""


def test_async_mode_reads_every_spelling():
    from slimckpt.options.checkpoint_options import async_mode

    assert [async_mode(v) for v in (None, False, "false", True, "true", "pool", "stream", "Stream")] == [
        "off",
        "off",
        "off",
        "pool",
        "pool",
        "pool",
        "stream",
        "stream",
    ]
