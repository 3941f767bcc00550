"""Reasoning and tool-call parsers for DeepSeek-V4 / V4.1 replies, for the OpenAI-compatible server.

output.py is the entry point (`ParserOptions`, `ChatOutputStream` for streaming, `parse_chat_output` otherwise);
reasoning.py and tool_calls.py are its two stages. The marker strings come from dsv4.chat.tokens, shared with the
prompt encoder.
"""
from dsv4.chat.tokens import Family
from dsv4.serve.parsers.output import (ChatDelta, ChatOutput, ChatOutputStream, ParserOptions, accumulate,
                                       parse_chat_output)
from dsv4.serve.parsers.reasoning import ReasoningDelta, ReasoningStream, split_reasoning
from dsv4.serve.parsers.tool_calls import ToolCall, ToolCallDelta, ToolCallStream, new_call_id, parse_tool_calls

__all__ = ["ChatDelta", "ChatOutput", "ChatOutputStream", "Family", "ParserOptions", "ReasoningDelta",
           "ReasoningStream", "ToolCall", "ToolCallDelta", "ToolCallStream", "accumulate", "new_call_id",
           "parse_chat_output", "parse_tool_calls", "split_reasoning"]
