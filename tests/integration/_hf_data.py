"""The data set both Hugging Face client scripts (``_hf_trainer_script.py``, ``_accelerate_script.py``) train on;
they import it as a sibling module (a script's own folder is first on ``sys.path``)."""
import torch


class Sequences(torch.utils.data.Dataset):
    """64 sequences whose next token is always the current one + 3 (mod 64): learnable in a few steps."""

    def __init__(self):
        self.tokens = (torch.arange(16)[None, :] * 3 + torch.arange(64)[:, None]) % 64

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, index):
        return {"input_ids": self.tokens[index], "labels": self.tokens[index]}
