"""The ``zero-engine`` command: small tools around the runtime.

    zero-engine schema          print the JSON Schema of ds_config.json as we accept it
    zero-engine ops             which fused optimizer ops can be built here, and why not
"""

from __future__ import annotations

import argparse
import json
import sys


def _schema(_args) -> int:
    from .config import json_schema

    json.dump(json_schema(), sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0


def _ops(_args) -> int:
    from .ops import op_report_text

    print(op_report_text())
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="zero-engine", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("schema", help="print the config JSON Schema").set_defaults(run=_schema)
    sub.add_parser("ops", help="report which fused optimizer ops are available").set_defaults(run=_ops)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
