"""torch.distributed: each rank saves its own state to path/rank-{r}.safetensors; rank 0 then writes
path/swapio-checkpoint.json (the world size and each rank's file). Loading needs the same world size: resharding
is out of scope, and another world size is a ValueError saying so."""
import os

INDEX = "swapio-checkpoint.json"


def is_sharded(path):
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, INDEX))
