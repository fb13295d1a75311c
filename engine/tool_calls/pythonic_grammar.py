"""A tool's JSON-schema `parameters` as the EBNF grammar of Python keyword arguments (`city="Paris", days=3`), for
pythonic tool calls.

It covers what tools' schemas use: types (and lists of them), `enum`, `const`, `anyOf`/`oneOf`, `$ref` into
`$defs`, arrays, objects with `properties` and `required` (given properties only, required ones first, in order),
and Python's spelling of JSON values (True, False, None). Bounds on values (`minimum`, `pattern`, lengths) are not
in the grammar: pythonic calls keep their tools' types, enums and required properties, not their bounds (the JSON
formats, through xgrammar's JSON schemas, keep those too).
"""

import json
from collections.abc import Callable

COMMON = r'''
string ::= "\"" string_char* "\""
string_char ::= [^"\\\r\n] | "\\" ["\\nrt]
integer ::= "-"? ("0" | [1-9] [0-9]*)
number ::= integer ("." [0-9]+)? ([eE] [-+]? [0-9]+)?
boolean ::= "True" | "False"
none ::= "None"
any ::= string | number | boolean | none | any_list | any_dict
any_list ::= "[" (any (", " any)*)? "]"
any_dict ::= "{" (string ": " any (", " string ": " any)*)? "}"
'''
TYPES = {"string": "string", "integer": "integer", "number": "number", "boolean": "boolean", "null": "none"}


def arguments_grammar(parameters: dict) -> str:
    """The grammar (its root: the keyword arguments) of a call whose arguments match `parameters`."""
    rules = _Rules(parameters)
    root = rules.members(parameters, lambda name: f"{name}=") if parameters.get("properties") else '""'
    return f"root ::= {root}\n" + "\n".join(f"{n} ::= {body}" for n, body in rules.bodies.items()) + COMMON


def python_literal(value) -> str:
    """A JSON value written as Python writes it."""
    if isinstance(value, bool) or value is None:
        return {True: "True", False: "False", None: "None"}[value]
    if isinstance(value, list):
        return "[" + ", ".join(map(python_literal, value)) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k)}: {python_literal(v)}" for k, v in value.items()) + "}"
    return json.dumps(value, ensure_ascii=False)


def quoted(text: str) -> str:
    """`text` as an EBNF string literal."""
    return json.dumps(text, ensure_ascii=False)


class _Rules:
    def __init__(self, root_schema: dict) -> None:
        self.root_schema = root_schema
        self.bodies: dict[str, str] = {}
        self._refs: dict[str, str] = {}

    def rule(self, body: str) -> str:
        name = f"r{len(self.bodies)}"
        self.bodies[name] = body
        return name

    def value(self, schema) -> str:
        if not isinstance(schema, dict) or not schema:
            return "any"
        if "$ref" in schema:
            return self._ref(schema["$ref"])
        if "const" in schema:
            return quoted(python_literal(schema["const"]))
        if "enum" in schema:
            return "(" + " | ".join(quoted(python_literal(v)) for v in schema["enum"]) + ")"
        alternatives = schema.get("anyOf") or schema.get("oneOf")
        if alternatives:
            return "(" + " | ".join(self.value(s) for s in alternatives) + ")"
        kind = schema.get("type", "object" if "properties" in schema else None)
        if isinstance(kind, list):
            return "(" + " | ".join(self.value({**schema, "type": k}) for k in kind) + ")"
        if kind in TYPES:
            return TYPES[kind]
        if kind == "array":
            item = self.value(schema.get("items"))
            return self.rule(f'"[" ({item} (", " {item})*)? "]"')
        if kind == "object" and schema.get("properties"):
            return self.rule('"{" ' + self.members(schema, lambda name: f"{json.dumps(name)}: ") + ' "}"')
        return "any_dict" if kind == "object" else "any"

    def members(self, schema: dict, key: Callable[[str], str]) -> str:
        """An object's properties as `key(name) value` joined by ", ": the required ones in order, then any of the
        optional ones, in order."""
        required = [n for n in schema.get("required", []) if n in schema["properties"]]
        optional = [n for n in schema["properties"] if n not in required]
        item = {n: f"{quoted(key(n))} {self.value(schema['properties'][n])}" for n in schema["properties"]}
        tails = ['""']  # tails[k]: any of optional[k:], each after ", "
        for name in reversed(optional):
            tails.insert(0, self.rule(f'(", " {item[name]})? {tails[0]}'))
        if required:
            return ' ", " '.join(item[n] for n in required) + f" {tails[0]}"
        start = '""'  # any of optional[k:], the first without ", "
        for k in reversed(range(len(optional))):
            start = self.rule(f"{item[optional[k]]} {tails[k + 1]} | {start}")
        return start

    def _ref(self, ref: str) -> str:
        if ref not in self._refs:
            path = ref.removeprefix("#/").split("/") if ref.startswith("#/") else None
            target = self.root_schema
            for part in path or ():
                target = target.get(part, {}) if isinstance(target, dict) else {}
            if not path:
                return "any"
            self._refs[ref] = name = self.rule("any")  # placeholder: a recursive schema refers to itself
            self.bodies[name] = self.value(target)
        return self._refs[ref]
