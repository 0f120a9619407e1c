"""What binds a plan (hybridtrain/planner/binding.py): the step's seconds per resource add up
to the step through their exposed parts, the busiest resource is named, and when nothing fits
each memory says by how much it is short among the variants that fit the other."""

from __future__ import annotations

import pytest

from hybridtrain.planner import plan
from hybridtrain.planner.binding import binding_report, least_needs, memory_uses, time_uses
from hybridtrain.planner.estimate import Target, estimate
from hybridtrain.planner.search import MARGIN
from hybridtrain.units import format_bytes

OFFLOAD = {"model": {"name": "gpt-tiny"}, "data": {"seq_len": 64}, "train_batch_size": 8,
           "train_micro_batch_size_per_gpu": 4, "device": "cpu", "bf16": {"enabled": True}, "gradient_clipping": 1.0,
           "zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}}


@pytest.mark.parametrize("host_bandwidth", [1e6, 1e13])
def test_the_step_is_device_compute_plus_what_each_resource_leaves_exposed(host_bandwidth: float) -> None:
    est = estimate(OFFLOAD, Target("cuda", "H100 SXM", 2**30, 2**30, host_bandwidth=host_bandwidth))
    uses = time_uses(est)
    compute = next(u for u in uses if u.resource == "device compute")
    assert est.step_seconds == pytest.approx(compute.seconds + sum(u.exposed for u in uses if u is not compute))
    assert [u.seconds for u in uses] == sorted((u.seconds for u in uses), reverse=True)
    report = binding_report(est, MARGIN)
    assert report[0].startswith(f"binds: {uses[0].resource}, ")
    assert f"step = {est.step_seconds / uses[0].seconds:.2f}x" in report[0]
    if host_bandwidth == 1e6:  # a slow host: its step binds and is exposed
        assert uses[0].resource == "host optimizer step" and uses[0].exposed > 0
    else:
        assert uses[0].resource == "device compute"
    assert any(line.strip().startswith("device memory: needs") for line in report)


def test_no_fit_names_the_memory_that_binds_and_by_how_much() -> None:
    plain = estimate(OFFLOAD, Target("cuda", "H100 SXM"))
    streaming = {k: v for k, v in OFFLOAD.items() if k != "zero_optimization"}
    streamed = estimate({**streaming, "layer_streaming": {"enabled": True}}, Target("cuda", "H100 SXM"))
    # The device holds streaming but not the whole model; the host holds almost nothing.
    device = int(streamed.device_peak_bytes / (1 - MARGIN)) + 1
    assert device * (1 - MARGIN) < plain.device_peak_bytes
    host = 1024
    result = plan(OFFLOAD, Target("cuda", "H100 SXM", device, host))
    assert result.best is None
    lines = least_needs([(c.describe(), c.estimate) for c in result.refused], MARGIN)
    host_line = next(line for line in lines if line.startswith("host memory binds"))
    fits_device = [c for c in result.refused if not memory_uses(c.estimate, MARGIN)[0].over]
    least = min(fits_device, key=lambda c: c.estimate.host_bytes)
    needs = least.estimate.host_bytes
    assert needs > host
    assert (f"the least needs {format_bytes(needs)}, has {format_bytes(host)}: over by "
            f"{format_bytes(needs - host)} ({needs / host:.2f}x) ({least.describe()})") in host_line
