"""JSON Schema validation of the files memdiff reads back (summaries now, baselines later)."""

from __future__ import annotations

import json
from functools import lru_cache
from importlib import resources
from typing import Any, Dict

from memdiff.errors import InputError, brief, clip

MAX_MESSAGE = 200


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

    error = best_match(_validator(name).iter_errors(data))
    if error is not None:
        # Keys come from the file: a 10 MB key would make a 10 MB path.
        where = ".".join(clip(str(p)) for p in error.absolute_path) or "(top level)"
        # jsonschema's message quotes the whole value: a 10 MB string makes a 10 MB line.
        message = error.message if len(error.message) <= MAX_MESSAGE else (
            f"{brief(error.instance)} fails the schema's {error.validator!r} rule")
        raise InputError(path, f"not a valid memdiff {name}: {clip(where, 300)}: {message}")
    return data
