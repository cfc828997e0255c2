"""torch._dynamo imported for the first time inside a `with` block of offload_activations (a first meta-device op
imports it, and so does the first torch.compile called in a forward). swapio then wraps the hooks' methods in
torch.compiler.disable, and the block's end, reading them again, no longer found its hooks on top: it raised
"ended while saved-tensor hooks pushed inside it" and left them pushed. A fresh interpreter: dynamo is in the test
process already."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

CHILD = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, {tests!r})
    import torch
    from helpers.activations import assert_same_grads, batch, grads_of, hooks_installed, make_stack, swap_files
    from swapio.offload import offload_activations

    class ImportsDynamo(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks, self.trigger = make_stack(depth=2).blocks, False

        def forward(self, x):
            x = self.blocks[0](x)
            if self.trigger:
                {trigger}
            return self.blocks[1](x)

    model, x = ImportsDynamo(), batch()
    want = grads_of(model, x)
    before, model.trigger = "torch._dynamo" in sys.modules, True
    act = offload_activations(to="nvme", swap_dir={swap!r}, model=model, min_bytes=0, staging_bytes=0)
    failed = None
    try:
        got = grads_of(model, x, act)
        assert_same_grads(got, want)
    except RuntimeError as exc:
        failed = str(exc)
    left = dict(hooks=hooks_installed(), files=swap_files(act.directory), sessions=act.stats()["live_sessions"])
    assert_same_grads(grads_of(model, x, act), want)  # and the next step
    print(json.dumps(dict(before=before, after="torch._dynamo" in sys.modules, failed=failed, **left)))
""")


@pytest.mark.slow  # (a child process)
@pytest.mark.parametrize("trigger", ["import torch._dynamo", "torch.ones(2, device='meta', requires_grad=True) * 2"],
                         ids=["import", "meta-op"])
def test_dynamo_imported_inside_the_block_leaves_no_hooks_and_raises_nothing(tmp_path, trigger):
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    repo = os.path.dirname(tests)
    code = CHILD.format(tests=tests, swap=str(tmp_path), trigger=trigger)
    out = subprocess.run([sys.executable, "-c", code], cwd=repo, env={**os.environ, "PYTHONPATH": repo},
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    if trigger.startswith("torch.ones"):  # (what imports dynamo may change from one torch to the next)
        assert got["after"], "a meta-device op no longer imports torch._dynamo in this torch: the case is gone"
    assert got["before"] is False and got["after"] is True
    assert got["failed"] is None
    assert got["hooks"] is False and got["files"] == [] and got["sessions"] == 0
