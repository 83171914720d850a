#!/usr/bin/env python3
"""Writes reference token ids for the ignored `real_models_match_reference` test.

The reference is what an engine's chat path computes: HF `transformers`
`apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
tokenize=True)` (which encodes without adding special tokens).

    pip install transformers jinja2
    python3 src/tokenizer/reference_ids.py MODELS_DIR MODEL_ID [MODEL_ID ...] > /tmp/ref.json
    IC_TOKENIZER_REFERENCE=/tmp/ref.json cargo test -p inference-cache \
        --bin inference-cache-server real_models_match_reference -- --ignored
"""
import json
import os
import sys

from transformers import AutoTokenizer

TEXTS = [
    "hello world",
    "  Leading and trailing spaces  ",
    "Multi\nline\n\ntext with\ttabs and numbers 1234567890.",
    "Unicode: héllo wörld, 你好，世界, emoji 😀👍, Ελληνικά, русский.",
    "Special-looking text: <|im_start|> <|eot_id|> {{ not a template }} {% raw %}",
    "Code:\n```python\ndef f(x):\n    return x ** 2  # square\n```\n",
    "A long prompt. " * 200,
    "x",
]


def main() -> None:
    root = sys.argv[1]
    cases = []
    for model in sys.argv[2:]:
        tok = AutoTokenizer.from_pretrained(os.path.join(root, model), local_files_only=True)
        for text in TEXTS:
            if tok.chat_template is None:
                # The server's documented fallback: the raw text, no special tokens added.
                ids = tok.encode(text, add_special_tokens=False)
            else:
                ids = tok.apply_chat_template(
                    [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
                )
            if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
                ids = ids["input_ids"]
            cases.append({"model": model, "text": text, "ids": list(ids)})
    json.dump({"models_dir": os.path.abspath(root), "cases": cases}, sys.stdout)


if __name__ == "__main__":
    main()
