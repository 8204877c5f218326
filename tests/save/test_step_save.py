"""The incremental tier's save path on FSDP1 and FSDP2, as scripts/gpu_check.sh checks it on a GPU
(slimckpt_testing.gpu_check_fsdp), run here on the CPU: two ranks over gloo take the save's state dict exactly
as resume_state does. FSDP1's is a copy of the rank's shards (the copy `slimckpt plan` shows as the
device memory an FSDP1 save adds, on the accelerator when training runs there), FSDP2's is views of
the live shards; both round-trip bit-equal through the tier's DCP writer."""

from __future__ import annotations

import pytest

from slimckpt.plan import cost
from slimckpt_testing.gpu_check_fsdp import check_fsdp_save


@pytest.mark.slow
def test_fsdp1_state_dict_copies_the_shards_and_fsdp2_views_them():
    checks, figures = check_fsdp_save("cpu", hidden=96)
    assert checks == {
        "fsdp1_dcp_roundtrip": True,
        "fsdp2_dcp_roundtrip": True,
        "fsdp1_state_dict_is_a_copy": True,
        "fsdp2_state_dict_is_views": True,
    }, figures
    for version in ("fsdp1", "fsdp2"):
        assert [r["rank"] for r in figures[version]] == [0, 1]
    # plan's figure for the FSDP1 copy: the rank's model + optimizer shard bytes, as the check measures them
    for r in figures["fsdp1"]:
        strategy = cost.Strategy("inc", incremental=True)
        assert cost.device_extra_bytes(strategy, 1, r["shard_bytes"]) == r["shard_bytes"]
        assert abs(r["copied_bytes"] - r["shard_bytes"]) <= 0.02 * r["shard_bytes"]
    assert all(
        cost.device_extra_bytes(cost.Strategy("inc", incremental=True), 2, r["shard_bytes"]) == 0
        for r in figures["fsdp2"]
    )
