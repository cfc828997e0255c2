"""cpu_offload on the CPU holds the weights once: a Llama loaded with transformers' from_pretrained (whose tensors
are views of one mmap of the checkpoint, all alive until the last is dropped) peaked at 1.8x the resident model
when cpu_offload copied every tensor. A child process measures its peak RSS (VmHWM) from right after
from_pretrained through cpu_offload and a forward, against the weights' bytes."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

from helpers.rss_child import PRELUDE

transformers = pytest.importorskip("transformers")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MiB = 1 << 20
SLACK = 24 * MiB  # activations, allocator and import noise of one small forward

CHILD = PRELUDE + textwrap.dedent("""
    import json, sys
    import torch, transformers
    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    directory = sys.argv[1]
    ids = torch.randint(0, 2000, (1, 8), generator=torch.Generator().manual_seed(0))
    model = transformers.LlamaForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    baseline = status("VmRSS")
    reset = reset_peak()
    from swapio.offload import cpu_offload
    cpu_offload(model)
    with torch.no_grad():
        logits = model(ids).logits
    print(json.dumps({"growth": status("VmHWM") - baseline, "weights": weights, "largest": largest,
                      "reset": reset, "sum": float(logits.double().sum())}))
""")


def run_child(directory):
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-c", CHILD, str(directory)], capture_output=True, text=True,
                       timeout=240, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_cpu_offload_of_a_from_pretrained_model_holds_the_weights_once(tmp_path):
    import torch
    config = transformers.LlamaConfig(hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                                      num_attention_heads=8, num_key_value_heads=8, vocab_size=2000)
    with torch.device("meta"):  # quicker than transformers' initialisation on a busy machine
        model = transformers.LlamaForCausalLM(config).eval()
    model.to_empty(device="cpu")
    generator = torch.Generator().manual_seed(0)
    for name, t in model.state_dict().items():
        t.copy_(torch.rand(t.shape, generator=generator) * 0.1 if "inv_freq" not in name else t)
    model.model.rotary_emb.__init__(config)  # its buffers, computed again (to_empty left them uninitialised)
    model.save_pretrained(tmp_path)  # 48 MiB of fp32 weights
    ids = torch.randint(0, 2000, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = float(model(ids).logits.double().sum())
    del model
    offloaded = run_child(tmp_path)
    if not offloaded["reset"]:
        pytest.skip("this kernel cannot reset the peak RSS (/proc/self/clear_refs)")
    assert offloaded["sum"] == want
    bound = offloaded["weights"] + offloaded["largest"] + SLACK
    assert offloaded["growth"] <= bound, (offloaded["growth"] / MiB, bound / MiB)
