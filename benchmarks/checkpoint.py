"""swapio.checkpoint against torch.save, safetensors and torch.distributed.checkpoint (DCP), and the disk's own
O_DIRECT limit, on one training state: bf16 weights plus fp32 moments.

    python benchmarks/checkpoint.py [--size 2G] [--dir .] [--rounds 3] [--staging 256M]

--size is the state's total bytes: 4/5 bf16 weights (tensors of 8..64 MiB, a model's shapes), 1/5 fp32 moments.
Interleaved rounds (the order of the methods rotates each round), page cache dropped (root) before every
measurement, medians. Per round:
  save      swapio.checkpoint.save | torch.save + fsync | safetensors.torch.save_file + fsync | dcp.save |
            raw: the same byte count written with O_DIRECT from one pinned buffer through AioHandle to a new
            file, as every save writes one (the limit); raw overwrite: the same into the existing file's blocks
            (printed for reference: on some disks, ext4 on virtio here, writing new blocks is much slower).
            Each method's previous file is removed before its timing starts (ext4 takes 0.2-0.3 s per GB to free
            the blocks; swapio.save frees the file it replaces off its own path, so it is not charged either)
  load      swapio.checkpoint.load | load(out=) into preallocated tensors | torch.load(weights_only) |
            safetensors.torch.load_file | dcp.load (into preallocated tensors) | raw O_DIRECT read (into the
            pinned buffer, the limit to reach) | raw O_DIRECT read into new memory (each tensor's bytes into a new
            allocation, as a load that returns new tensors must; on a VM that hands freed memory back to its
            host (virtio-balloon free page reporting), new memory costs the host page faults this line includes);
            every load is followed by touching one byte per page of every tensor (an mmap-backed tensor is read
            from disk only when touched)
  async     swapio.checkpoint.async_save and dcp.async_save: time until the call returns (the training stall)
            and until the checkpoint is on disk
Peak RSS growth during each save: RSS sampled every 2 ms on a helper thread, from just before the call; the
largest over the rounds is printed (swapio keeps its staging for the next save: only the first grows).
swapio's async_save stall is printed per round: the first call allocates its capture memory, later ones reuse it.
Goals: save >= 0.85x raw write and never slower than a peer; load >= 0.85x raw read; async stall
<= 0.25x the synchronous save; swapio's peak RSS growth during save <= staging + 64 MiB.
"""
import argparse
import os
import shutil
import tempfile
import time
import warnings

import _common  # noqa: F401  (first: the checkout's swapio)
import torch

import swapio
import swapio.checkpoint as ckpt
from swapio.safetensors.buffers import new_handle
from swapio.tools.report import parse_size

MiB = 1 << 20


def make_state(total):
    """{"model": bf16 weights, "optimizer": {"state": {i: {"exp_avg": fp32}}}, "step"} of about total bytes."""
    g = torch.Generator().manual_seed(0)
    weights, moments, wbytes, i = {}, {}, 0, 0
    sizes = [64 * MiB, 16 * MiB, 32 * MiB, 8 * MiB]
    while wbytes < total * 4 // 5:
        n = min(sizes[i % 4], total * 4 // 5 - wbytes) // 2
        weights[f"layers.{i}.weight"] = torch.randn(max(n // 1024, 1), 1024, generator=g).bfloat16()
        wbytes += weights[f"layers.{i}.weight"].nbytes
        i += 1
    mbytes, j = 0, 0
    while mbytes < total - wbytes:
        n = min(16 * MiB, total - wbytes - mbytes) // 4
        moments[j] = {"exp_avg": torch.randn(max(n, 1), generator=g)}
        mbytes += moments[j]["exp_avg"].nbytes
        j += 1
    return {"model": weights, "optimizer": {"state": moments, "param_groups": [{"lr": 1e-4}]}, "step": 1000}


def tensors_of(state):
    out = {}
    for k, v in state["model"].items():
        out[f"model.{k}"] = v
    for j, st in state["optimizer"]["state"].items():
        out[f"optimizer.state.{j}.exp_avg"] = st["exp_avg"]
    return out


def timed(fn):
    """(seconds, peak RSS growth, result) of fn()."""
    return _common.timed_with_peak_rss(fn)


def fsync_file(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def touch(tensors):
    """One byte per page of every tensor: forces mmap-backed tensors to be read."""
    s = 0
    for t in tensors:
        if t.numel():
            s += int(t.reshape(-1).view(torch.uint8)[::4096].sum())
    return s


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="2G", help="state bytes (K/M/G binary suffixes; default 2G, keep <= 3G)")
    ap.add_argument("--dir", default=".", help="directory for the checkpoints (on the disk to measure)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--staging", default="256M", help="swapio's staging budget (default 256M)")
    ap.add_argument("--no-peers", action="store_true",
                    help="swapio and the raw O_DIRECT limit only (no torch, safetensors or DCP): a quicker check")
    args = ap.parse_args()
    total, staging = parse_size(args.size), parse_size(args.staging)
    warnings.filterwarnings("ignore")
    import safetensors.torch as st
    import torch.distributed.checkpoint as dcp

    state = make_state(total)
    flat = tensors_of(state)
    nbytes = sum(t.nbytes for t in flat.values())
    work = tempfile.mkdtemp(prefix="swapio-ckpt-bench-", dir=args.dir)
    paths = {"swapio": os.path.join(work, "swapio.safetensors"), "torch": os.path.join(work, "torch.pt"),
             "safetensors": os.path.join(work, "st.safetensors"), "dcp": os.path.join(work, "dcp"),
             "raw": os.path.join(work, "raw.bin"), "async": os.path.join(work, "async.safetensors"),
             "dcp-async": os.path.join(work, "dcp-async")}
    handle = new_handle()  # the same handle settings as swapio.checkpoint uses
    chunk = min(512 * MiB, nbytes)
    pinned = swapio.empty_pinned(chunk, torch.uint8)
    pinned.fill_(1)

    def raw_write():
        offs = range(0, nbytes, chunk)
        for o in offs:
            handle.pwrite(pinned[:min(chunk, nbytes - o)], paths["raw"], o)
        handle.wait()
        fsync_file(paths["raw"])

    def raw_read():
        for o in range(0, nbytes, chunk):
            handle.pread(pinned[:min(chunk, nbytes - o)], paths["raw"], o)
        handle.wait()

    def raw_read_new_memory():
        """The same bytes, each tensor's into new memory at an address congruent to its offset (no copy), as a
        load that returns new tensors must: the limit for load() where new memory costs more than reused."""
        got, offset = [], 0
        for t in flat.values():
            backing = torch.empty(t.nbytes + 4096, dtype=torch.uint8)
            shift = (offset - backing.data_ptr()) % 4096
            got.append(backing)
            handle.pread(backing[shift:shift + t.nbytes], paths["raw"], offset)
            offset += t.nbytes
        handle.wait()
        return got

    def torch_save():
        with open(paths["torch"], "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())

    def st_save():
        st.save_file({k: v.contiguous() for k, v in flat.items()}, paths["safetensors"])
        fsync_file(paths["safetensors"])

    def dcp_save():
        dcp.save({"state": flat}, checkpoint_id=paths["dcp"])

    def removed(key, fn):
        """fn, to be timed after the previous file at paths[key] is gone (freeing its blocks takes ext4 0.2-0.3 s
        per GB: not part of the write; swapio.save frees the checkpoint it replaces off its own path)."""
        return (lambda: (shutil.rmtree if os.path.isdir(paths[key]) else os.remove)(paths[key])
                if os.path.exists(paths[key]) else None), fn

    saves = {"swapio.save": lambda: ckpt.save(state, paths["swapio"], staging_bytes=staging),
             "torch.save+fsync": removed("torch", torch_save), "safetensors+fsync": removed("safetensors", st_save),
             "dcp.save": removed("dcp", dcp_save), "raw O_DIRECT write": removed("raw", raw_write),
             "raw O_DIRECT overwrite": (lambda: None if os.path.exists(paths["raw"]) else raw_write(), raw_write)}
    # out= and dcp.load fill tensors that exist and have been written, as a model's state dict has: the first load
    # into never-touched memory would otherwise pay its page faults (see raw O_DIRECT read, new memory)
    dests = {k: torch.zeros_like(v) for k, v in flat.items()}
    out_state = {"model": {k: dests[f"model.{k}"] for k in state["model"]},
                 "optimizer": {"state": {j: {"exp_avg": dests[f"optimizer.state.{j}.exp_avg"]}
                                         for j in state["optimizer"]["state"]}, "param_groups": [{"lr": 0.0}]},
                 "step": 0}

    def dcp_load():
        dcp.load({"state": dests}, checkpoint_id=paths["dcp"])
        return list(dests.values())

    loads = {"swapio.load": lambda: touch(tensors_of(ckpt.load(paths["swapio"])).values()),
             "swapio.load(out=)": lambda: touch(tensors_of(ckpt.load(paths["swapio"], out=out_state)).values()),
             "torch.load": lambda: touch(tensors_of(torch.load(paths["torch"], weights_only=True)).values()),
             "safetensors.load_file": lambda: touch(st.load_file(paths["safetensors"]).values()),
             "dcp.load": lambda: touch(dcp_load()),
             "raw O_DIRECT read": raw_read, "raw O_DIRECT read, new memory": lambda: touch(raw_read_new_memory())}
    if args.no_peers:
        saves = {k: v for k, v in saves.items() if k.startswith(("swapio", "raw"))}
        loads = {k: v for k, v in loads.items() if k.startswith(("swapio", "raw"))}
    results, failed = {}, {}

    def record(name, fn):
        if name in failed:
            return
        prepare, fn = fn if isinstance(fn, tuple) else (None, fn)
        if prepare is not None:
            prepare()
        _common.drop_caches()
        try:
            sec, rss, _ = timed(fn)
        except Exception as exc:  # noqa: BLE001 - a peer that fails here is reported, not fatal
            failed[name] = f"{type(exc).__name__}: {exc}"[:200]
            return
        results.setdefault(name, []).append((sec, rss))

    def async_runs():
        for name, call in (("swapio.async_save", lambda: ckpt.async_save(state, paths["async"],
                                                                           staging_bytes=staging)),
                           ("dcp.async_save", lambda: dcp.async_save({"state": flat},
                                                                     checkpoint_id=paths["dcp-async"]))):
            if name in failed or (args.no_peers and not name.startswith("swapio")):
                continue
            shutil.rmtree(paths["dcp-async"], ignore_errors=True)  # (outside the timing, as for the saves)
            _common.drop_caches()
            try:
                start = time.perf_counter()
                fut = call()
                stall = time.perf_counter() - start
                fut.result()
                results.setdefault(name, []).append((stall, time.perf_counter() - start))
            except Exception as exc:  # noqa: BLE001
                failed[name] = f"{type(exc).__name__}: {exc}"[:200]

    try:
        for r in range(args.rounds):
            items = list(saves.items())
            k = r % len(items)
            for name, fn in items[k:] + items[:k]:
                record(name, fn)
            items = list(loads.items())
            k = r % len(items)
            for name, fn in items[k:] + items[:k]:
                record(name, fn)
            async_runs()
    finally:
        handle.close()
        shutil.rmtree(work, ignore_errors=True)

    med = {name: _common.median([s for s, _ in runs]) for name, runs in results.items()}
    rss = {name: max(m for _, m in runs) for name, runs in results.items()}  # the worst round
    gb = nbytes / 1e9
    print(f"state: {len(flat)} tensors, {nbytes / 2**30:.2f} GiB ({gb:.2f} GB; bf16 weights + fp32 moments); "
          f"staging {staging // MiB} MiB; {args.rounds} interleaved rounds, medians; page cache "
          f"{'dropped' if _common.drop_caches() else 'NOT dropped (not root)'} before each")
    rows = []
    for name in list(saves) + list(loads):
        if name in med:
            extra = f"{rss[name] / MiB:.0f}" if name in saves else ""
            rows.append((name, f"{med[name]:.2f}", f"{gb / med[name]:.2f}", extra))
    _common.print_table(("", "seconds", "GB/s", "peak RSS growth MiB (max)"), rows)
    for name in ("swapio.async_save", "dcp.async_save"):
        if name in results:
            stall = _common.median([s for s, _ in results[name]])
            whole = _common.median([t for _, t in results[name]])
            print(f"{name}: returns after {stall:.2f} s (the stall), on disk after {whole:.2f} s; stall per round "
                  f"{[round(s, 2) for s, _ in results[name]]}")
    for name, why in failed.items():
        print(f"{name} FAILED: {why}")

    def ratio(a, b):
        return f"{med[b] / med[a]:.2f}x" if a in med and b in med else "n/a"

    print("ratios (speed of swapio / speed of the other):")
    for other in ("raw O_DIRECT write", "raw O_DIRECT overwrite", "torch.save+fsync", "safetensors+fsync",
                  "dcp.save"):
        print(f"  save vs {other}: {ratio('swapio.save', other)}")
    for other in ("raw O_DIRECT read", "raw O_DIRECT read, new memory", "torch.load", "safetensors.load_file",
                  "dcp.load"):
        print(f"  load vs {other}: {ratio('swapio.load', other)}   load(out=) vs {other}: "
              f"{ratio('swapio.load(out=)', other)}")
    if "swapio.async_save" in results and "swapio.save" in med:
        stall = _common.median([s for s, _ in results["swapio.async_save"]])
        print(f"  async_save stall / save: {stall / med['swapio.save']:.3f}")
        if "dcp.async_save" in results:
            dstall = _common.median([s for s, _ in results["dcp.async_save"]])
            print(f"  async_save stall / dcp.async_save stall: {stall / dstall:.2f}")
    if "swapio.save" in rss:
        print(f"  swapio.save peak RSS growth {rss['swapio.save'] / MiB:.0f} MiB (goal <= staging + 64 = "
              f"{staging // MiB + 64} MiB)")
        assert rss["swapio.save"] <= staging + 64 * MiB, "swapio.save grew RSS beyond staging + 64 MiB"


if __name__ == "__main__":
    main()
