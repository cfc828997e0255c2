"""swapio.checkpoint.save/load round trips, checked against the safetensors library (it reads our files; we read
its files) and the original tensors: nested training states, every dtype, layouts, shared storage, out=."""
import json
import struct

import pytest
import safetensors.torch as st
import torch

import swapio
from helpers.checkpoint import assert_same, bytes_of, leftovers, training_state


def test_training_state_round_trips_and_safetensors_reads_the_file(tmp_path):
    state = training_state()
    path = tmp_path / "ckpt.safetensors"
    size = swapio.checkpoint.save(state, path)
    assert size == path.stat().st_size
    back = swapio.checkpoint.load(path)
    assert_same(back, state)
    assert list(back["optimizer"]["state"]) == [0, 1, 2, 3]  # int keys stay ints
    assert isinstance(back["history"][0], tuple)
    # The safetensors library reads the same file: flattened names, the same tensors.
    flat = st.load_file(str(path))
    assert torch.equal(flat["model.0.weight"], state["model"]["0.weight"])
    assert torch.equal(flat["optimizer.state.1.exp_avg_sq"], state["optimizer"]["state"][1]["exp_avg_sq"])
    assert len(flat) == 4 + 4 * 3
    # and loads it into a model as torch would
    model = torch.nn.Sequential(torch.nn.Linear(8, 24), torch.nn.Tanh(), torch.nn.Linear(24, 4))
    model.load_state_dict(back["model"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt.load_state_dict(back["optimizer"])
    assert_same(opt.state_dict()["state"], state["optimizer"]["state"])


def test_data_section_starts_aligned_and_the_header_is_padded_json(tmp_path):
    path = tmp_path / "a.safetensors"
    swapio.checkpoint.save({"w": torch.randn(1000)}, path)
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    assert (8 + n) % 4096 == 0
    header = json.loads(raw[8:8 + n])  # trailing spaces are JSON whitespace
    assert header["__metadata__"]["format"] == "swapio.checkpoint"
    assert all(isinstance(v, str) for v in header["__metadata__"].values())
    assert header["w"]["data_offsets"] == [0, 4000]
    assert len(raw) == 8 + n + 4000  # truncated to the true size after the aligned writes


@pytest.mark.parametrize("staging", [1 << 20, 3 << 20, 256 << 20])
def test_tensors_spanning_many_windows_and_few_buffers(tmp_path, staging):
    g = torch.Generator().manual_seed(3)
    state = {"big": torch.randn(900_000, generator=g),  # 3.6 MB: crosses window boundaries
             "odd": torch.randint(0, 255, (1_234_567,), dtype=torch.uint8, generator=g),
             "half": torch.randn(333_333, generator=g).half(), "small": [torch.arange(3)] * 2}
    path = tmp_path / "w.safetensors"
    swapio.checkpoint.save(state, path, staging_bytes=staging)
    assert_same(swapio.checkpoint.load(path, staging_bytes=staging), state)
    fut = swapio.checkpoint.async_save(state, tmp_path / "a.safetensors", staging_bytes=staging)
    assert fut.wait(timeout=60) == path.stat().st_size
    assert (tmp_path / "a.safetensors").read_bytes() == path.read_bytes()


STORED = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.bfloat16,
          torch.float32, torch.float64, torch.uint16, torch.uint32, torch.uint64, torch.float8_e4m3fn,
          torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz, torch.complex64]
AS_BYTES = [torch.complex128, torch.complex32, torch.float8_e8m0fnu, torch.float4_e2m1fn_x2, torch.bits8,
            torch.bits16, torch.uint4, torch.int4]


def _random(dtype, shape, seed):
    g = torch.Generator().manual_seed(seed)
    n = 1
    for s in shape:
        n *= s
    raw = torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        return (raw % 2).bool().reshape(shape)
    return raw.view(dtype).reshape(shape)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_every_dtype_round_trips_bit_exactly(tmp_path):
    state = {str(d): _random(d, (5, 7), i) for i, d in enumerate(STORED + AS_BYTES)}
    path = tmp_path / "dtypes.safetensors"
    swapio.checkpoint.save(state, path)
    back = swapio.checkpoint.load(path)
    for k, t in state.items():
        assert back[k].dtype == t.dtype and back[k].shape == t.shape, k
        assert bytes_of(back[k]) == bytes_of(t), k
    flat = st.load_file(str(path))
    for d in STORED:  # safetensors has names for these: it reads them as they were
        assert flat[str(d)].dtype == d and bytes_of(flat[str(d)]) == bytes_of(state[str(d)]), d
    for d in AS_BYTES:  # the rest: their bytes, one trailing dimension of the element size
        assert flat[str(d)].dtype == torch.uint8 and flat[str(d)].shape == (5, 7, d.itemsize), d
        assert bytes_of(flat[str(d)]) == bytes_of(state[str(d)]), d


def test_quantized_tensor_is_a_type_error_naming_the_key(tmp_path):
    q = torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.qint8)
    with pytest.raises(TypeError, match=r"\['layer'\]\['q'\].*quantized"):
        swapio.checkpoint.save({"layer": {"q": q}}, tmp_path / "q.safetensors")
    assert list(tmp_path.iterdir()) == []


def test_non_contiguous_zero_size_and_scalar_tensors(tmp_path):
    base = torch.randn(6, 10)
    state = {"t": base.t(), "slice": base[:, 2:5], "step": base[::2, ::3], "empty": torch.empty(0, 4),
             "empty3": torch.zeros(2, 0, 3, dtype=torch.int64), "scalar": torch.tensor(3.5),
             "cl": torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last)}
    path = tmp_path / "layouts.safetensors"
    swapio.checkpoint.save(state, path)
    back = swapio.checkpoint.load(path)
    assert_same(back, state)
    # dense permuted layouts come back with their strides; views with gaps come back contiguous
    assert back["t"].stride() == state["t"].stride()
    assert back["cl"].is_contiguous(memory_format=torch.channels_last)
    assert back["slice"].is_contiguous() and back["step"].is_contiguous()
    flat = st.load_file(str(path))
    assert torch.equal(flat["t"], state["t"]) and torch.equal(flat["step"], state["step"])


def test_the_same_tensor_twice_is_stored_once_and_shared_on_load(tmp_path):
    w = torch.randn(16, 4)
    state = {"embed": w, "lm_head": w, "other": w[:8], "copy": w.clone()}
    path = tmp_path / "tied.safetensors"
    swapio.checkpoint.save(state, path)
    flat = st.load_file(str(path))
    assert sorted(flat) == ["copy", "embed", "other"]  # lm_head is embed, stored once
    back = swapio.checkpoint.load(path)
    assert back["lm_head"] is back["embed"]
    assert back["other"].untyped_storage().data_ptr() != back["embed"].untyped_storage().data_ptr()
    assert_same(back, state)


def test_dict_key_types_and_names_that_collide(tmp_path):
    state = {0: torch.ones(1), "0": torch.zeros(1), "a.b": torch.full((1,), 2.0), "a": {"b": torch.full((1,), 3.0)},
             None: 1, 2.5: "x", True: [None]}
    path = tmp_path / "keys.safetensors"
    swapio.checkpoint.save(state, path)
    back = swapio.checkpoint.load(path)
    assert_same(back, state)
    assert len(st.load_file(str(path))) == 4  # four distinct names for four tensors


@pytest.mark.parametrize("value, what", [({1, 2}, "set"), (object(), "object"), (1 + 2j, "complex"),
                                         (b"bytes", "bytes")])
def test_values_json_cannot_carry_are_a_type_error_naming_the_key(tmp_path, value, what):
    state = {"model": {"w": torch.ones(2)}, "extra": {"deep": [0, value]}}
    with pytest.raises(TypeError, match=rf"\['extra'\]\['deep'\]\[1\]: a {what}"):
        swapio.checkpoint.save(state, tmp_path / "bad.safetensors")
    with pytest.raises(TypeError, match=r"dict key \(1, 2\)"):
        swapio.checkpoint.async_save({(1, 2): 3}, tmp_path / "bad.safetensors")
    assert list(tmp_path.iterdir()) == []  # refused before any file was made


def test_files_written_by_safetensors_load_as_a_dict(tmp_path):
    tensors = {"a": torch.randn(3, 5), "b.c": torch.arange(10, dtype=torch.int32), "e": torch.empty(0)}
    st.save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    for p in (tmp_path / "model.safetensors", tmp_path):
        back = swapio.checkpoint.load(p)
        assert sorted(back) == sorted(tensors)
        assert_same(dict(sorted(back.items())), dict(sorted(tensors.items())))


def test_sharded_hf_directory_loads(tmp_path):
    """A directory as save_pretrained shards it: model-0000k-of-00002.safetensors and the index's weight_map."""
    g = torch.Generator().manual_seed(5)
    shards = [{"embed.weight": torch.randn(40, 8, generator=g), "h.0.w": torch.randn(8, 8, generator=g)},
              {"h.1.w": torch.randn(8, 8, generator=g).bfloat16(), "head.b": torch.arange(4)}]
    weight_map = {}
    for k, tensors in enumerate(shards):
        name = f"model-{k + 1:05d}-of-00002.safetensors"
        st.save_file(tensors, str(tmp_path / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    back = swapio.checkpoint.load(tmp_path)
    assert sorted(back) == sorted(weight_map)
    for tensors in shards:
        for k, v in tensors.items():
            assert back[k].dtype == v.dtype and torch.equal(back[k], v), k


def test_load_into_out_fills_the_given_tensors_in_place(tmp_path):
    state = training_state(seed=1)
    path = tmp_path / "c.safetensors"
    swapio.checkpoint.save(state, path)
    target = training_state(seed=2)  # same shapes, other values
    ptrs = {k: v.data_ptr() for k, v in target["model"].items()}
    back = swapio.checkpoint.load(path, out=target)
    for k, v in target["model"].items():
        assert v.data_ptr() == ptrs[k]  # the very same memory
        assert back["model"][k] is v
        assert torch.equal(v, state["model"][k])
    assert_same(back, state)


def test_load_into_non_contiguous_out(tmp_path):
    w = torch.randn(5, 3)
    swapio.checkpoint.save({"w": w}, tmp_path / "w.safetensors")
    dest = torch.zeros(3, 5).t()
    back = swapio.checkpoint.load(tmp_path / "w.safetensors", out={"w": dest})
    assert back["w"] is dest and torch.equal(dest, w)


def test_load_into_out_made_in_inference_mode_fills_every_layout_alike(tmp_path):
    """A model built under torch.inference_mode() has inference tensors: load(out=) filled the contiguous ones,
    then raised torch's RuntimeError ("Inplace update to inference tensor outside InferenceMode") at a
    non-contiguous one, after writing it: a failed load that changed out=."""
    w, b = torch.randn(5, 3), torch.randn(7)
    swapio.checkpoint.save({"w": w, "b": b}, tmp_path / "w.safetensors")
    with torch.inference_mode():
        dest_w, dest_b = torch.zeros(3, 5).t(), torch.zeros(7)
    back = swapio.checkpoint.load(tmp_path / "w.safetensors", out={"w": dest_w, "b": dest_b})
    assert back["w"] is dest_w and torch.equal(dest_w, w) and torch.equal(dest_b, b)


@pytest.mark.parametrize("numel", [1000, 1 << 19])  # read through the staging windows / by its own request
def test_load_into_out_counts_as_an_in_place_change_for_autograd(tmp_path, numel):
    """A tensor big enough for its own O_DIRECT request was written without a bump of its version counter, so
    autograd computed a backward with the values load(out=) put there, where torch's copy_ makes it raise."""
    swapio.checkpoint.save({"x": torch.randn(numel)}, tmp_path / "x.safetensors")
    for fill in ("copy_", "load"):
        x, w = torch.randn(numel), torch.randn(numel, requires_grad=True)
        y = (w * x).sum()  # saves x for backward
        if fill == "copy_":
            with torch.no_grad():
                x.copy_(swapio.checkpoint.load(tmp_path / "x.safetensors")["x"])
        else:
            swapio.checkpoint.load(tmp_path / "x.safetensors", out={"x": x})
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            y.backward()
    with torch.inference_mode():  # inference tensors have no version counter: filled all the same
        x = torch.zeros(numel)
    swapio.checkpoint.load(tmp_path / "x.safetensors", out={"x": x})
    assert torch.equal(x, swapio.checkpoint.load(tmp_path / "x.safetensors")["x"])


def test_load_into_a_model_is_seen_by_an_offloaded_optimizer_as_load_state_dict_is(tmp_path):
    """OffloadAdamW adopts weights written outside it (its fp32 master takes them) by their version counters:
    a bf16 weight restored with load(out=model.state_dict()) kept the master's values instead, and the next step
    went on from the weights the load had replaced."""
    def run(restore):
        torch.manual_seed(0)
        model = torch.nn.Linear(1024, 512).bfloat16()  # a 1 MiB weight: its own O_DIRECT request
        x = torch.randn(4, 1024).bfloat16()
        opt = swapio.optim.OffloadAdamW(model.parameters(), lr=1e-2)

        def step():
            model(x).float().square().mean().backward()
            opt.step()
            opt.zero_grad()
        step()
        swapio.checkpoint.save({"model": model.state_dict()}, tmp_path / f"{restore}.safetensors")
        step()
        step()
        if restore == "load_state_dict":
            model.load_state_dict(swapio.checkpoint.load(tmp_path / f"{restore}.safetensors")["model"])
        else:
            swapio.checkpoint.load(tmp_path / f"{restore}.safetensors", out={"model": model.state_dict()})
        with pytest.warns(swapio.SwapioWarning, match="adopted"):
            step()
        opt.close()
        return model.state_dict()
    want, got = run("load_state_dict"), run("out")
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_out_that_does_not_match_is_refused_and_left_unchanged(tmp_path):
    swapio.checkpoint.save({"a": torch.ones(4), "b": torch.ones(2)}, tmp_path / "x.safetensors")
    a, b = torch.zeros(4), torch.zeros(3)
    with pytest.raises(ValueError, match=r"x.safetensors.*'b'.*\[2\].*\[3\]"):
        swapio.checkpoint.load(tmp_path / "x.safetensors", out={"a": a, "b": b})
    assert not a.any() and not b.any()
    with pytest.raises(ValueError, match="missing.*'b'"):
        swapio.checkpoint.load(tmp_path / "x.safetensors", out={"a": a})
    with pytest.raises(ValueError, match="float64"):
        swapio.checkpoint.load(tmp_path / "x.safetensors", out={"a": a.double(), "b": torch.zeros(2)})
    assert not a.any()


def test_saving_over_an_existing_checkpoint_replaces_it_whole(tmp_path):
    path = tmp_path / "c.safetensors"
    swapio.checkpoint.save({"x": torch.randn(1000)}, path)
    new = {"y": torch.randn(10), "z": [1, 2]}
    swapio.checkpoint.save(new, path)
    assert_same(swapio.checkpoint.load(path), new)
    assert leftovers(tmp_path) == []


def test_big_tensors_load_by_their_own_requests_staged_unless_pinned(tmp_path, monkeypatch):
    """Big CPU tensors take one request each, not the streamed windows: into ordinary memory staged through the
    handle's huge-page buffers, into swapio pinned memory straight in; out= gets the new values in place."""
    import importlib
    load_module = importlib.import_module("swapio.checkpoint.load")
    g = torch.Generator().manual_seed(9)
    first = {"a": torch.randn(600_000, generator=g), "b": torch.randn(600_000, generator=g).half()}
    swapio.checkpoint.save(first, tmp_path / "1.safetensors")
    second = {k: torch.randn(v.shape, generator=g).to(v.dtype) for k, v in first.items()}
    swapio.checkpoint.save(second, tmp_path / "2.safetensors")
    streamed, staged = [], []
    real_read_into, real_pread = load_module.read_into, swapio.AioHandle.pread
    monkeypatch.setattr(load_module, "read_into",
                        lambda pairs, *a, **k: (streamed.extend(pairs), real_read_into(pairs, *a, **k)))

    def spy(self, tensor, *a, **k):  # what "auto" resolves to (test_roundtrip checks that it does)
        staged.append(k.get("staged") == "auto" and not swapio.is_pinned(tensor))
        return real_pread(self, tensor, *a, **k)
    monkeypatch.setattr(swapio.AioHandle, "pread", spy)
    held = swapio.checkpoint.load(tmp_path / "1.safetensors")
    assert_same(held, first)
    assert staged == [True, True]  # new tensors: ordinary memory
    ptrs = {k: v.data_ptr() for k, v in held.items()}
    back = swapio.checkpoint.load(tmp_path / "2.safetensors", out=held)
    assert {k: v.data_ptr() for k, v in back.items()} == ptrs
    assert_same(back, second)
    pinned = {k: swapio.empty_pinned(v.shape, v.dtype) for k, v in first.items()}
    staged.clear()
    assert_same(swapio.checkpoint.load(tmp_path / "1.safetensors", out=pinned), first)
    assert staged == [False, False]
    assert streamed == []  # every tensor went by its own request


def test_small_tensors_between_big_ones_are_read_without_rereading_the_big_ones(tmp_path, monkeypatch):
    """A safetensors file (written by the library: sorted by name, so biases sit between weights): big tensors
    go the direct way, the small ones are streamed in runs that do not span the big ones."""
    import importlib
    load_module = importlib.import_module("swapio.checkpoint.load")
    g = torch.Generator().manual_seed(11)
    tensors = {}
    for i in range(4):
        tensors[f"l{i}.b"] = torch.randn(100, generator=g)
        tensors[f"l{i}.w"] = torch.randn(600_000, generator=g)  # 2.4 MB
    st.save_file(tensors, str(tmp_path / "m.safetensors"))
    spans = []
    real = load_module.read_into

    def recording(pairs, *a, **k):
        spans.append(pairs[-1][0].offset + pairs[-1][0].nbytes - pairs[0][0].offset)
        return real(pairs, *a, **k)

    monkeypatch.setattr(load_module, "read_into", recording)
    back = swapio.checkpoint.load(tmp_path / "m.safetensors")
    for k, v in tensors.items():
        assert torch.equal(back[k], v), k
    assert len(spans) == 4 and max(spans) == 400  # each bias alone, never a weight's bytes again


@pytest.mark.parametrize("shift", [0, 1, 7, 4095])
def test_big_tensors_written_from_their_own_memory_at_any_alignment(tmp_path, shift):
    """Big CPU tensors are written by their own requests (unaligned file offsets and addresses, edges through a
    buffered descriptor), between staged small ones: every byte lands where safetensors expects it."""
    g = torch.Generator().manual_seed(shift)
    backing = torch.randint(0, 256, (8 << 20,), dtype=torch.uint8, generator=g)
    state = {"a": backing[shift:shift + (1 << 20) + 3],            # odd size, 1-byte dtype: later offsets unaligned
             "s1": torch.randint(0, 256, (5,), dtype=torch.uint8, generator=g),
             "b": backing[2 << 20:(2 << 20) + (3 << 20) + 4097 + shift],
             "s2": torch.randint(0, 256, (4093,), dtype=torch.uint8, generator=g),
             "c": torch.randn(700_001, generator=g),               # 4-byte: first in the file
             "d": torch.randn(300_000, generator=g).bfloat16()}
    path = tmp_path / "c.safetensors"
    size = swapio.checkpoint.save(state, path, staging_bytes=2 << 20)
    assert size == path.stat().st_size
    theirs = st.load_file(str(path))
    for k, v in state.items():
        assert torch.equal(theirs[k], v), k
    assert_same(swapio.checkpoint.load(path), state)
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("n", [10, 300_000], ids=["small", "big"])
def test_save_stores_the_values_of_conj_and_neg_views_and_their_base_apart(tmp_path, n):
    """A conj() / _neg_view() tensor's memory holds other values than it has: save stores its values (sibling of
    the async_save capture bug), and it is not taken for its base tensor, which shares that memory."""
    z = torch.randn(n, dtype=torch.complex64, generator=torch.Generator().manual_seed(3))
    r = torch.randn(n, generator=torch.Generator().manual_seed(4))
    state = {"z": z, "zc": z.conj(), "r": r, "rn": torch._neg_view(r)}
    swapio.checkpoint.save(state, tmp_path / "c.safetensors")
    got = swapio.checkpoint.load(tmp_path / "c.safetensors")
    for k, v in state.items():
        assert torch.equal(got[k], v.resolve_conj().resolve_neg()), k


def test_aiohandle_refuses_a_conj_view_whose_memory_holds_other_values(tmp_path):
    with swapio.AioHandle() as h:
        with pytest.raises(ValueError, match="conjugated or negated"):
            h.pwrite(torch.randn(8, dtype=torch.complex64).conj(), tmp_path / "x.bin")
