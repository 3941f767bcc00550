"""Chat prompts for DeepSeek-V4 and V4.1: DeepSeek's own prompt encoding (the checkpoints ship no chat template)."""

from dsv4.chat.encoding import Reasoning, encode_chat, resolve_reasoning
from dsv4.chat.tokens import FAMILIES, Family, SpecialTokens, special_tokens

__all__ = ["FAMILIES", "Family", "Reasoning", "SpecialTokens", "encode_chat", "resolve_reasoning", "special_tokens"]
