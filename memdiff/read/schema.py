"""JSON Schema validation of the files memdiff reads back (summaries now, baselines later)."""

from __future__ import annotations

import json
from functools import lru_cache
from importlib import resources
from typing import Any, Dict

from memdiff.errors import InputError, clip


@lru_cache(maxsize=None)
def _validator(name: str) -> Any:
    # jsonschema costs ~0.1 s to import: only commands that read summaries, baselines or rules pay it.
    import jsonschema

    text = (resources.files("memdiff") / "schemas" / f"{name}.schema.json").read_text(encoding="utf-8")
    schema = json.loads(text)
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema)


def validate(path: str, data: Any, name: str) -> Dict[str, Any]:
    """`data` if it satisfies schemas/NAME.schema.json, else InputError naming the JSON path and rule."""
    from jsonschema.exceptions import best_match

    # The first error, worded by its most relevant part: choosing among all errors walks the whole
    # document even after one is found (a summary with a 2.5M-point timeline took 100 s to refuse).
    # A bound (maxItems) placed before `items` in a schema is found before its items are walked.
    first = next(_validator(name).iter_errors(data), None)
    error = None if first is None else best_match([first])
    if error is not None:
        # Keys come from the file: a 10 MB key would make a 10 MB path.
        where = ".".join(clip(str(p)) for p in error.absolute_path) or "(top level)"
        what = "valid memdiff rules" if name == "rules" else f"a valid memdiff {name}"  # not 'a ... rules'
        raise InputError(path, f"not {what}: {clip(where, 300)}: {rule_text(error)}")
    return data


# The types a JSON file holds, by the schema's names: a baseline is JSON, and 'NoneType', 'dict'
# or 'str' beside the schema's 'object' read as two languages in one line.
_JSON_TYPES = {bool: "boolean", int: "integer", float: "number", str: "string", list: "array", dict: "object",
               type(None): "null"}


def _json_type(value: Any) -> str:
    return _JSON_TYPES.get(type(value), type(value).__name__)


def _bound(value: Any) -> str:
    """A schema's bound as a person reads it: 9,223,372,036,854,775,807, not 9.22337e+18."""
    return f"{value:,}" if isinstance(value, int) and not isinstance(value, bool) else f"{value:g}"


def rule_text(error: Any) -> str:
    """What a value failed, in the schema's words only. jsonschema's own message quotes the value
    read (`'ghp_...' is not of type 'object'`), and a baseline can be a link to any file the
    runner can read: an error must never echo what it holds."""
    rule, wanted = error.validator, error.validator_value
    if rule == "required":
        missing = [k for k in wanted if isinstance(error.instance, dict) and k not in error.instance]
        return f"the field {missing[0]!r} is required" if missing else "a required field is missing"
    if rule in ("additionalProperties", "unevaluatedProperties"):
        # The fields the schema defines are its own words: they show what a misspelt key meant.
        defined = list(error.schema.get("properties", {}))
        return "a field the schema does not define" + (f" (it defines {', '.join(defined)})" if defined else "")
    if rule == "anyOf" and all(list(option) == ["required"] for option in wanted):
        return f"none of the fields {', '.join(k for option in wanted for k in option['required'])}; one is required"
    if rule in ("oneOf", "anyOf") and all(isinstance(o, dict) and isinstance(o.get("type"), str) for o in wanted):
        # A size is an integer or a string: say which the value is not, or what its own kind broke.
        kinds = [o["type"] for o in wanted]
        own = _json_type(error.instance)
        if own not in kinds:
            return f"a value of type {own}, where the schema wants {' or '.join(kinds)}"
        inner = next((e for e in error.context or () if e.schema.get("type") == own and e.validator != "type"), None)
        if inner is not None:
            return rule_text(inner)
    if rule == "type":
        kinds = wanted if isinstance(wanted, list) else [wanted]
        return f"a value of type {_json_type(error.instance)}, where the schema wants {' or '.join(kinds)}"
    if rule in ("enum", "const"):
        allowed = wanted if isinstance(wanted, list) else [wanted]
        shown = ", ".join(json.dumps(v) for v in allowed[:8]) + (", ..." if len(allowed) > 8 else "")
        return f"a value other than {shown}"
    if rule in ("minimum", "exclusiveMinimum"):
        return f"a value below the schema's {rule} of {_bound(wanted)}"
    if rule in ("maximum", "exclusiveMaximum"):
        return f"a value above the schema's {rule} of {_bound(wanted)}"
    if rule == "pattern":  # the schema's regex is its own words; the value may be anything
        return f"a value that does not match the schema's pattern {wanted}"
    if rule in ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties", "multipleOf"):
        return f"a value outside the schema's {rule} of {wanted}"
    return f"a value that fails the schema's {rule!r} rule"
