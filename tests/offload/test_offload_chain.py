"""cpu_offload_with_hook on the CPU: the chain calls the previous model's hook.offload() when the next model runs,
remove() detaches, and outputs do not change."""
import torch

from swapio.offload import cpu_offload_with_hook, remove_offload
from swapio.offload.registry import offloaded as _offloaded
from helpers.offload import assert_same_outputs, resident_model


def test_chain_offloads_the_previous_model_when_the_next_runs():
    a, hook_a = cpu_offload_with_hook(resident_model())
    b, hook_b = cpu_offload_with_hook(resident_model(), prev_module_hook=hook_a)
    calls = []
    real = hook_a.offload
    hook_a.offload = lambda: (calls.append("a"), real())
    assert_same_outputs(a)
    assert calls == []
    assert_same_outputs(b)
    assert calls and set(calls) == {"a"}
    hook_b.remove()
    assert b not in _offloaded and not b._forward_pre_hooks
    remove_offload(a)
    assert a not in _offloaded
    with torch.no_grad():
        b(torch.zeros(1, 3, dtype=torch.long))  # runs without the hook


def test_the_compute_stream_waits_on_the_last_copy_issued_not_on_the_last_tensor():
    """cpu_offload_with_hook's load(): empty tensors are not copied and have no event."""
    from swapio.offload.chain import last_copy
    first, second = object(), object()
    assert last_copy([first, second, None]) is second
    assert last_copy([first, None, None]) is first
    assert last_copy([None, None]) is None and last_copy([]) is None
