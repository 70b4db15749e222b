"""A short agent loop with the official `openai` client: the model gets a calculator tool,
calls it, reads the result, and answers. Works against any model Rampart serves with a tool
format (docs/api.md, Tool calling).

    python3 examples/tools/agent.py --base-url http://127.0.0.1:8080/v1 --model smollm2-135m \
        "What is 1234 * 5678?"
"""
import argparse
import ast
import json
import operator
import os
import sys

from openai import OpenAI

CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluates an arithmetic expression with + - * / and parentheses.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "pattern": "^[0-9+*/(). -]{1,40}$"}},
            "required": ["expression"],
        },
        "strict": True,
    },
}

OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
       ast.USub: operator.neg, ast.UAdd: operator.pos}


def evaluate(expression):
    """Arithmetic only: no names, no calls."""
    def walk(node):
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in OPS:
            return OPS[type(node.op)](walk(node.left), walk(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in OPS:
            return OPS[type(node.op)](walk(node.operand))
        raise ValueError(f"not arithmetic: {ast.dump(node)}")
    return walk(ast.parse(expression, mode="eval"))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("question")
    p.add_argument("--base-url", default="http://127.0.0.1:8080/v1")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--api-key", default=os.environ.get("RAMPART_API_KEY", "none"))
    p.add_argument("--stream", action="store_true", help="read the call from a stream")
    args = p.parse_args()
    client = OpenAI(base_url=args.base_url, api_key=args.api_key)
    messages = [{"role": "user", "content": args.question}]
    # Turn 1: the model must call the calculator.
    if args.stream:
        calls = {}
        for chunk in client.chat.completions.create(model=args.model, messages=messages, tools=[CALCULATOR],
                                                    tool_choice="required", parallel_tool_calls=False, temperature=0, stream=True):
            for d in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
                c = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                c["id"] = d.id or c["id"]
                c["name"] += d.function.name or ""
                c["arguments"] += d.function.arguments or ""
        tool_calls = [{"id": c["id"], "type": "function",
                       "function": {"name": c["name"], "arguments": c["arguments"]}} for _, c in sorted(calls.items())]
    else:
        reply = client.chat.completions.create(model=args.model, messages=messages, tools=[CALCULATOR],
                                               tool_choice="required", parallel_tool_calls=False, temperature=0)
        assert reply.choices[0].finish_reason == "tool_calls", reply
        tool_calls = [c.model_dump() for c in reply.choices[0].message.tool_calls]
    messages.append({"role": "assistant", "content": None, "tool_calls": tool_calls})
    for call in tool_calls:
        expression = json.loads(call["function"]["arguments"])["expression"]
        try:
            result = str(evaluate(expression))
        except Exception as e:  # the model's expression may not be arithmetic
            result = f"error: {e}"
        print(f"call {call['function']['name']}({expression!r}) -> {result}")
        messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
    # Turn 2: the model reads the result and answers in text.
    final = client.chat.completions.create(model=args.model, messages=messages, tools=[CALCULATOR],
                                           tool_choice="none", temperature=0, max_tokens=60)
    print("answer:", final.choices[0].message.content)
    return 0


if __name__ == "__main__":
    sys.exit(main())
