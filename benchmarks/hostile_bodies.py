"""Request bodies a hostile client might send, generated from the request models' own JSON schemas (Hypothesis):
valid for the schema, then one field picked and up to two values inside it, at any depth, replaced by any JSON
value. The suite's property tests and `python -m kvloom.benchmarks.fuzz` draw from here."""

from hypothesis import strategies as st

from kvloom.router.openai_responses.request import ResponsesRequest
from kvloom.router.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest

# fields whose valid values would make a request long (generation) are kept small when valid
SMALL = {"max_tokens": st.integers(1, 3), "max_completion_tokens": st.integers(1, 3), "n": st.integers(1, 2),
         "best_of": st.integers(1, 2), "min_tokens": st.integers(0, 2), "top_logprobs": st.integers(0, 2),
         "logprobs": st.one_of(st.booleans(), st.integers(0, 2))}
ENDPOINTS = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest,
             "/tokenize": TokenizeRequest, "/detokenize": DetokenizeRequest, "/v1/responses": ResponsesRequest}

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8)


def from_schema(schema: dict, defs: dict, name: str = "") -> st.SearchStrategy:
    """Values valid for a pydantic JSON schema's types and bounds (its validators may still refuse them)."""
    if "$ref" in schema:
        return from_schema(defs[schema["$ref"].rsplit("/", 1)[1]], defs, name)
    if name in SMALL:
        return SMALL[name]
    if "anyOf" in schema:
        return st.one_of(*(from_schema(option, defs, name) for option in schema["anyOf"]))
    if "const" in schema or "enum" in schema:
        return st.sampled_from(schema.get("enum", [schema.get("const")]))
    properties = schema.get("properties", {})
    required = set(schema.get("required", ()))
    return {
        "object": lambda: some_of({k: from_schema(v, defs, k) for k, v in properties.items() if k in required},
                                  {k: from_schema(v, defs, k) for k, v in properties.items() if k not in required})
        if properties else st.dictionaries(st.text(max_size=6), json_values, max_size=3),
        "array": lambda: st.lists(from_schema(schema.get("items", {}), defs), min_size=schema.get("minItems", 0),
                                  max_size=max(3, schema.get("minItems", 0))),
        "string": lambda: st.text(max_size=16),
        "integer": lambda: st.integers(schema.get("minimum", -2**64), schema.get("maximum", 2**64)),
        "number": lambda: st.floats(schema.get("minimum", schema.get("exclusiveMinimum")),
                                    schema.get("maximum", schema.get("exclusiveMaximum")), allow_nan=False,
                                    exclude_min="exclusiveMinimum" in schema, exclude_max="exclusiveMaximum" in schema),
        "boolean": st.booleans, "null": st.none,
    }.get(schema.get("type"), lambda: json_values)()


def some_of(required: dict, optional: dict) -> st.SearchStrategy:
    """Objects with every required member and up to three optional ones (each optional field is mostly absent, as
    in real bodies; with a dozen present at once nearly every body would fail on the same few checks)."""
    if not optional:
        return st.fixed_dictionaries(required)
    return st.lists(st.sampled_from(sorted(optional)), max_size=3, unique=True).flatmap(
        lambda keys: st.fixed_dictionaries({**required, **{k: optional[k] for k in keys}}))


def paths(value, at: tuple = ()) -> list[tuple]:
    """Where a value could be replaced: every object member and array item, at any depth."""
    children = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    return [p for key, child in children for p in ((*at, key), *paths(child, (*at, key)))]


def hostile(model, served_model: str) -> st.SearchStrategy:
    """Bodies valid for the model's schema, then with one field picked and up to two values inside it, at any depth,
    replaced by any JSON value (or a member added): one wrong thing at a time reaches the checks deep inside."""
    schema = model.model_json_schema()
    defs = schema.get("$defs", {})
    fields = {name: from_schema(sub, defs, name) for name, sub in schema["properties"].items()}
    valid = some_of({k: v for k, v in fields.items() if k in schema.get("required", ())}, {})

    @st.composite
    def body(draw) -> dict:
        drawn = {**draw(valid), "model": served_model}  # another: nearly every body would be a 404 for its model
        focus = draw(st.sampled_from(sorted(fields)))
        drawn[focus] = draw(fields[focus])
        for _ in range(draw(st.integers(0, 2))):
            where = draw(st.sampled_from([(focus,), *paths(drawn[focus], (focus,)), ("extra",)]))
            parent = drawn
            for key in where[:-1]:
                parent = parent[key]
            parent[where[-1]] = draw(json_values)
        return drawn

    return body()
