"""swapio plan's arithmetic against hand-computed cases."""
import pytest

from swapio.tools import memplan

GB, GiB = 10**9, 1 << 30


@pytest.mark.parametrize("text, count", [("7B", 7 * 10**9), ("70b", 70 * 10**9), ("1.5B", 1_500_000_000),
                                         ("125M", 125_000_000), ("7e9", 7 * 10**9), ("350000", 350_000),
                                         ("2T", 2 * 10**12), ("0.5k", 500)])
def test_parse_count(text, count):
    assert memplan.parse_count(text) == count


@pytest.mark.parametrize("text", ["", "7X", "B7", "-1B", "0", "seven"])
def test_parse_count_rejects_bad_text(text):
    with pytest.raises(ValueError):
        memplan.parse_count(text)


def test_70b_fp16_adam_with_fp32_master_and_moments():
    p = memplan.plan(70 * 10**9, dtype="fp16", optimizer="adam", state_dtype="fp32")
    assert p["totals"]["weights"] == 140 * GB          # 70e9 x 2 bytes
    assert p["totals"]["grads"] == 140 * GB
    assert p["bytes_per_param"]["optimizer_state"] == 12  # fp32 master 4 + exp_avg 4 + exp_avg_sq 4
    assert p["totals"]["optimizer_state"] == 840 * GB
    assert p["bytes_per_param"]["total"] == 16
    assert p["totals"]["total"] == 1120 * GB


@pytest.mark.parametrize("dtype, optimizer, state_dtype, master, moments", [
    ("fp32", "adamw", "fp32", 0, 8),                # fp32 weights are their own master
    ("bf16", "adamw", "bf16", 4, 4),                # two bf16 moments
    ("bf16", "adamw", "int8", 4, 2 * (1 + 4 / 256)),  # one byte each + an fp32 scale per 256 elements
    ("bf16", "lion", "fp32", 4, 4),                 # Lion keeps one moment
    ("fp16", "lion", "int8", 4, 1 + 1 / 64),
])
def test_bytes_per_param_by_optimizer_and_state_dtype(dtype, optimizer, state_dtype, master, moments):
    per = memplan.per_param(dtype, optimizer, state_dtype)
    assert (per.master, per.moments) == (master, pytest.approx(moments))
    assert per.weights == per.grads == (4 if dtype == "fp32" else 2)


def test_7b_bf16_where_it_fits():
    # 7e9 x (2 + 2) = 28 GB of weights and grads; 7e9 x 12 = 84 GB of state
    p = memplan.plan(7 * 10**9, dtype="bf16", gpu_mem=80 * GiB, ram=64 * GiB, disk_free=1000 * GB)
    none, cpu, nvme, cpu_only, cpu_only_nvme, off_cpu, off_nvme, off_nvme_inb = p["layouts"]
    assert (none["gpu"], none["ram"], none["disk"]) == (112 * GB, 0, 0)
    assert (cpu["gpu"], cpu["ram"], cpu["disk"]) == (28 * GB, 84 * GB, 0)
    assert (nvme["gpu"], nvme["ram"], nvme["disk"]) == (28 * GB, 256 << 20, 84 * GB)
    assert none["fits"] == {"gpu": False}        # 112 GB > 80 GiB (85.9 GB)
    assert cpu["fits"] == {"gpu": True, "ram": False}  # 84 GB > 64 GiB (68.7 GB)
    assert nvme["fits"] == {"gpu": True, "ram": True, "disk": True}
    # no GPU: training on the CPU holds weights, gradients and state in RAM, or the state on disk
    assert (cpu_only["gpu"], cpu_only["ram"], cpu_only["disk"]) == (0, 112 * GB, 0)
    assert (cpu_only_nvme["gpu"], cpu_only_nvme["ram"], cpu_only_nvme["disk"]) == (0, 28 * GB + (256 << 20), 84 * GB)
    assert cpu_only["fits"] == {"ram": False} and cpu_only_nvme["fits"] == {"ram": True, "disk": True}
    # weights offloaded too: 14 GB of bf16 weights, 28 GB of fp32 gradient sums (none in backward), 84 GB of state
    assert (off_cpu["gpu"], off_cpu["ram"], off_cpu["disk"]) == (0, 126 * GB, 0)
    # RAM: the ring (256 MiB) + the state pipeline (256 MiB) + the weight store's pool (a 128 MiB batch) +
    # two gradient buffers of a batch each (none in backward, where two batches of gradients wait instead)
    assert (off_nvme["gpu"], off_nvme["ram"], off_nvme["disk"]) == (0, 896 << 20, 126 * GB)
    assert (off_nvme_inb["ram"], off_nvme_inb["disk"]) == (896 << 20, 98 * GB)
    assert off_nvme["fits"] == {"ram": True, "disk": True}


def test_offloaded_training_step_reads_weights_twice_and_moves_state_and_gradient_sums():
    p = memplan.plan(10**9, dtype="bf16", read_bytes_per_s=2e9, write_bytes_per_s=1e9)
    # read 2 x 2 GB weights + 12 GB state + 4 GB sums = 20 GB at 2 GB/s; written 2 + 12 + 4 = 18 GB at 1 GB/s
    assert p["offloaded_step_seconds"]["accumulate"] == 10 + 18
    assert p["offloaded_step_seconds"]["in_backward"] == 8 + 14


def test_unknown_capacity_is_none():
    none, cpu, nvme = memplan.plan(7 * 10**9, ram=64 * GiB)["layouts"][:3]
    assert none["fits"] == {"gpu": None} and cpu["fits"] == {"gpu": None, "ram": False}
    assert nvme["fits"] == {"gpu": None, "ram": True, "disk": None}


def test_nvme_ram_is_the_smaller_of_buffers_and_state():
    p = memplan.plan(1_000_000, dtype="bf16")   # 12 MB of state < 256 MiB of buffers
    assert p["layouts"][2]["ram"] == 12 * 10**6


def test_nvme_step_time_reads_and_writes_the_state_once():
    # 1e9 bf16 params: 12 GB of state; read at 3 GB/s (4 s) + write at 2 GB/s (6 s)
    p = memplan.plan(10**9, read_bytes_per_s=3 * GB, write_bytes_per_s=2 * GB)
    assert p["nvme_step_seconds"] == pytest.approx(10.0)
    assert memplan.plan(10**9)["nvme_step_seconds"] is None


@pytest.mark.parametrize("kwargs", [{"dtype": "fp8"}, {"optimizer": "sgd"}, {"state_dtype": "fp16"}])
def test_unknown_choices_raise_value_error(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        memplan.plan(10**9, **kwargs)


@pytest.mark.parametrize("state_dtype", ["fp32", "bf16", "int8"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_state_bytes_are_what_an_optimizer_holds(dtype, state_dtype):
    """The plan's state per parameter against the RAM a cpu-mode OffloadAdamW reports for the same parameters."""
    import torch
    import swapio
    n = 256 * 1000
    p = torch.nn.Parameter(torch.zeros(n, dtype=torch.float32 if dtype == "fp32" else torch.bfloat16))
    opt = swapio.optim.OffloadAdamW([p], state_dtype=state_dtype)
    p.grad = torch.zeros_like(p)
    opt.step()
    assert opt.memory_report()["state_bytes"] == memplan.per_param(dtype, "adamw", state_dtype).state * n
    opt.close()


def test_offloaded_training_budget_counts_the_largest_module():
    """A Llama 1024 wide with a 32000-token vocabulary: its embedding (62.5 MiB in bf16) is larger than a batch of
    64 MiB buffers, so the spare, the pool and the two gradient buffers (fp32: 125 MiB) are sized to it."""
    emb = 32000 * 1024 * 2
    p = memplan.plan(99_500_000, "bf16", buffer_bytes=64 << 20, ring_bytes=64 << 20, largest_module=emb)
    assert p["offloaded_pinned"] == {"weight_ring": 64 << 20, "weight_spare": emb, "state": 64 << 20,
                                     "weight_pool": emb, "grads": 4 * emb}
    off_nvme, off_nvme_inb = p["layouts"][-2:]
    assert off_nvme["ram"] == sum(p["offloaded_pinned"].values()) + 2 * emb  # + autograd's gradient of it
    # in backward: no gradient buffers, but two batches (32 MiB each) and one module's fp32 gradients wait
    assert off_nvme_inb["ram"] == off_nvme["ram"] - 4 * emb + 2 * (32 << 20) + 2 * emb


def test_activations_of_a_gpt_style_model_per_layer_and_where_they_sit():
    # 2048 tokens x 4 sequences x 1024 wide x 34 bytes = 285,212,672 bytes a layer; 24 layers
    a = memplan.activations(seq=2048, batch=4, hidden=1024, layers=24, staging_bytes=256 << 20)
    assert a["per_layer"] == 2048 * 4 * 1024 * 34 == 285_212_672
    assert a["total"] == 24 * 285_212_672
    assert a["offload_cpu"] == {"device": 2 * 285_212_672, "ram": a["total"], "disk": 0}
    assert a["offload_nvme"] == {"device": 2 * 285_212_672, "ram": (256 << 20) + 2 * 285_212_672,
                                 "disk": a["total"]}
    # eager attention saves scores, softmax and dropout mask: 5 bytes per head, query and key
    with_scores = memplan.activations(seq=2048, batch=4, hidden=1024, layers=24, heads=16)
    assert with_scores["per_layer"] - a["per_layer"] == 5 * 16 * 2048 * 2048 * 4
    # a model smaller than the bounds: never more than the activations themselves
    tiny = memplan.activations(seq=8, batch=1, hidden=8, layers=1)
    assert tiny["offload_nvme"]["ram"] == tiny["offload_cpu"]["device"] == tiny["total"] == 8 * 8 * 34


@pytest.mark.parametrize("bad", [dict(seq=0), dict(batch=-1), dict(hidden=1.5), dict(layers=None)])
def test_activations_reject_bad_shapes(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        memplan.activations(**{**dict(seq=8, batch=1, hidden=8, layers=1), **bad})
