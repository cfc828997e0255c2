"""nvme mode pins no more than the state needs: a state smaller than buffer_bytes is cut into chunks of about
1/buffer_count of it and the slots shrink to the largest record, grow (within the budget) when larger parameters
arrive, and stay at buffer_bytes / buffer_count for states larger than the budget."""
import torch

import swapio.optim as so
from helpers.optim import one_thread  # noqa: F401


def _slot_bytes(opt):
    return [s.numel() for s in opt._backend._slots]


def _step(opt, params):
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()


def test_small_state_pins_only_its_records(tmp_path):
    p = torch.zeros(1000, requires_grad=True)  # fp32 CPU: exp_avg + exp_avg_sq, 4000 bytes each -> 2 x 4 KiB
    with so.OffloadAdamW([p], offload="nvme", swap_dir=tmp_path) as opt:  # default budget: 256 MiB
        _step(opt, [p])
        assert _slot_bytes(opt) == [8192] * 4


def test_slots_grow_for_a_larger_group_and_keep_the_state(tmp_path):
    small, big = torch.zeros(1000, requires_grad=True), torch.zeros(100_000, requires_grad=True)
    ref_small, ref_big = small.detach().clone().requires_grad_(), big.detach().clone().requires_grad_()
    ref = torch.optim.AdamW([ref_small], lr=1e-2)
    with so.OffloadAdamW([small], lr=1e-2, offload="nvme", swap_dir=tmp_path) as opt:
        _step(opt, [small])
        _step(ref, [ref_small])
        opt.add_param_group({"params": [big]})
        ref.add_param_group({"params": [ref_big]})
        _step(opt, [small, big])
        _step(ref, [ref_small, ref_big])
        # big is cut into chunks of a quarter of it (25 600 elements, a multiple of 1024): 4 slots pin its size
        assert _slot_bytes(opt) == [2 * ((25_600 * 4 + 4095) // 4096 * 4096)] * 4  # exp_avg, exp_avg_sq
        torch.testing.assert_close(small, ref_small, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(big, ref_big, rtol=1e-6, atol=1e-7)


def test_large_state_uses_the_whole_budget(tmp_path):
    p = torch.zeros(200_000, requires_grad=True)  # 1.6 MB of state > 4 slots x 64 KiB
    with so.OffloadAdamW([p], offload="nvme", swap_dir=tmp_path, buffer_bytes=4 << 16, buffer_count=4) as opt:
        _step(opt, [p])
        assert _slot_bytes(opt) == [64 << 10] * 4


def test_memory_report_of_a_resident_model_states_only_the_state_slots(tmp_path):
    # guide.md: buffer_bytes is all the host memory nvme mode uses for the state. The gradient-sum buffers
    # belong to offloaded weights (docs/offload.md, "Host memory"); a resident model has none to pin.
    p = torch.zeros(200_000, requires_grad=True)
    with so.OffloadAdamW([p], offload="nvme", swap_dir=tmp_path, buffer_bytes=4 << 16, buffer_count=4) as opt:
        _step(opt, [p])
        report = opt.memory_report()
        assert report["pinned_budget"] == sum(_slot_bytes(opt)) == 4 << 16, report
        assert set(report["pinned_parts"]) == {"state"}, report
