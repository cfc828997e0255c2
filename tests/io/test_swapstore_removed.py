"""swap_in of a SwappedTensor after store.remove() is a ValueError saying it was removed, as after close(); it was
an OSError about the file (ENOENT, or ESTALE once the name was reused by another tensor)."""
import pytest
import torch

import swapio
from conftest import TIMEOUT


@pytest.mark.parametrize("reuse_name", [False, True])
def test_swap_in_after_remove_is_a_value_error(tmp_path, reuse_name):
    with swapio.SwapStore(tmp_path / "swap") as store:
        swapped = store.swap_out(torch.arange(16.0), name="w", release=False).wait(TIMEOUT)
        store.remove(swapped)
        if reuse_name:
            store.swap_out(torch.ones(3), name="w").wait(TIMEOUT)
        with pytest.raises(ValueError, match="removed"):
            swapped.swap_in()
        if reuse_name:  # the new tensor of that name is untouched
            assert torch.equal(store["w"].swap_in().wait(TIMEOUT), torch.ones(3))
