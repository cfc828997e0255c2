"""model.save_pretrained(dir) of an offloaded transformers model: what transformers writes, the weights streamed.

transformers' own save_pretrained takes model.state_dict(), which holds swapio's meta placeholders between
forwards ("Cannot copy out of meta tensor"), and would need the whole model in memory anyway. While a model is
offloaded, its save_pretrained is this one: save_checkpoint (shards and index, streamed record by record, which
also writes config.json and generation_config.json), so that from_pretrained(dir) gives the model back; with
save_original_format (transformers' default), the tensors transformers' own save_pretrained writes, under its
names (hf_original_layout.py: renamed, fused experts split per expert). The transformers model a peft model
wraps gets it too, when the peft model is what was offloaded (merge_and_unload() returns it). What it cannot
honour (another state_dict, push_to_hub, a variant, pickle files) is refused, saying what to do instead.
"""
from .export import write_checkpoint
from .hf_original_layout import original_layout
from .hf_model import ModelMethod

# save_function: transformers takes it (accelerate's examples pass accelerator.save) and writes safetensors files
# without it, as this does
_ACCEPTED = ("token", "save_peft_format", "save_original_format", "safe_serialization", "distributed_checkpoint",
             "save_function")


class SavePretrained(ModelMethod):
    """The offloaded model's save_pretrained (see the module)."""

    __slots__ = ()
    NAME = "save_pretrained"

    def __call__(self, save_directory, is_main_process=True, state_dict=None, push_to_hub=False,
                 max_shard_size="50GB", variant=None, **kwargs):
        unknown = [k for k in kwargs if k not in _ACCEPTED]
        if unknown:
            raise TypeError(f"save_pretrained() of a model offloaded by swapio got an unexpected keyword argument "
                            f"{unknown[0]!r}")
        refused = [what for what, bad in (("state_dict=", state_dict is not None), ("push_to_hub=True", push_to_hub),
                                          ("variant=", variant is not None),
                                          ("safe_serialization=False", kwargs.get("safe_serialization") is False),
                                          ("distributed_checkpoint=True", kwargs.get("distributed_checkpoint")))
                   if bad]
        if refused:
            raise ValueError(f"save_pretrained({refused[0]}) of a model offloaded by swapio: it streams the model's "
                             "own weights as safetensors shards (swapio.offload.save_checkpoint) and nothing else. "
                             "Save without it (push the directory with huggingface_hub's upload_folder), or "
                             "remove_offload(model) first")
        if is_main_process:
            model = self.model()
            original = kwargs.get("save_original_format", True)
            write_checkpoint(model, save_directory, max_shard_size=max_shard_size, part=True,
                             relayout=lambda m, stored: _as_transformers_saves(m, stored, original))


def _as_transformers_saves(model, stored, original_format):
    """The tensors transformers' save_pretrained writes: without the model's _keys_to_ignore_on_save (Marian's
    sinusoidal position embeddings, which its loading computes), in its original layout if asked."""
    ignored = set(getattr(model, "_keys_to_ignore_on_save", None) or ())
    stored = [it for it in stored if it.entry.name not in ignored]
    return original_layout(model, stored) if original_format else stored


install, uninstall = SavePretrained.install, SavePretrained.uninstall
