"""Parameters transformers never saves and computes when loading (a model's _keys_to_ignore_on_save: Marian's
sinusoidal position embeddings): from_pretrained and disk_offload(checkpoint=...) of a save_pretrained directory
compute them as transformers' loading does and keep them resident; the logits equal the resident model's."""
import pytest
import torch

from helpers import hf_zoo
from swapio.offload import cpu_offload, disk_offload, from_pretrained, load_file, remove_offload

transformers = hf_zoo.transformers
peft = pytest.importorskip("peft")


def marian():
    config = transformers.MarianConfig(vocab_size=64, d_model=32, encoder_layers=1, decoder_layers=1,
                                       encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                                       decoder_ffn_dim=64, max_position_embeddings=32, pad_token_id=0,
                                       decoder_start_token_id=0)
    torch.manual_seed(0)
    return transformers.MarianMTModel(config).eval()


def logits(model):
    ids = torch.randint(2, 64, (2, 5), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), hf_zoo.one_thread():
        return model(input_ids=ids, decoder_input_ids=ids).logits


def on_meta():
    with torch.device("meta"):
        return transformers.MarianMTModel(marian().config).eval()


@pytest.mark.parametrize("how", ["from_pretrained", "resident", "peft", "cpu_offload_state_dict"])
def test_marian_position_embeddings_are_computed_not_read(tmp_path, how):
    """Was a ValueError: "checkpoint ... lacks tensor 'model.encoder.embed_positions.weight'"."""
    resident = marian()
    resident.save_pretrained(tmp_path)
    if how == "from_pretrained":  # built on meta
        model = from_pretrained(transformers.MarianMTModel, tmp_path, buffer_bytes=16 << 10)
    elif how == "cpu_offload_state_dict":  # accelerate's argument, the directory's tensors
        model = cpu_offload(on_meta(), state_dict=load_file(tmp_path))
    elif how == "resident":
        model = disk_offload(marian(), checkpoint=tmp_path, buffer_bytes=16 << 10)
    else:
        config = peft.LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights=False)  # adds nothing
        resident = peft.get_peft_model(resident, config).eval()
        model = disk_offload(peft.get_peft_model(marian(), config).eval(), checkpoint=tmp_path,
                             buffer_bytes=16 << 10)
    embeddings = [p for n, p in model.named_parameters() if n.endswith("embed_positions.weight")]
    assert len(embeddings) == 2 and all(p.device.type == "cpu" for p in embeddings)  # resident
    assert torch.equal(logits(model), logits(resident))
    remove_offload(model)


def test_one_transformers_does_not_compute_is_a_clear_error(tmp_path):
    marian().save_pretrained(tmp_path)
    model = on_meta()
    model._init_weights = lambda module: None
    with pytest.raises(ValueError, match=r"embed_positions\.weight is on the meta device, and transformers computes "
                                         r"it when loading \(it never saves it\), but swapio could not"):
        disk_offload(model, checkpoint=tmp_path)
