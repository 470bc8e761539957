"""The worker's prefill time per token (``worker.prefill_rate``): measured on the steps that prefill."""

from __future__ import annotations

import pytest

from worker.prefill_rate import PrefillRate


def test_prefill_steps_set_the_rate_and_decode_steps_leave_it() -> None:
    rate = PrefillRate()
    assert rate.ms_per_token == 0.0, "nothing measured: stealing waits the bound alone"
    rate.observe(tokens=512, seqs=1, forward_s=1.024)
    assert rate.ms_per_token == pytest.approx(2.0)
    rate.observe(tokens=8, seqs=8, forward_s=0.8)  # a decoding step: 100 ms per token, not a prefill's cost
    rate.observe(tokens=0, seqs=0, forward_s=0.0)
    assert rate.ms_per_token == pytest.approx(2.0)
    rate.observe(tokens=256, seqs=2, forward_s=1.024)  # 4 ms per token: the mean moves toward it
    assert 2.0 < rate.ms_per_token < 4.0
