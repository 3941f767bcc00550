"""Speculative decoding: the checkpoint's drafters (DeepSeek-V4.1 DSpark, DeepSeek-V4 MTP) and their settings.
docs/dspark.md describes both drafters and where each fact comes from."""
