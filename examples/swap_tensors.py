"""The swap API: move tensors to files and back, asynchronously, with swapio.SwapStore and swapio.AioHandle.

    python examples/swap_tensors.py [--dir DIR]    # DIR: where the swap files go (default: a temporary directory)

Prints what it did and "ok" at the end; any mismatch raises.
"""
import argparse
import os
import tempfile

import torch

import swapio


def swap_store(directory):
    """SwapStore: swap_out writes a tensor to <dir>/<name>.swap and (release=True) frees its memory once the
    write is done; swap_in reads it back into the same tensor object."""
    weights = {f"layer{i}": torch.randn(256, 256) for i in range(4)}
    expected = {name: t.clone() for name, t in weights.items()}
    with swapio.SwapStore(os.path.join(directory, "store")) as store:
        swapped = [store.swap_out(t, name=name) for name, t in weights.items()]  # all four writes in flight
        for s in swapped:
            s.wait()  # the write is on disk; the tensor's storage is released now
        assert not any(s.is_resident for s in swapped)
        print(f"swapped out {len(swapped)} tensors, {sum(s.nbytes for s in swapped) >> 10} KiB, memory released")
        futures = [s.swap_in() for s in swapped]  # reads in flight together
        for name, f in zip(weights, futures):
            back = f.wait()
            assert back is weights[name] and torch.equal(back, expected[name])
        print("swapped them back in: the same tensor objects, the same bytes")
    # leaving the `with` closed the store and removed its files


def aio_handle(directory):
    """AioHandle: pwrite/pread of a tensor's bytes at an offset of a file; each call returns a Future."""
    path = os.path.join(directory, "raw.bin")
    data = swapio.empty_pinned(1 << 20, dtype=torch.uint8)  # page-aligned, page-locked: no bounce buffer
    data.copy_(torch.randint(0, 256, (1 << 20,), dtype=torch.uint8))
    with swapio.AioHandle(block_size=256 << 10, queue_depth=8) as handle:
        written = handle.pwrite(data, path).wait()
        back = torch.empty_like(data)
        read = handle.pread(back, path).wait()
    assert written == read == data.numel() and torch.equal(back, data)
    print(f"AioHandle: wrote and read {written >> 10} KiB with engine {swapio.info()['auto_engine']!r}")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", help="directory for the swap files (default: a temporary directory)")
    args = p.parse_args()
    if args.dir:
        os.makedirs(args.dir, exist_ok=True)  # a new directory is made, as swapio's swap_dir is
    with tempfile.TemporaryDirectory(dir=args.dir) as directory:
        swap_store(directory)
        aio_handle(directory)
    print("ok")


if __name__ == "__main__":
    main()
