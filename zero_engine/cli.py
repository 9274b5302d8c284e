"""The ``zero-engine`` command: small tools around the runtime.

    zero-engine schema          print the JSON Schema of ds_config.json as we accept it (--path: the shipped file)
    zero-engine ops             which fused optimizer ops can be built here, and why not (--build: build them)
    zero-engine estimate        per-rank memory of model states per ZeRO stage and precision
    zero-engine plot            draw memory timelines (zero_engine.memory_timeline) into a PNG
    zero-engine to-fp32         a sharded checkpoint as one fp32 state dict (torch or safetensors file), offline
    zero-engine convert         a checkpoint to or from torch.distributed.checkpoint (FSDP2, torchtitan), offline
"""

from __future__ import annotations

import argparse
import json
import sys


def _schema(args) -> int:
    from .config import json_schema, schema_file

    if args.path:
        print(schema_file())
        return 0
    json.dump(json_schema(), sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0


def _ops(args) -> int:
    from .ops import op_report, op_report_text

    rows = op_report(build=args.build)
    print(op_report_text(rows=rows))
    # With --build the exit status says whether the CPU kernel built (scripts and CI can rely on it).
    return 1 if args.build and not next(row for row in rows if row.name == "cpu_adam").available else 0


def _plot(args) -> int:
    from .memory.timeline import plot_timelines

    print(plot_timelines(args.timelines, args.output))
    return 0


def _count(text: str) -> int:
    """A parameter count as written by people: 7000000000, 7_000_000_000 or 7e9."""
    try:
        value = float(text.replace("_", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r} (write e.g. 7e9 or 7_000_000_000)") from None
    if value != int(value) or value < 0:
        raise argparse.ArgumentTypeError(f"not a whole non-negative count: {text!r}")
    return int(value)


def _estimate(args) -> int:
    from .memory.estimator import estimate_from_counts, estimate_zero3_model_states_mem_needs_all_live

    if (args.model is None) == (args.params is None):
        raise SystemExit("zero-engine estimate: give a model (pkg.module:factory) or --params N --largest-layer M")
    zero_config = None
    if args.config is not None:
        from .config import load_config

        zero_config = load_config(args.config, world_size=args.ranks_per_node * args.nodes).zero_optimization
    common = dict(num_ranks_per_node=args.ranks_per_node, num_nodes=args.nodes, zero_config=zero_config,
                  offload_optimizer=args.offload_optimizer, offload_param=args.offload_param)
    if args.params is not None:
        if args.largest_layer is None:
            raise SystemExit("zero-engine estimate: --params needs --largest-layer (the most parameters one "
                             "module owns; it bounds the ZeRO-3 gathered working set)")
        estimate_from_counts(args.params, args.largest_layer, **common)
        return 0
    model = _factory_model(args.model, "estimate")  # on the meta device: a 70B model costs no memory here
    estimate_zero3_model_states_mem_needs_all_live(model, **common)
    return 0


def _to_fp32(args) -> int:
    from .checkpoint import CheckpointError, convert_zero_checkpoint_to_fp32_state_dict

    try:
        result = convert_zero_checkpoint_to_fp32_state_dict(args.checkpoint_dir, args.output, tag=args.tag,
                                                            fmt=args.format, verify=not args.no_verify)
    except (CheckpointError, NotImplementedError) as error:  # NotImplementedError: a tensor-parallel checkpoint
        raise SystemExit(f"zero-engine to-fp32: {error}") from None
    print(f"wrote {result.path}: {result.tensors} tensors, {result.nbytes / 2**20:.1f} MiB ({result.format})")
    return 0


def _factory_model(spec: str, command: str):
    """The model ``pkg.module:factory`` names, built on the meta device (shapes only, no memory)."""
    import importlib

    import torch

    module_name, _, factory_name = spec.partition(":")
    if not module_name or not factory_name:
        raise SystemExit(f"zero-engine {command}: model {spec!r} must look like pkg.module:factory")
    sys.path.insert(0, "")  # as `python -m` does: modules of the current directory can be named
    factory = getattr(importlib.import_module(module_name), factory_name)
    with torch.device("meta"):
        return factory()


def _convert(args) -> int:
    import os

    from .checkpoint import CheckpointError, from_dcp, to_dcp

    try:
        if os.path.isfile(os.path.join(args.source, ".metadata")):  # a DCP directory: into ours
            if args.config is None:
                raise SystemExit("zero-engine convert: converting a DCP checkpoint needs --config (the ds_config "
                                 "of the run that will load it: its stage, dtype and gradient accumulation)")
            model = _factory_model(args.model, "convert") if args.model else None
            path = from_dcp(args.source, args.destination, args.config, tag=args.tag, model=model,
                            world_size=args.world_size)
        else:
            path = to_dcp(args.source, args.destination, tag=args.tag, layout=args.layout)
    except (CheckpointError, NotImplementedError) as error:  # NotImplementedError: a tensor-parallel checkpoint
        raise SystemExit(f"zero-engine convert: {error}") from None
    print(f"wrote {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="zero-engine", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    schema = sub.add_parser("schema", help="print the config JSON Schema")
    schema.add_argument("--path", action="store_true", help="print where the installed package keeps the schema file "
                        "instead (to point an editor at it)")
    schema.set_defaults(run=_schema)
    ops = sub.add_parser("ops", help="report which fused optimizer ops are available")
    ops.add_argument("--build", action="store_true", help="build (or load from the cache) each op that can be "
                     "built here, so compiler errors show too; exit status 1 when cpu_adam does not build")
    ops.set_defaults(run=_ops)
    est = sub.add_parser("estimate", help="per-rank memory of model states per ZeRO stage and precision")
    est.add_argument("model", nargs="?", help="pkg.module:factory, called with no arguments on the meta device")
    est.add_argument("--params", type=_count, help="total parameters (instead of a model)")
    est.add_argument("--largest-layer", type=_count, help="parameters of the largest module (with --params)")
    est.add_argument("--ranks-per-node", type=int, default=1, help="ranks (GPUs) per node (default 1)")
    est.add_argument("--nodes", type=int, default=1, help="nodes (default 1)")
    est.add_argument("--config", help="ds_config.json whose zero_optimization sets the stage-3 gather policy "
                     "(default: DeepSpeed's defaults)")
    est.add_argument("--offload-optimizer", choices=("none", "cpu", "nvme"),
                     help="where masters and optimizer states live (default: the config's, else none); adds "
                     "device / host / nvme columns")
    est.add_argument("--offload-param", choices=("none", "cpu", "nvme"),
                     help="where stage-3 parameter shards live (default: the config's, else none)")
    est.set_defaults(run=_estimate)
    fp32 = sub.add_parser("to-fp32", help="consolidate a sharded checkpoint into one fp32 state dict, offline")
    fp32.add_argument("checkpoint_dir", help="the directory given to save_checkpoint (or one checkpoint in it)")
    fp32.add_argument("output", help="file to write; a .safetensors name writes safetensors, any other torch.save")
    fp32.add_argument("--tag", help="checkpoint to convert (default: the one named by `latest`)")
    fp32.add_argument("--format", choices=("torch", "safetensors"), help="override the choice by file name")
    fp32.add_argument("--no-verify", action="store_true", help="skip checking every file's SHA-256 first")
    fp32.set_defaults(run=_to_fp32)
    conv = sub.add_parser("convert", help="convert between our checkpoints and torch.distributed.checkpoint "
                          "directories (FSDP2, torchtitan), offline, either direction")
    conv.add_argument("source", help="a DCP directory (holding .metadata), or a directory given to save_checkpoint")
    conv.add_argument("destination", help="for a DCP source: the save_dir to write our checkpoint into (and "
                      "`latest`); otherwise: the new DCP directory")
    conv.add_argument("--config", help="DCP -> ours: the ds_config.json of the run that will load it")
    conv.add_argument("--model", help="DCP -> ours: pkg.module:factory building the model (on the meta device), "
                      "to tell buffers and tied names from parameters")
    conv.add_argument("--world-size", type=int, default=1, help="DCP -> ours: rank files to write (any world size "
                      "loads them; default 1)")
    conv.add_argument("--tag", help="DCP -> ours: the tag to write (default global_step<N>); ours -> DCP: the "
                      "checkpoint to convert (default: the one named by `latest`)")
    conv.add_argument("--layout", choices=("fsdp2", "torchtitan"), default="fsdp2",
                      help="ours -> DCP: key layout to write (default fsdp2: model.* and optim.*)")
    conv.set_defaults(run=_convert)
    plot = sub.add_parser("plot", help="draw memory timeline files (one panel each) into a PNG")
    plot.add_argument("timelines", nargs="+", help="*.rankN.jsonl files written by memory_timeline")
    plot.add_argument("-o", "--output", default="memory_timeline.png")
    plot.set_defaults(run=_plot)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
