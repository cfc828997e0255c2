"""offload="nvme" costs a small model no more host memory than offload="cpu" plus 64 MiB: its pinned buffers are
sized to the state (never larger than the state needs), not to buffer_bytes. Each mode runs in a child process
(tests/helpers/memory_child.py) that reports the growth of its peak RSS over two AdamW steps of 3 M fp32 parameters
(24 MB of state)."""
import json

import pytest

from helpers.fork import forkserver, run_child  # noqa: F401

MiB = 1 << 20
SHAPES = [(1000, 1000), (1000, 1000), (1_000_000,)]  # 3 M parameters
BOUND = 64 * MiB


def _growth(forkserver, mode, tmp_path):
    from helpers import memory_child

    result = tmp_path / f"{mode}.json"
    assert run_child(forkserver, memory_child.peak_growth, mode, str(tmp_path), SHAPES, str(result)) == 0
    return json.loads(result.read_text())


@pytest.mark.slow
def test_nvme_costs_a_small_model_at_most_64_mib_more_than_cpu(forkserver, tmp_path):
    cpu, nvme = _growth(forkserver, "cpu", tmp_path), _growth(forkserver, "nvme", tmp_path)
    if not (cpu["reset"] and nvme["reset"]):
        pytest.skip("cannot reset the peak RSS (/proc/self/clear_refs) on this kernel")
    state = cpu["report"]["state_bytes"]
    assert state == 24_000_000  # exp_avg and exp_avg_sq; the fp32 parameters are their own masters
    assert nvme["report"]["pinned_bytes"] <= state + 3 * 4096 * 4  # the buffers: no more than the state needs
    print(f"peak RSS growth: cpu {cpu['growth'] / MiB:.1f} MiB, nvme {nvme['growth'] / MiB:.1f} MiB "
          f"(pinned {nvme['report']['pinned_bytes'] / MiB:.1f} MiB)")
    assert nvme["growth"] - cpu["growth"] <= BOUND
