"""`swapio plan --shapes` / memplan.plan(shapes=...): the optimizer state counted tensor by tensor, against what
the offloaded optimizers allocate (memory_report(), the real state tensors) and what torch.optim.Adafactor keeps.
From a count alone, Adafactor's moments were counted as 0 whatever the shapes: a model of 1 x 1 convolutions
keeps two fp32 numbers an element, as much as Adam's moments."""
import json
import math

import pytest
import torch

import swapio
from swapio.tools import memplan
from helpers.cli import assert_one_line_error, run_cli

# vectors, matrices, 1 x 1 and 3 x 3 convolutions, a 3-D tensor with a last dimension of 1, tiny tensors (one
# element, fewer than an int8 block) and ones just past a block
SHAPES = [(7,), (1000,), (257,), (64, 32), (3, 2), (5, 1), (1, 5), (128, 64, 1, 1), (32, 16, 3, 3), (4, 8, 1),
          (1, 1), (2,), ()]
OPTIMIZERS = {"adamw": swapio.optim.OffloadAdamW, "adam": swapio.optim.OffloadAdam,
              "lion": swapio.optim.OffloadLion, "adafactor": swapio.optim.OffloadAdafactor}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _params(shapes, dtype):
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, dtype=DTYPES[dtype])) for s in shapes]


def _measured(optimizer, state_dtype, params, **kwargs):
    """(memory_report()'s state_bytes, bytes of the state tensors state_dict() exports) after one step."""
    with OPTIMIZERS[optimizer](params, state_dtype=state_dtype, **kwargs) as opt:
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
        report = opt.memory_report()["state_bytes"]
        exported = sum(t.nbytes for st in opt.state_dict()["state"].values() for k, t in st.items()
                       if k != "step" and isinstance(t, torch.Tensor))
    return report, exported


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("optimizer, state_dtype", [("adamw", "fp32"), ("adamw", "bf16"), ("adamw", "int8"),
                                                    ("adam", "int8"), ("lion", "fp32"), ("lion", "bf16"),
                                                    ("lion", "int8"), ("adafactor", "fp32")])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_planned_state_is_what_the_optimizer_allocates(dtype, optimizer, state_dtype, shape):
    """cpu mode holds exactly the planned state: the fp32 master (bf16 weights) and the moments as shaped."""
    params = _params([shape], dtype)
    planned = memplan.plan(shapes=[shape], dtype=dtype, optimizer=optimizer, state_dtype=state_dtype)
    report, _ = _measured(optimizer, state_dtype, params)
    assert planned["totals"]["optimizer_state"] == report
    assert planned["params"] == math.prod(shape)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_adafactor_of_a_convolutional_model(dtype):
    """A model of convolutions: the plan from its shapes is the state the optimizer allocates, the moments are the
    bytes torch.optim.Adafactor's own state takes, and they are far from the 0 the count alone assumes."""
    model = torch.nn.Sequential(torch.nn.Conv2d(64, 256, 1), torch.nn.Conv2d(256, 64, 1),
                                torch.nn.Conv2d(64, 64, 3), torch.nn.Linear(64, 10)).to(DTYPES[dtype])
    shapes = [tuple(p.shape) for p in model.parameters()]
    planned = memplan.plan(shapes=shapes, dtype=dtype, optimizer="adafactor")
    report, exported = _measured("adafactor", "fp32", list(model.parameters()))
    assert planned["totals"]["optimizer_state"] == report == exported
    reference = [torch.nn.Parameter(p.detach().float().clone()) for p in model.parameters()]
    torch_opt = torch.optim.Adafactor(reference)
    for p in reference:
        p.grad = torch.ones_like(p)
    torch_opt.step()
    torch_moments = sum(t.nbytes for st in torch_opt.state.values() for k, t in st.items() if k != "step")
    assert planned["totals"]["moments"] == torch_moments
    # 1 x 1 convolutions at 8 bytes a parameter (Adam's moments take as much), the 3 x 3 one at 2.7
    assert planned["bytes_per_param"]["moments"] > 5
    assert memplan.plan(planned["params"], dtype, "adafactor")["totals"]["moments"] == 0  # the count alone


def test_nvme_swap_file_is_the_plan_padded_to_4k_per_field():
    """nvme mode: the swap file holds the same arrays, each field of a record padded to 4 KiB (nvme_state's
    layout); Adafactor never splits a parameter, so there are at most as many records as tensors."""
    shapes = [(128, 64, 1, 1), (32, 16, 3, 3), (1000,), (64, 32)]
    params = _params(shapes, "bf16")
    planned = memplan.plan(shapes=shapes, dtype="bf16", optimizer="adafactor")["totals"]["optimizer_state"]
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        report, exported = _measured("adafactor", "fp32", params, offload="nvme", swap_dir=d)
    assert exported == planned
    fields = 3  # master, row_var, col_var (or master, variance)
    assert planned <= report < planned + len(shapes) * fields * 4096


def test_moment_bytes_by_hand():
    # adafactor: [o, i, 1, 1] keeps 2 numbers an element; [o, i, 3, 3] 3oi + 3oi; a matrix rows + cols
    assert memplan.moment_bytes([(256, 64, 1, 1)], "adafactor") == 4 * 2 * 256 * 64
    assert memplan.moment_bytes([(256, 64, 3, 3)], "adafactor") == 4 * 6 * 256 * 64
    assert memplan.moment_bytes([(4096, 1024)], "adafactor") == 4 * (4096 + 1024)
    assert memplan.moment_bytes([(10,), ()], "adafactor") == 4 * 11
    # int8: a scale per started block of 256 elements of each tensor
    assert memplan.moment_bytes([(7,), (257,)], "adamw", "int8") == 2 * (7 + 4) + 2 * (257 + 8)
    assert memplan.moment_bytes([(7,)], "lion", "bf16") == 14


@pytest.mark.parametrize("bad", [[], [(0, 3)], [(-1,)], [(2.5,)], ["4096"], [(True, 2)], [5]])
def test_bad_shapes_are_refused(bad):
    with pytest.raises(ValueError, match="shape"):
        memplan.plan(shapes=bad)


def test_params_must_agree_with_the_shapes():
    with pytest.raises(ValueError, match="element count"):
        memplan.plan(100, shapes=[(10, 11)])
    assert memplan.plan(110, shapes=[(10, 11)])["params"] == 110
    with pytest.raises(ValueError, match="params"):
        memplan.plan()


def test_cli_shapes_file_gives_the_measured_state(capsys, tmp_path):
    model = torch.nn.Sequential(torch.nn.Conv2d(32, 64, 1), torch.nn.Conv2d(64, 32, 3))
    path = tmp_path / "shapes.json"
    path.write_text(json.dumps({n: list(p.shape) for n, p in model.named_parameters()}))
    rc, out, _ = run_cli(capsys, "plan", "--shapes", str(path), "--dtype", "fp32", "--optimizer", "adafactor",
                         "--json")
    assert rc == 0
    result = json.loads(out)
    report, _ = _measured("adafactor", "fp32", list(model.parameters()))
    assert result["totals"]["optimizer_state"] == report
    assert result["tensors"] == 4 and result["params"] == sum(p.numel() for p in model.parameters())
    rc, out, _ = run_cli(capsys, "plan", "--shapes", str(path), "--optimizer", "adafactor")
    assert rc == 0 and "counted over 4 tensors' shapes" in out and "--shapes FILE" not in out


def test_cli_count_alone_says_what_adafactor_cannot_see(capsys):
    rc, out, _ = run_cli(capsys, "plan", "--params", "25M", "--optimizer", "adafactor")
    assert rc == 0 and "1 x 1 convolution" in out and "--shapes FILE" in out
    rc, out, _ = run_cli(capsys, "plan", "--params", "25M", "--optimizer", "adamw")
    assert rc == 0 and "--shapes FILE" not in out


@pytest.mark.parametrize("content, needle", [(None, "does not exist"), ("not json", "JSON"),
                                             ('{"a": [0, 3]}', "positive"), ("3", "list of shapes")])
def test_cli_bad_shapes_file_is_one_line(capsys, tmp_path, content, needle):
    path = tmp_path / "shapes.json"
    if content is not None:
        path.write_text(content)
    rc, _, err = run_cli(capsys, "plan", "--shapes", str(path))
    assert_one_line_error(rc, err, needle)
    assert rc == 2


@pytest.mark.parametrize("argv", [(), ("--params", "7B", "--shapes", "x.json")])
def test_cli_needs_one_of_params_and_shapes(capsys, argv):
    rc, _, err = run_cli(capsys, "plan", *argv)
    assert_one_line_error(rc, err, "--params", "--shapes")
