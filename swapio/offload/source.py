"""Which checkpoint an offload_dir's weights derive from: disk_offload(checkpoint=..., offload_dir=...) trains
weights read from the checkpoint into offload_dir, and a later call with both reads offload_dir's weights first.
Given another checkpoint, it would serve the first one's weights without a word, so the index records the
checkpoint's fingerprint and disk_offload refuses a mismatch.

The fingerprint is of the weights, not of the files: every tensor's name, dtype, shape and the 4 KiB in the middle
of its bytes. A copy of the checkpoint elsewhere, or the same weights sharded otherwise, matches; a fine-tune of
the same model changes the bytes of the tensors it trained, so it does not. It costs one small read per tensor.
"""
import hashlib
import json
import os

from ..core._owned_fd import OwnedFd

SAMPLE = 4096


def fingerprint(locations):
    """A hex digest of the checkpoint's {tensor name: Location} (swapio.safetensors.open_checkpoint's)."""
    digest, files = hashlib.sha256(), {}
    try:
        for name in sorted(locations):
            loc = locations[name]
            digest.update(json.dumps([name, str(loc.dtype), list(loc.shape), loc.nbytes]).encode())
            if loc.path not in files:
                files[loc.path] = OwnedFd.open(loc.path, os.O_RDONLY | os.O_CLOEXEC)
            n = min(SAMPLE, loc.nbytes)
            digest.update(os.pread(files[loc.path].fileno(), n, loc.offset + (loc.nbytes - n) // 2))
    finally:
        for owned in files.values():
            owned.close()
    return digest.hexdigest()
