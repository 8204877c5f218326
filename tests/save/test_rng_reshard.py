"""save/rng_reshard (pure): the RNG streams a resharded resume derives for new ranks, loadable through verl, and
the line that says which ranks resume their saved streams."""

from __future__ import annotations

from .conftest import same_rng_state as _same
from .conftest import shares_a_generator as _shares_a_generator


def _saved_rng(k: int) -> dict:
    """A rank's RNG state as verl's get_rng_state holds it, some draws into its streams."""
    import random

    import numpy as np
    import torch

    g = torch.Generator().manual_seed(k)
    torch.rand(5, generator=g)
    npr = np.random.RandomState(k)
    npr.rand(3)
    pyr = random.Random(k)
    pyr.random()
    return {"cpu": g.get_state(), "numpy": npr.get_state(), "random": pyr.getstate()}


def test_derived_rng_is_deterministic_distinct_and_never_a_saved_stream():
    from slimckpt.save.rng_reshard import derive_rng_state

    saved = [_saved_rng(k) for k in range(3)]
    derived = {r: derive_rng_state(saved[r % 3], r) for r in range(3, 9)}
    for r, state in derived.items():
        assert set(state) == {"cpu", "numpy", "random"}
        assert _same(state, derive_rng_state(_saved_rng(r % 3), r)), r  # equal inputs, equal state
        assert not any(_shares_a_generator(state, s) for s in saved), r
        assert not any(_shares_a_generator(state, other) for q, other in derived.items() if q != r), r
    # the saved state matters too, not only the rank
    assert not _shares_a_generator(derive_rng_state(saved[0], 3), derive_rng_state(saved[1], 3))
    assert _same(saved[0], _saved_rng(0))  # the input is left alone


def test_derived_rng_loads_through_verl_and_skips_an_absent_device():
    import random

    import numpy as np
    import torch
    from verl.utils.checkpoint.checkpoint_manager import BaseCheckpointManager

    from slimckpt.save.rng_reshard import derive_rng_state

    before = BaseCheckpointManager.get_rng_state()
    try:
        source = {**before, "cuda": torch.zeros(16, dtype=torch.uint8)}  # as a GPU run saves it
        derived = derive_rng_state(source, 5)
        assert ("cuda" in derived) == torch.cuda.is_available()
        BaseCheckpointManager.load_rng_state(derived)
        draws = (torch.rand(4), np.random.rand(4), random.random())
        BaseCheckpointManager.load_rng_state(derived)
        assert _same((torch.rand(4), np.random.rand(4), random.random()), draws)
    finally:
        BaseCheckpointManager.load_rng_state(before)


def test_reshard_message_names_derived_and_dropped_ranks():
    from slimckpt.save.rng_reshard import reshard_message

    assert reshard_message(2, 2) is None
    assert reshard_message(2, 3) == (
        "RNG resharded from world size 2 to 3: ranks 0-1 resume their saved streams "
        "exactly; rank 2 gets a new stream derived from saved rank 0 and its rank"
    )
    assert "ranks 2-7 get new streams derived, rank r from saved rank r % 2, and the rank" in reshard_message(2, 8)
    assert reshard_message(3, 2) == (
        "RNG resharded from world size 3 to 2: ranks 0-1 resume their saved streams "
        "exactly; the stream of saved rank 2 is not resumed"
    )
    assert "rank 0 resumes its saved stream exactly; the streams of saved ranks 1-3 are not resumed" in reshard_message(
        4, 1
    )
