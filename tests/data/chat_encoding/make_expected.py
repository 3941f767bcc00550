"""Write expected_<family>.json: the reference encoder's prompt for each conversation in conversations_<family>.json.

The reference encoders are not part of this repository. Get the file (DeepSeek's `encoding/encoding_dsv4.py` or
`encoding_dsv41.py`; SGLang carries both, "adapted from the release reference implementation", in
python/sglang/srt/entrypoints/openai/) and run, e.g.:

    python tests/data/chat_encoding/make_expected.py v41 /tmp/ref_encoders/encoding_dsv41.py \
        --repo sgl-project/sglang --path python/sglang/srt/entrypoints/openai/encoding_dsv41.py --commit <sha>

The reference's `encode_messages` takes a thinking mode, a raw effort and messages that already hold the tools; a
case's request options are turned into those the way vLLM's deepseek_v4 / deepseek_v41 tokenizer modes do it
(`_reference_prompt` below), which is request policy around the reference, not part of its format.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import runpy
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def _reference_prompt(ref: dict[str, Any], family: str, case: dict[str, Any]) -> str:
    messages = copy.deepcopy(case["messages"])
    thinking = case.get("thinking")
    effort = case.get("reasoning_effort")
    if effort == "none":
        thinking, effort = False, None
    thinking = True if thinking is None else thinking
    effort = "high" if effort is None else effort
    tools = case.get("tools")
    if tools:
        if family == "v4":
            head = 0 if messages[0]["role"] in ("system", "developer") else None
        else:
            head = next((i for i, m in enumerate(messages) if m["role"] == "system"), None)
        if head is None:
            messages.insert(0, {"role": "system", "content": ""})
            head = 0
        messages[head]["tools"] = tools
    prompt = ref["encode_messages"](
        messages,
        thinking_mode="thinking" if thinking else "chat",
        drop_thinking=case.get("drop_thinking", True),
        reasoning_effort=effort,
    )
    if not case.get("add_generation_prompt", True):
        # The reference always ends a final user turn with the assistant header and a think marker; without a
        # generation prompt that header is not written.
        for marker in (ref["thinking_start_token"], ref["thinking_end_token"]):
            header = ref["ASSISTANT_SP_TOKEN"] + marker
            if prompt.endswith(header):
                return prompt[: -len(header)]
    return prompt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("family", choices=["v4", "v41"])
    parser.add_argument("reference", type=Path, help="path of the reference encoder file")
    parser.add_argument("--repo", required=True, help="repository the reference file was taken from")
    parser.add_argument("--path", required=True, help="its path in that repository")
    parser.add_argument("--commit", required=True, help="the commit it was read at")
    args = parser.parse_args()

    ref = runpy.run_path(str(args.reference))
    conversations = json.loads((HERE / f"conversations_{args.family}.json").read_text(encoding="utf-8"))
    expected = {case["name"]: _reference_prompt(ref, args.family, case) for case in conversations["cases"]}
    out = {
        "source": {
            "repo": args.repo,
            "path": args.path,
            "commit": args.commit,
            "encoder": "encode_messages of SGLang's copy of DeepSeek's reference encoder",
            "generated": datetime.date.today().isoformat(),
            "generator": "tests/data/chat_encoding/make_expected.py",
            "conversations": f"tests/data/chat_encoding/conversations_{args.family}.json",
        },
        "expected": expected,
    }
    target = HERE / f"expected_{args.family}.json"
    target.write_text(json.dumps(out, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {len(expected)} prompts to {target}")


if __name__ == "__main__":
    main()
