"""Small models and data shared by the framework tests (Hugging Face Trainer, accelerate, torch.distributed):
a tiny GPT-2 from a transformers config, or a plain-torch MLP, and a fixed token data set. No downloads."""
import torch

VOCAB, SEQ = 64, 16


def tiny_gpt2(seed=0):
    """A GPT-2 with one layer and 16-wide embeddings (~10 k parameters), dropout off so runs are deterministic."""
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=16, n_layer=1, n_head=2, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(config)


class TokenData(torch.utils.data.Dataset):
    """n fixed random sequences; each item is {"input_ids", "labels"} as a causal LM expects."""

    def __init__(self, n=32, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def mlp(seed=0, width=24):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.Tanh(), torch.nn.Linear(width, 4))


def mlp_batches(steps, batch=16, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 8, generator=g), torch.randn(batch, 4, generator=g)) for _ in range(steps)]


def params_of(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_params_equal(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs: max |diff| {(a[k].float() - b[k].float()).abs().max()}"


def max_rel_diff(a, b):
    return max(((a[k].float() - b[k].float()).abs().max() / b[k].float().abs().max().clamp_min(1e-30)).item()
               for k in a)
