"""Models: the reference GPT, Hugging Face adapters, and block discovery for any model."""

from hybridtrain.models.blocks import BlocksNotFoundError, find_blocks
from hybridtrain.models.gpt import GPT, GPTConfig, build_gpt, causal_lm_loss, gpt_config

__all__ = ["GPT", "BlocksNotFoundError", "GPTConfig", "build_gpt", "causal_lm_loss", "find_blocks", "gpt_config"]
