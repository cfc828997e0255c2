"""Tensors that are copies of state kept elsewhere, marked by their maker: an offloaded optimizer's state_dict() in
nvme mode or with bf16/int8 state decodes its state into new tensors. load(path, out=...) fills tensors in place,
which restores a torch optimizer from its state_dict() (whose tensors are its state) but would reach only such a
copy, so load refuses one (ValueError, before anything is read), with its maker's word on what to do instead.

Held by id with a weak reference (a tensor's == is element-wise, so tensors cannot be keys of a WeakKeyDictionary);
an entry goes with its tensor."""
import weakref

import torch

_marked: dict[int, tuple["weakref.ref[torch.Tensor]", str]] = {}  # id(tensor) -> (weak reference to it, what to say)


def mark(tensor, message):
    """Marks `tensor` as a copy; `message` says what it copies and what to do instead of loading into it."""
    key = id(tensor)
    _marked[key] = (weakref.ref(tensor, lambda _, key=key: _marked.pop(key, None)), message)


def message_of(tensor):
    """What mark() said of `tensor`, or None for a tensor not marked."""
    entry = _marked.get(id(tensor))
    return entry[1] if entry is not None and entry[0]() is tensor else None
