"""Offloaded weights without optimizer state in a state dict or checkpoint. Loading rewrites each offloaded weight
with state from its fp32 master; one without state (frozen by a schedule until later, an expert no batch reached)
has no master to rewrite it from. So the export records a checksum of its value, and a load refuses where its
offload storage holds another value now (trained after the export: the run would resume with it as a later step
left it). A weight's checksum is read and computed again only after its record was rewritten, so checkpoints of an
optimizer given a frozen offloaded base read the base once, not at each save."""

KEY = "unstepped_weights"  # the checkpoint's structure (opt.save); state dicts carry it under STATE_DICT_KEY
STATE_DICT_KEY = "swapio_unstepped_weights"


def _digest(opt, p):
    return opt._offloaded_checksum(p)


def checksums(opt, index, stateful):
    """{index: checksum} of opt's offloaded weights whose index ({id(p): index}) is not in `stateful`."""
    out = {}
    for group in opt.param_groups:
        for p in group["params"]:
            k = index[id(p)]
            if k not in stateful and k not in out and opt.is_offloaded(p):
                out[k] = _digest(opt, p)
    return out


def recorded(state_dict):
    """{saved index: checksum} a state dict records (none: {}); ValueError where the record is malformed."""
    record = state_dict.get(STATE_DICT_KEY, {})
    if not (isinstance(record, dict) and all(
            type(k) is int and isinstance(c, str) and len(c) == 16 and c.strip("0123456789abcdef") == ""
            for k, c in record.items())):
        raise ValueError(f"the loaded state dict's {STATE_DICT_KEY!r} must map parameter indices to checksums (16 "
                         f"hex digits), got {str(record)[:200]}")
    return {k: int(c, 16) for k, c in record.items()}


def check(opt, id_map, recorded, where):
    """ValueError (starting with `where`) where a weight recorded {saved index: checksum} changed since."""
    for k, want in recorded.items():
        p = id_map.get(k)
        if p is None:
            raise ValueError(f"{where}: {KEY!r} names parameter {k!r}, which is in none of its param groups")
        if opt.is_offloaded(p) and _digest(opt, p) != want:  # (a resident parameter is the model's to restore)
            raise ValueError(
                f"{where}: parameter {k} is an offloaded weight that had no optimizer state when this was saved, so "
                "it does not hold its value, and its value in the offload storage has changed since (trained after "
                "the checkpoint was taken?): loading would resume with it as a later step left it. Offload the "
                "model again from the weights saved with this checkpoint (disk_offload(model, checkpoint=<its "
                "save_checkpoint>, offload_dir=<a new directory>)), then load")
