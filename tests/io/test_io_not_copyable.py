"""Handles, stores, swapped tensors and futures refuse copy, deepcopy and pickle with a TypeError: a copy would
share native requests, threads and swap files it does not own (a dropped shallow copy of a SwapStore closed the
original's files)."""
import copy
import pickle

import pytest
import torch

import swapio


@pytest.fixture
def objects(tmp_path):
    with swapio.SwapStore(tmp_path / "swap") as store:
        swapped = store.swap_out(torch.arange(8.0), name="w", release=False)
        swapped.wait()
        future = store.handle.pwrite(torch.arange(4.0), str(tmp_path / "f.bin"))
        future.wait()
        yield {"store": store, "handle": store.handle, "swapped": swapped, "future": future}


@pytest.mark.parametrize("kind", ["store", "handle", "swapped", "future"])
@pytest.mark.parametrize("how", [copy.copy, copy.deepcopy, pickle.dumps], ids=["copy", "deepcopy", "pickle"])
def test_refused_with_a_type_error_naming_the_object(objects, kind, how):
    with pytest.raises(TypeError, match="cannot be copied or pickled"):
        how(objects[kind])


def test_a_refused_store_copy_leaves_the_store_working(objects):
    """Reference: the bytes swapped out. A dropped shallow copy used to close the store it was copied from."""
    store = objects["store"]
    with pytest.raises(TypeError):
        copy.copy(store)
    assert torch.equal(store["w"].swap_in().wait(), torch.arange(8.0))
