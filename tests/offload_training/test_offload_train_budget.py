"""Host memory while training offloaded weights does not grow with the model's depth, and every pinned buffer
counts against the budget that memory_report() states. Each run is a child process
(tests/helpers/train_budget_child.py):
two steps of a small decoder-shaped model, disk_offload + OffloadAdamW, 2 and 8 layers. Measured: the growth of
peak RSS, and swapio's own accounting of its pinned blocks (core/pinned.py), which also counts memory the kernel
refused to lock (RLIMIT_MEMLOCK is 8 MiB here, so VmLck says little)."""
import json

import pytest

from helpers import train_budget_child as child
from swapio.tools import memplan
from helpers.fork import forkserver, run_child  # noqa: F401

MiB = 1 << 20
SHALLOW, DEEP = 2, 14  # the deep model has 12 more blocks: 12 MiB more bf16 weights, 24 MiB more fp32 gradients


def _run(forkserver, tmp_path, layers, mode):
    directory = tmp_path / f"{mode}{layers}"
    directory.mkdir()
    result = directory / "result.json"
    assert run_child(forkserver, child.train, layers, mode, str(directory), str(result)) == 0
    return json.loads(result.read_text())


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["accumulate", "in_backward"])
def test_pinned_memory_is_within_the_stated_budget_and_independent_of_depth(forkserver, tmp_path, mode):
    shallow, deep = (_run(forkserver, tmp_path, n, mode) for n in (SHALLOW, DEEP))
    for got in (shallow, deep):
        report = got["report"]
        # every pinned block alive is one memory_report() counts (ring, spare, state slots, gradient buffers,
        # the weight store's pool): nothing pinned outside the budget's parts
        assert report["pinned_bytes"] == got["pinned_now"], report
        assert sum(part["bytes"] for part in report["pinned_parts"].values()) == report["pinned_bytes"]
        assert got["pinned_peak"] <= report["pinned_budget"], (got["pinned_peak"], report)
        for name, part in report["pinned_parts"].items():
            assert part["bytes"] <= part["budget"], (name, part)
    assert deep["report"]["pinned_budget"] == shallow["report"]["pinned_budget"]
    # `swapio plan`'s arithmetic for the same options states the same budget, part by part (the state's slots
    # are sized to its largest chunk here: a little under buffer_bytes)
    weights = deep["report"]["params"] * 2  # bf16
    planned = memplan.offloaded_training_pinned(weights, deep["report"]["state_bytes"], child.BUDGET, child.RING,
                                                largest_module=child.VOCAB * child.DIM * 2,
                                                in_backward=mode == "in_backward")
    budgets = {name: part["budget"] for name, part in deep["report"]["pinned_parts"].items()}
    assert set(budgets) == set(planned)
    assert all(budgets[name] <= planned[name] for name in planned), (budgets, planned)
    assert deep["report"]["pinned_budget"] >= 0.95 * sum(planned.values())
    assert deep["pinned_peak"] - shallow["pinned_peak"] <= 64 << 10
    if not (shallow["reset"] and deep["reset"]):
        pytest.skip("cannot reset the peak RSS (/proc/self/clear_refs) on this kernel")
    print(f"{mode}: peak RSS growth {shallow['growth'] / MiB:.1f} MiB ({SHALLOW} layers), "
          f"{deep['growth'] / MiB:.1f} MiB ({DEEP}); pinned peak {shallow['pinned_peak'] / MiB:.1f} / "
          f"{deep['pinned_peak'] / MiB:.1f} MiB, budget {deep['report']['pinned_budget'] / MiB:.1f} MiB")
    # 12 more layers add only their activations (8 tokens: KiBs) and per-weight bookkeeping
    assert deep["growth"] - shallow["growth"] <= 6 * MiB
    # beyond the pinned budget: autograd's bf16 gradients, the loss's logits, allocator slack
    assert deep["growth"] <= deep["report"]["pinned_budget"] + 16 * MiB
