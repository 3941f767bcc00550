"""Structured outputs: a request's output follows a JSON schema, any JSON object, a regex, a choice of strings or an
EBNF grammar (`SamplingParams(structured_outputs=StructuredOutputsParams(...))`, vLLM's API), through xgrammar
(the optional extra `pip install 'dsv4[structured]'`).

Where each piece runs:
- before admission: `GrammarCompiler` compiles the spec against the tokenizer, or raises a ValueError that fails
  that request alone (bad schema, bad regex, xgrammar missing). The server's AsyncLLMEngine compiles on a small
  thread pool and hands LLMEngine.add_request the compiled grammar, so a slow schema never stalls the engine
  thread (and every running request's decode); the offline LLM compiles inside add_request. Compiled grammars are
  cached, LRU by spec, and held while a request that uses one runs, so the runner's lookup of the same spec (at
  admission, and after a preemption) is always a hit;
- tool_calls: the grammar of a tool_choice that forces calls (the server's "required" / named function);
- runner: `GrammarMatchers` holds a matcher per constrained row, masks the logits of those rows before sampling
  and advances on each sampled token as it lands on the host;
- scheduler: a constrained request stops at EOS, which its grammar allows only once the structure is complete.

Async scheduling: the mask of step k+1 needs step k's token, so a step that samples a constrained row waits for
the previous step's tokens after launching its own forward (ModelRunner._launch): a sync point only for batches
that hold a constrained request, overlapped with that forward on the GPU. CUDA graphs: the graphs end at the
hidden states; the logits, the mask and the sampler run after the replay, so they are unaffected.
"""

from dsv4.structured.compiler import GrammarCompiler
from dsv4.structured.matchers import GrammarMatchers

__all__ = ["GrammarCompiler", "GrammarMatchers"]
