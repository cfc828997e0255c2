"""DeepSpeed ZeRO-3 with offload_param + offload_optimizer on NVMe, one process on its CPU accelerator: the peer
of benchmarks/offload_training.py, run by it in a Python that has deepspeed (and libaio for its async_io op).

    python _deepspeed_zero3.py NVME_DIR LAYERS WIDTH VOCAB TOKENS STEPS

Prints one JSON line per step (forward_s, backward_s, step_s, total_s, read, written, peak_rss, loss). The model
is the same GPT-2 shape, built in RAM in bf16 and partitioned by deepspeed.initialize (deepspeed.zero.Init fails
under torch 2.13: its Tensor.__new__ patch does not match torch's dynamo polyfill); DeepSpeed's own random
init, bf16, its AdamW (DeepSpeedCPUAdam), its default aio settings but a 1 MiB block and queue depth 32, and
offload_param's buffer_size raised to the largest parameter (its default, 1e8 elements, asserts on GPT-2's wte).
"""
import json
import os
import sys
import time

from _common import io_bytes  # this directory is on sys.path when the script runs

os.environ.setdefault("DS_ACCELERATOR", "cpu")
for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29513"), ("RANK", "0"), ("WORLD_SIZE", "1"),
                   ("LOCAL_RANK", "0")):
    os.environ.setdefault(key, value)


def _peak_rss():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def main():
    nvme, layers, width, vocab, tokens, steps = sys.argv[1], *map(int, sys.argv[2:7])
    import deepspeed
    import torch
    import transformers
    transformers.logging.set_verbosity_error()
    os.makedirs(nvme, exist_ok=True)
    deepspeed.init_distributed(dist_backend="gloo")
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-5}},
           "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": nvme},
                                 "offload_optimizer": {"device": "nvme", "nvme_path": nvme}},
           "aio": {"block_size": 1 << 20, "queue_depth": 32, "thread_count": 1, "single_submit": False,
                   "overlap_events": True}}
    config = transformers.GPT2Config(n_layer=layers, n_embd=width, n_head=width // 128, vocab_size=vocab,
                                     n_positions=1024)
    torch.set_default_dtype(torch.bfloat16)  # built in bf16 at once: no fp32 copy of the model in RAM
    model = transformers.GPT2LMHeadModel(config).eval()
    torch.set_default_dtype(torch.float32)
    # its parameter swapper's buffers (default 1e8 elements) must hold the largest parameter, else "More elements
    # ... than buffer size" (DeepSpeed #3062): what a user sets after that assert
    largest = max(p.numel() for p in model.parameters())
    cfg["zero_optimization"]["offload_param"]["buffer_size"] = max(int(1e8), largest)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    del model
    ids = torch.randint(0, vocab, (1, tokens), generator=torch.Generator().manual_seed(0))
    for _ in range(steps):
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass
        r0, w0 = io_bytes()
        t0 = time.perf_counter()
        loss = engine(ids, labels=ids).loss
        t1 = time.perf_counter()
        engine.backward(loss)
        t2 = time.perf_counter()
        engine.step()
        t3 = time.perf_counter()
        r1, w1 = io_bytes()
        print(json.dumps(dict(loss=float(loss.detach()), forward_s=t1 - t0, backward_s=t2 - t1, step_s=t3 - t2,
                              total_s=t3 - t0, read=r1 - r0, written=w1 - w0, peak_rss=_peak_rss())), flush=True)


if __name__ == "__main__":
    main()
