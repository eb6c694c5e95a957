"""Hugging Face model types whose checkpoints need more than llama's reading: GPT-OSS's experts and
attention, DeepSeek-V3's (and Kimi K2's) latent attention and MoE layers (its router's correction bias
carried to state.json), the multi-token prediction layers a DeepSeek-V3 checkpoint carries past its
decoder, and Llama 4's experts and attention; one module each. Each value settled here comes with where it
came from: the config's key, or the modeling code that fixes it."""

from .deepseek import (LATENT_TYPES, SCORE_BIAS, deepseek_moe, latent_attention, latent_config, latent_rope_style,
                       take_score_bias)
from .deepseek_mtp import mtp_experts, mtp_section, split_mtp_layers
from .gpt_oss import aux_loss_note, gpt_oss_moe, gpt_oss_options
from .llama4 import LLAMA4_TYPES, llama4_config_without_layer_types, llama4_options
from .parameters import adjust_parameters

# What the rest of nanreplay_import reads from here.
__all__ = ["LATENT_TYPES", "SCORE_BIAS", "deepseek_moe", "latent_attention", "latent_config", "latent_rope_style",
           "take_score_bias", "mtp_experts", "mtp_section", "split_mtp_layers", "aux_loss_note", "gpt_oss_moe",
           "gpt_oss_options", "LLAMA4_TYPES", "llama4_config_without_layer_types", "llama4_options",
           "adjust_parameters"]
