"""Weight offload: run a Llama-style model whose weights stay on disk, streamed in layer by layer.

A tiny Llama (random weights, 2 layers) is saved with save_pretrained() into a temporary directory, standing in
for a real checkpoint. The model is then built on the meta device (no memory for its weights) and
swapio.offload.disk_offload reads each layer's weights from the checkpoint right before that layer runs. The
logits equal those of the same model loaded normally.

    python examples/weight_offload_llama.py [--checkpoint DIR]   # DIR: your own save_pretrained directory

Prints the comparison and "ok"; a mismatch raises.
"""
import argparse
import tempfile

import torch
import transformers

from swapio.offload import disk_offload, remove_offload


def tiny_llama_checkpoint(directory):
    """A 2-layer Llama with 64-wide hidden states, saved like any Hugging Face model."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    transformers.LlamaForCausalLM(config).save_pretrained(directory)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", help="a save_pretrained directory (default: a tiny Llama made here)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = args.checkpoint or tmp
        if args.checkpoint is None:
            tiny_llama_checkpoint(checkpoint)
        config = transformers.AutoConfig.from_pretrained(checkpoint)
        input_ids = torch.arange(12).remainder(config.vocab_size).unsqueeze(0)

        resident = transformers.AutoModelForCausalLM.from_pretrained(checkpoint).eval()
        with torch.no_grad():
            expected = resident(input_ids).logits
        del resident

        with torch.device("meta"):  # no memory for the weights: they stay in the checkpoint's files
            model = transformers.AutoModelForCausalLM.from_config(config).eval()
        # Buffers no checkpoint holds (the rotary embedding's inv_freq) disk_offload computes as from_pretrained does.
        device = "cuda" if torch.cuda.is_available() else "cpu"  # where each layer runs
        disk_offload(model, checkpoint=checkpoint, execution_device=device)
        with torch.no_grad():
            logits = model(input_ids.to(device)).logits.cpu()
        remove_offload(model)
    torch.testing.assert_close(logits, expected)
    print(f"disk_offload: logits of {tuple(logits.shape)} equal the resident model's "
          f"(max |diff| {(logits - expected).abs().max().item():.2e})")
    print("ok")


if __name__ == "__main__":
    main()
