"""`swapio plan`: the memory arithmetic (swapio.tools.memplan) for a model, laid out against the machine's GPU,
RAM and disk, with the expected nvme-mode step time from the disk's measured bandwidth: the `swapio tune`
config in the directory if there is one, else a short `swapio bench` run there."""
import json
import os

from . import memplan
from .testfile import free_bytes
from .tune import CONFIG_NAME as TUNE_CONFIG

MEASURE_SIZE = 256 << 20


def gpu_memory():
    """Total memory of the first CUDA device, or None without CUDA."""
    import torch
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(0).total_memory


def tune_config_bandwidth(directory):
    """(read B/s, write B/s, path) from a `swapio tune` config for `directory`, or None: DIR/swapio-io.json, or
    ./swapio-io.json when it was measured on DIR."""
    for path in (os.path.join(directory, TUNE_CONFIG), TUNE_CONFIG):
        try:
            with open(path) as f:
                doc = json.load(f)
            measured = doc["measured"]
            both = measured["both"]
            read, write = float(both["read_gb_s"]) * 1e9, float(both["write_gb_s"]) * 1e9
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if path == TUNE_CONFIG and os.path.realpath(str(measured.get("directory"))) != os.path.realpath(directory):
            continue
        if read > 0 and write > 0:
            return read, write, os.path.abspath(path)
    return None


def measured_bandwidth(directory, size=None, log=None):
    """(read B/s, write B/s, description): a sequential write then read of a temporary file in `directory`
    with swapio's defaults (1 MiB blocks, QD 32), removed afterwards."""
    from .bench import BenchConfig, run_bench
    size = size or MEASURE_SIZE
    result = run_bench(BenchConfig(rw="rw", size=size, directory=directory, progress=False), log=log)
    rate = {p.label: p.bytes / p.elapsed for p in result.phases}
    return rate["read"], rate["write"], f"measured now: {size >> 20} MiB written then read in {directory}"


def run_plan(params, dtype, optimizer, state_dtype, gpu_mem, ram, disk, buffer_bytes, log=None, ring_bytes=None,
             largest_module=0, activations=None, shapes=None):
    disk_free = read = write = source = None
    if disk is not None:
        disk_free = free_bytes(disk)  # None: no block count (ramfs)
        found = tune_config_bandwidth(disk)
        if found is None and disk_free is not None and disk_free < MEASURE_SIZE:
            # the plan (which already shows the disk too small) beats an error about a measurement nobody asked for
            source = (f"not measured: {disk} has {_gb(disk_free)} free, less than the {MEASURE_SIZE >> 20} MiB the "
                      "bandwidth measurement writes")
        else:
            read, write, source = found or measured_bandwidth(disk, log=log)
    out = memplan.plan(params, dtype, optimizer, state_dtype, gpu_mem, ram, disk_free, buffer_bytes, read, write,
                       ring_bytes, largest_module, shapes)
    out["activations"] = None if activations is None else memplan.activations(**activations)
    out["disk"] = None if disk is None else {"directory": os.path.abspath(disk), "read_bytes_per_s": read,
                                             "write_bytes_per_s": write, "bandwidth_from": source}
    return out


def _gb(n):
    """Binary units, like the sizes the command takes (--ram 64G is 64 GiB and prints as 64.0 GiB)."""
    for unit, shift in (("TiB", 40), ("GiB", 30)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.1f} {unit}"
    return f"{n / (1 << 20):.1f} MiB"


def _rate(bytes_per_s):
    return f"{bytes_per_s / (1 << 30):.2f} GiB/s"


def _count(n):
    return f"{n / 1e9:g} B" if n >= 10**9 else f"{n / 1e6:g} M"


def _b(x):
    return f"{x:g}"


def _whole(p):
    # the nvme rows printed are a GPU's, whose parameters all keep an fp32 master
    return p["optimizer"] in memplan.WHOLE


def _pipeline_rule(p):
    """Adafactor never splits a parameter: its slots grow to the largest one's master (memplan.state_pipeline)."""
    if _whole(p) and p["largest_module"]:
        return (f"max(min(buffer_bytes, state), {memplan.DEFAULT_BUFFER_COUNT} x the largest parameter's fp32 "
                "master, which is never split, bounded by --largest-module's)")
    return "min(buffer_bytes, state)"


def _whole_note(p):
    if _whole(p) and not p["largest_module"]:
        return (f", or {memplan.DEFAULT_BUFFER_COUNT} x the largest parameter's fp32 master where that is larger "
                "(it is never split; give --largest-module to count it)")
    return ""


# what the count alone cannot see: a convolution's factors are not small (docs/cli.md, "swapio plan")
_ADAFACTOR_COUNT_ONLY = (
    "adafactor's moments, from the count alone, are an LLM's: matrices with both last dimensions large. Adafactor "
    "factors the last two dimensions, so a 1 x 1 convolution's [out, in, 1, 1] weight keeps two fp32 numbers an "
    "element (8 bytes a parameter) and a 3 x 3 one's 2/3 of one: for a model with convolutions give --shapes "
    "FILE (a JSON list of its parameters' shapes).")


def _placed_note(per):
    """fp32 parameters are their own master on the CPU only: on a GPU or offloaded the optimizer keeps one."""
    if per["optimizer_state_gpu"] == per["optimizer_state"]:
        return []
    return [f"on a GPU or offloaded, fp32 parameters keep an fp32 master too: optimizer state "
            f"{per['optimizer_state_gpu']:.4g} a parameter (the rows with a GPU and with the weights offloaded)"]


def plan_text(p):
    per, tot, cap = p["bytes_per_param"], p["totals"], p["capacity"]
    n_mom = memplan.MOMENT_COUNT[p["optimizer"]]
    if p.get("tensors") is not None:
        kind = f"{n_mom} moment{'s' if n_mom > 1 else ''}" if n_mom else "factored moments"
        moments = f"{kind} {per['moments']:.4g}, counted over {p['tensors']} tensors' shapes"
    elif n_mom:
        moments = f"{n_mom} moment{'s' if n_mom > 1 else ''} {_b(per['moments'])}"
    else:
        moments = "factored moments ~0: rows + cols numbers a matrix"
    lines = [f"swapio plan: {_count(p['params'])} parameters, {p['dtype']} weights and gradients, "
             f"{p['optimizer']} with {p['state_dtype']} moments", "",
             "bytes per parameter: "
             f"weights {_b(per['weights'])} + gradients {_b(per['grads'])} + optimizer state "
             f"{_b(per['optimizer_state'])} (fp32 master {_b(per['master'])}, {moments}) = {_b(per['total'])}",
             *_placed_note(per),
             f"totals: weights {_gb(tot['weights'])}, gradients {_gb(tot['grads'])}, optimizer state "
             f"{_gb(tot['optimizer_state'])}, all {_gb(tot['total'])}", ""]
    have = [f"{k} {_gb(v)}" for k, v in (("GPU", cap["gpu"]), ("RAM", cap["ram"]), ("disk free", cap["disk_free"]))
            if v is not None]
    lines.append(f"{'where it sits':40}{'GPU':>11}{'RAM':>11}{'disk':>11}   fits"
                 + (f" ({', '.join(have)})" if have else " (give --gpu-mem, --ram, --disk to check)"))
    for lay in p["layouts"]:
        short = [k.upper() if k != "disk" else k for k, ok in lay["fits"].items() if ok is False]
        unknown = [k.upper() if k != "disk" else k for k, ok in lay["fits"].items() if ok is None]
        # a --disk whose file system keeps no block count (ramfs) was given: its free space is what is unknown
        no_count = "disk" in unknown and p.get("disk") is not None
        unknown = [k for k in unknown if not (no_count and k == "disk")]
        why = [f"{', '.join(unknown)} not given"] if unknown else []
        why += ["disk free space unknown"] if no_count else []
        verdict = (f"no: {', '.join(short)} too small" if short else f"? ({'; '.join(why)})" if why else "yes")
        lines.append(f"{lay['name']:40}{_gb(lay['gpu']) if lay['gpu'] else '-':>11}"
                     f"{_gb(lay['ram']) if lay['ram'] else '-':>11}{_gb(lay['disk']) if lay['disk'] else '-':>11}"
                     f"   {verdict}")
    lines.append("")
    if p["optimizer"] == "adafactor" and p.get("tensors") is None:
        lines += [_ADAFACTOR_COUNT_ONLY, ""]
    disk = p.get("disk")
    if p["nvme_step_seconds"] is not None:
        s = tot["optimizer_state_gpu"]
        lines.append(f"nvme step: the state is read and written once per step: {_gb(s)} at "
                     f"{_rate(disk['read_bytes_per_s'])} read + at {_rate(disk['write_bytes_per_s'])} write = "
                     f"{p['nvme_step_seconds']:.1f} s per step ({disk['bandwidth_from']}); the Adam compute runs "
                     "under the I/O.")
        o = p["offloaded_step_seconds"]
        lines.append(f"weights offloaded too (disk_offload + offload=\"nvme\"): weights read twice and written once, "
                     f"the state read and written, the fp32 gradient sums written and read: {o['accumulate']:.1f} s "
                     f"per step; with in_backward=True (no gradient sums) {o['in_backward']:.1f} s, I/O only.")
    elif disk is not None:
        lines.append(f"nvme step time: {disk['bandwidth_from']}.")
    else:
        lines.append("nvme step time: give --disk DIR (the disk that would hold the swap file) to estimate it.")
    pinned = p["offloaded_pinned"]
    lines += [f"nvme mode holds {_pipeline_rule(p)} = {_gb(p['layouts'][2]['ram'])} of pinned RAM "
              f"(buffer_bytes {_gb(p['buffer_bytes'])}){_whole_note(p)}; a streaming checkpoint (opt.save) needs "
              "about the state's size again on its disk.",
              "weights offloaded, \"nvme\": pinned RAM (memory_report()[\"pinned_budget\"]) = "
              + " + ".join(f"{name} {_gb(n)}" for name, n in pinned.items()) + f" = {_gb(sum(pinned.values()))}"
              + (f" (largest module {_gb(p['largest_module'])})" if p["largest_module"] else
                 " (the buffers sized to the largest module not counted: give --largest-module)") + ".",
              ("Not counted: the CUDA context, allocator slack" + ("" if p.get("activations") else
               "; activations (give --seq, --batch, --hidden and --layers)") +
               ". Sizes are binary (GiB = 2^30 bytes).")]
    if p.get("activations"):
        lines += ["", *_activation_rows(p["activations"])]
    if cap["gpu"] is not None and tot["weights"] + tot["grads"] > cap["gpu"]:
        lines += ["", *_weights_exceed_gpu(tot, cap["gpu"])]
    return "\n".join(lines)


def _activation_rows(a):
    """The activations row: what one forward saves, and where it sits with offload_activations."""
    scores = f", {a['heads']} heads' attention scores included" if a["heads"] else " (flash attention)"
    cpu, nvme = a["offload_cpu"], a["offload_nvme"]
    to_cpu, to_nvme = '  offload_activations(to="cpu")', '  offload_activations(to="nvme")'
    return [f"activations: seq {a['seq']} x batch {a['batch']}, {a['layers']} layers of width {a['hidden']}"
            f"{scores}: {_gb(a['per_layer'])} per layer, {_gb(a['total'])} per forward (16-bit)",
            f"{'  where they sit':40}{'device':>11}{'RAM':>11}{'disk':>11}",
            f"{'  no activation offload':40}{_gb(a['total']):>11}{'-':>11}{'-':>11}",
            f"{to_cpu:40}{_gb(cpu['device']):>11}{_gb(cpu['ram']):>11}{'-':>11}",
            f"{to_nvme:40}{_gb(nvme['device']):>11}{_gb(nvme['ram']):>11}"
            f"{_gb(nvme['disk']):>11}"]


def _weights_exceed_gpu(tot, gpu):
    """What to do when weights + gradients alone do not fit the GPU: offload the weights too."""
    return [f"Weights + gradients alone ({_gb(tot['weights'] + tot['grads'])}) exceed the GPU ({_gb(gpu)}): "
            "optimizer offload is not enough. Offload the weights too (the 'weights offloaded' rows): "
            "swapio.offload.cpu_offload or disk_offload(model, offload_dir) and an OffloadAdamW over "
            "model.parameters() train them, the GPU holding a few modules at a time (docs/offload.md, "
            "\"Training offloaded weights\"); or LoRA adapters (peft) over frozen offloaded weights."]
