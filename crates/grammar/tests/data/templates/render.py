"""Renders each chat template here the way Hugging Face's apply_chat_template does (jinja2's
sandbox, trim_blocks and lstrip_blocks on, tojson as json.dumps) for one conversation with
tools and an earlier tool call, into NAME.expected. tests/tool_families.rs checks Rampart's
rendering against these files byte for byte. Rerun after changing a template:

    python3 render.py
"""
import json
import pathlib

from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.ext import loopcontrols

HERE = pathlib.Path(__file__).parent
TOOLS = json.loads((HERE / "tools.json").read_text())
MESSAGES = json.loads((HERE / "messages.json").read_text())
SPECIAL = {
    "qwen2.5": ("", "<|im_end|>"),
    "qwen3": ("", "<|im_end|>"),
    "llama3.2": ("<|begin_of_text|>", "<|eot_id|>"),
    "mistral-v0.3": ("<s>", "</s>"),
}


def raise_exception(message):
    raise Exception(message)


def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


for name, (bos, eos) in SPECIAL.items():
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: "26 Jul 2024"
    template = env.from_string((HERE / f"{name}.jinja").read_text())
    text = template.render(messages=MESSAGES, tools=TOOLS, add_generation_prompt=True,
                           bos_token=bos, eos_token=eos)
    (HERE / f"{name}.expected").write_text(text)
    print(name, len(text))
