"""python -m zero_engine.config [schema|reference]: print the JSON Schema or the docs/config.md reference block."""
import json
import sys

from zero_engine.config.schema import config_reference_markdown, json_schema

if sys.argv[1:] == ["reference"]:
    print(config_reference_markdown(), end="")
elif sys.argv[1:] in ([], ["schema"]):
    print(json.dumps(json_schema(), indent=2))
else:
    raise SystemExit("usage: python -m zero_engine.config [schema|reference]")
