"""dsv4: a compact, fast inference engine for the DeepSeek-V4 model family."""

from __future__ import annotations

from typing import Any

from dsv4.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutputKind", "RequestOutput",
           "CompletionOutput"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # LLM pulls in torch and the whole engine; keep `import dsv4` cheap for the CLI and tools.
    if name == "LLM":
        from dsv4.llm import LLM

        return LLM
    if name in ("RequestOutput", "CompletionOutput"):
        from dsv4 import outputs

        return getattr(outputs, name)
    raise AttributeError(f"module 'dsv4' has no attribute {name!r}")
