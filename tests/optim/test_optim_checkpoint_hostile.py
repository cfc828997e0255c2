"""Hostile tests of opt.save(dir) / opt.load(dir) (format version 4, one safetensors file): forged structures
and hyperparameters must give a ValueError naming the file (never TypeError/OverflowError from inside, never a
hang) and leave the optimizer exactly as it was; what save() writes must load; cpu and nvme checkpoints mix."""
import json
import os
import shutil
import threading
import warnings

import pytest
import torch

import swapio
import swapio.optim as so
from swapio.optim import checkpoint
from helpers.optim import one_thread  # noqa: F401
from helpers.resume import assert_same, assert_trains_like_fresh, make_opt, snapshot, train

SHAPES = [(300,), (17, 33), (5,)]


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).requires_grad_(True) for s in SHAPES]


def _trained(tmp_path, mode="cpu", state_dtype="fp32"):
    params = _params()
    opt = make_opt("adamw", params, mode, tmp_path, state_dtype)
    train(opt, params, 1, 2)
    return opt, params


def _saved_and_edited(tmp_path, edit):
    """(optimizer, params, checkpoint dir): a trained optimizer's checkpoint with its skeleton edited."""
    opt, params = _trained(tmp_path)
    ckpt = tmp_path / "ckpt"
    opt.save(ckpt)
    _edit_skeleton(ckpt, edit)
    return opt, params, ckpt


def _edit_skeleton(ckpt, edit):
    """Rewrites the JSON skeleton in the header's __metadata__ (the tensors' bytes and offsets untouched)."""
    path = ckpt / checkpoint.FILE
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    skeleton = json.loads(header["__metadata__"]["structure"])
    edit(skeleton)
    header["__metadata__"]["structure"] = json.dumps(skeleton)
    text = json.dumps(header).encode()
    path.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + n:])


def _node(skeleton, *keys):
    for key in keys:
        skeleton = next(v for k, v in skeleton["D"] if k == key)
    return skeleton


def _set(node, key, value):
    for item in node["D"]:
        if item[0] == key:
            item[1] = value
            return
    node["D"].append([key, value])


def _refused_intact(opt, params, ckpt, tmp_path):
    """opt.load(ckpt) raises a ValueError naming the file, the optimizer is untouched and trains on exactly like
    an optimizer that never saw the load."""
    before = snapshot(opt, params)
    with pytest.raises(ValueError, match=checkpoint.FILE):
        opt.load(ckpt)
    assert_same(snapshot(opt, params), before)
    assert_trains_like_fresh(opt, params, 3, 3, tmp_path, params_fn=_params)


def _rename_field(key):
    def edit(skeleton):  # state.0's "exp_avg" (and its checksum) under another dict key
        for node in (_node(skeleton, "state", 0), _node(skeleton, "checksums", 0)):
            next(item for item in node["D"] if item[0] == "exp_avg")[0] = key
    return edit


SKELETON_DAMAGE = {  # (edit, whether swapio.checkpoint.load itself must refuse the file)
    # a dict key the skeleton gives as a JSON list: unflatten() builds a dict with it (TypeError: unhashable)
    "list as a state key": (lambda s: _node(s, "state")["D"][0].__setitem__(0, [0]), True),
    "list as a top-level key": (lambda s: s["D"][0].__setitem__(0, ["format"]), True),
    # a tensor node's strides not a list: _Target does tuple(node["stride"]) (TypeError)
    "stride an int": (lambda s: _node(s, "state", 0, "exp_avg").__setitem__("stride", 5), True),
    "stride null": (lambda s: _node(s, "state", 0, "exp_avg").__setitem__("stride", None), True),
    # a field named by a non-string key (the skeleton allows int/float/bool/None keys): StateFormat.is_scale
    # calls name.endswith (AttributeError) before any check of the names
    "an int field name": (_rename_field(7), False),
    "a null field name": (_rename_field(None), False),
}


@pytest.mark.parametrize("damage", sorted(SKELETON_DAMAGE))
def test_malformed_skeleton_is_a_value_error_naming_the_file(damage, tmp_path):
    edit, reader_refuses = SKELETON_DAMAGE[damage]
    opt, params, ckpt = _saved_and_edited(tmp_path, edit)
    if reader_refuses:
        with pytest.raises(ValueError, match=checkpoint.FILE):  # the library's reader, as used on its own
            swapio.checkpoint.load(ckpt / checkpoint.FILE)
    _refused_intact(opt, params, ckpt, tmp_path)
    opt.close()


def test_a_non_string_field_name_in_version_3_metadata_is_a_value_error(tmp_path):
    # validate.checkpoint_meta slices name[:-len("_scale")] for int8 state: TypeError on an int name
    data = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "optim-v3", "int8-state")
    ckpt = tmp_path / "ckpt"
    shutil.copytree(data, ckpt)
    meta = torch.load(ckpt / checkpoint.LEGACY_META, weights_only=True)
    entry = meta["state"][0]
    entry["fields"] = {7: entry["fields"].pop("exp_avg"), **entry["fields"]}
    entry["checksums"] = {7: entry["checksums"].pop("exp_avg"), **entry["checksums"]}
    torch.save(meta, ckpt / checkpoint.LEGACY_META)
    params = [torch.randn(s).requires_grad_(True) for s in [(300,), (17, 33), (513,)]]
    opt = make_opt("adamw", params, "cpu", tmp_path, "int8")
    train(opt, params, 1, 1)
    before = snapshot(opt, params)
    with pytest.raises(ValueError, match=checkpoint.LEGACY_META):
        opt.load(ckpt)
    assert_same(snapshot(opt, params), before)
    opt.close()


def test_an_optimizer_with_a_tensor_lr_saves_a_checkpoint_that_loads(tmp_path):
    # the constructor and step() take lr=torch.tensor(...) (as torch does) and state_dict() round-trips it, but
    # save() stores the lr as a tensor and load() then refuses its own file ("a tensor where a plain value
    # belongs"): found only when resuming. Either save() refuses up front or load() takes the file back.
    params = _params()
    opt = swapio.optim.OffloadAdamW(params, lr=torch.tensor(0.01))
    train(opt, params, 1, 2)
    opt.load_state_dict(opt.state_dict())
    try:
        opt.save(tmp_path / "ckpt")
    except (ValueError, TypeError):
        return
    other_params = [p.detach().clone().requires_grad_(True) for p in params]
    other = swapio.optim.OffloadAdamW(other_params, lr=1e-3)
    other.load(tmp_path / "ckpt")
    train(opt, params, 3, 3)
    train(other, other_params, 3, 3)
    assert_same({**snapshot(other, other_params), "groups": []}, {**snapshot(opt, params), "groups": []})
    assert float(other.param_groups[0]["lr"]) == float(opt.param_groups[0]["lr"])


HYPER_DAMAGE = {
    "lr a string": ("lr", {"V": "0.1"}),        # TypeError today
    "lr null": ("lr", {"V": None}),             # TypeError today
    "lr a bool": ("lr", {"V": True}),           # TypeError today
    "lr a huge int": ("lr", {"V": 10 ** 400}),  # OverflowError today
    "eps a string": ("eps", {"V": "x"}),        # TypeError today
    "betas strings": ("betas", {"V": "ab"}),    # TypeError today
    "lr negative": ("lr", {"V": -1.0}),         # ValueError, but not naming the file
}


@pytest.mark.parametrize("key", ["lr", "betas", "eps", "weight_decay"])
def test_a_group_that_lost_a_hyperparameter_is_refused_not_filled_from_the_constructor(key, tmp_path):
    """A damaged key name ("lr" read as "lt") must not let the constructor's lr replace the saved one, silently."""
    def edit(skeleton):
        group = _node(skeleton, "param_groups")["L"][0]
        next(item for item in group["D"] if item[0] == key)[0] = key[:-1] + "_"
    opt, params, ckpt = _saved_and_edited(tmp_path, edit)
    _refused_intact(opt, params, ckpt, tmp_path)
    opt.close()


@pytest.mark.parametrize("damage", sorted(HYPER_DAMAGE))
def test_forged_hyperparameters_are_a_value_error_naming_the_file(damage, tmp_path):
    key, value = HYPER_DAMAGE[damage]
    opt, params, ckpt = _saved_and_edited(tmp_path, lambda s: _set(_node(s, "param_groups")["L"][0], key, value))
    _refused_intact(opt, params, ckpt, tmp_path)
    opt.close()


def test_a_fifo_as_version_3_metadata_does_not_hang_the_load(tmp_path):
    opt, params = _trained(tmp_path)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    fifo = ckpt / checkpoint.LEGACY_META
    os.mkfifo(fifo)
    before = snapshot(opt, params)
    outcome = []

    def load():
        try:
            opt.load(ckpt)
            outcome.append(None)
        except Exception as exc:  # noqa: BLE001 - inspected below
            outcome.append(exc)

    worker = threading.Thread(target=load, daemon=True)
    worker.start()
    worker.join(5)
    hung = worker.is_alive()
    if hung:  # unblock the reader (a writer that closes at once: it reads EOF) so the thread ends
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        os.close(fd)
        worker.join(10)
    assert not hung, "opt.load() blocked on a FIFO named swapio-optim.pt"
    assert isinstance(outcome[0], (ValueError, OSError)), outcome
    assert_same(snapshot(opt, params), before)
    opt.close()


@pytest.mark.parametrize("mode", ["cpu", "nvme"])
@pytest.mark.parametrize("how", ["constructor", "add_param_group"])
def test_a_group_listing_a_parameter_twice_is_refused(mode, how, tmp_path):
    """torch steps such a parameter once per listing (with a deprecation warning). The backends keep one state per
    parameter: stepping it twice gave other values in each mode, and its neighbour's (listed once) changed too,
    silently. A ValueError naming the positions, the optimizer as it was."""
    params = _params()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if how == "constructor":
            with pytest.raises(ValueError, match=r"more than once \(at positions \[2\]\)"):
                make_opt("adamw", [{"params": [params[0], params[1], params[0]]}], mode, tmp_path)
            return
        opt = make_opt("adamw", [params[1]], mode, tmp_path)
        with pytest.raises(ValueError, match=r"more than once \(at positions \[1\]\)"):
            opt.add_param_group({"params": [params[0], params[0]]})
    assert len(opt.param_groups) == 1
    train(opt, [params[1]], 1, 2)
    opt.close()


@pytest.mark.parametrize("state_dtype", ["fp32", "int8"])
def test_a_cpu_checkpoint_with_an_empty_parameter_resumes_identically_in_nvme_mode(state_dtype, tmp_path):
    # nvme mode never steps a zero-size parameter (no segments: its count stays where it was), cpu mode and
    # torch do: a cpu checkpoint resumed in nvme mode then drifts from the cpu run.
    def make(mode):
        params = [torch.zeros(0, requires_grad=True), torch.ones(4, requires_grad=True)]
        extra = {"swap_dir": tmp_path} if mode == "nvme" else {}
        return swapio.optim.OffloadAdamW(params, offload=mode, lr=1e-2, state_dtype=state_dtype, **extra), params

    def step(opt, params):
        for p in params:
            p.grad = torch.full_like(p, 0.5)
        opt.step()

    cpu, cpu_params = make("cpu")
    step(cpu, cpu_params)
    cpu.save(tmp_path / "ckpt")
    nvme, nvme_params = make("nvme")
    with torch.no_grad():
        for a, b in zip(cpu_params, nvme_params):
            b.copy_(a)
    nvme.load(tmp_path / "ckpt")
    step(cpu, cpu_params)
    step(nvme, nvme_params)
    assert_same(snapshot(nvme, nvme_params), snapshot(cpu, cpu_params))
    nvme.close()


def test_a_tampered_int8_array_is_caught_when_loading_into_fp32_state(tmp_path):
    # (holds) the other-format path (decode int8, store fp32) verifies the checksums of what it read
    opt8, params8 = _trained(tmp_path, "cpu", "int8")
    ckpt = tmp_path / "ckpt"
    opt8.save(ckpt)
    path = ckpt / checkpoint.FILE
    raw = bytearray(path.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    begin, end = json.loads(raw[8:8 + n])["state.0.exp_avg"]["data_offsets"]
    raw[8 + n + (begin + end) // 2] ^= 0x55
    path.write_bytes(bytes(raw))
    opt, params = _trained(tmp_path)
    with pytest.raises(ValueError, match="checksum mismatch in 'exp_avg' of parameter 0"):
        opt.load(ckpt)
    _refused_intact(opt, params, ckpt, tmp_path)
    opt.close()
    opt8.close()


def test_a_file_system_without_flock_on_directories_saves_and_loads_unlocked(tmp_path, monkeypatch):
    """Lustre mounted with noflock answers flock with ENOSYS: opt.save raised it, so no optimizer checkpoint could
    be saved there; it now runs unlocked, as on the other file systems without flock."""
    import errno
    import fcntl
    import stat
    opt, params = _trained(tmp_path)
    before = snapshot(opt, params)
    real = fcntl.flock

    def no_flock(fd, operation):  # on directories only (the temporary file's lock is another matter)
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(errno.ENOSYS, os.strerror(errno.ENOSYS))
        return real(fd, operation)
    monkeypatch.setattr(fcntl, "flock", no_flock)
    opt.save(tmp_path / "ckpt")
    other = make_opt("adamw", params, "cpu", tmp_path)
    other.load(tmp_path / "ckpt")
    assert_same(snapshot(other, params), before)


@pytest.mark.parametrize("given", ["the checkpoint's file", "another file"])
def test_save_and_load_given_a_file_say_they_take_the_directory(given, tmp_path):
    """opt.load("ckpt/swapio-optim.safetensors") said "no swapio optimizer checkpoint directory" of a file that is
    there, and opt.save() onto a file failed in makedirs with a bare "File exists"."""
    p = torch.ones(8, requires_grad=True)
    opt = so.OffloadAdamW([p])
    p.grad = torch.ones(8)
    opt.step()
    opt.save(tmp_path / "ckpt")
    path = tmp_path / "ckpt" / "swapio-optim.safetensors"
    if given == "another file":
        path = tmp_path / "notes.txt"
        path.write_text("x")
    before = path.read_bytes()
    for call in (opt.save, opt.load):
        with pytest.raises(NotADirectoryError, match=r"takes a checkpoint directory.*this path is a file"):
            call(path)
    assert path.read_bytes() == before
    opt.load(tmp_path / "ckpt")  # the directory still loads
    opt.close()
