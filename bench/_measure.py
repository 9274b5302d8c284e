"""Measuring a worker from the inside: resident memory (kernel peak and a psutil sampler) and bytes communicated.

[Note: two peak-RSS figures]
``VmHWM`` is the kernel's exact high-water mark of resident memory; writing "5" to /proc/self/clear_refs resets it
to the current RSS, so "peak during the measured steps" is exact, not sampled. A psutil thread sampling RSS every
few milliseconds gives a second, independent figure (it can only be lower: it misses short spikes), and the peak
of anonymous RSS, which leaves out the shared libraries' code pages. All are per process: each rank reports its
own.

[Note: why memory is measured in a process of its own]
By default glibc keeps freed heap memory for reuse, so RSS stays near the high-water mark of whatever was ever
allocated and the systems cannot be told apart (DESIGN.md). ``MALLOC_MMAP_THRESHOLD_=65536`` makes every
allocation of 64 KiB or more its own mapping, unmapped on free, so RSS tracks the live tensors; it also slows
allocation down, which is why time is measured in another process with the default allocator. Switching in the
middle of a process (``mallopt(M_MMAP_THRESHOLD)`` + ``malloc_trim(0)`` after the timed steps) is NOT equivalent:
glibc keeps serving requests from the free heap chunks it already holds, which are then kept again on free. Tried
on the 100m model at world 2: peak RSS 0.13 GB (DDP) and 0.85 GB (ZeRO-3) above a process started with the
variable. Hence two processes per configuration.

[Note: counting communication with the profiler]
DDP reduces gradients from C++ (its Reducer), FSDP2 and DeepSpeed through torch.distributed from Python, zero_engine
through its own communicator. The one place all of them pass is the c10d dispatcher: every collective is an op such
as ``c10d::allreduce_`` or ``c10d::_allgather_base_`` that the torch profiler records with its argument shapes. So
one profiled step, parsed here, counts every system the same way, with zero_engine's convention (all-gather: output
bytes; reduce-scatter: input bytes; all-reduce and broadcast: the tensor). For zero_engine the result is
cross-checked against its own counters.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import threading
import time

_ELEMENT_BYTES = {"float": 4, "double": 8, "c10::Half": 2, "c10::BFloat16": 2, "long int": 8, "int": 4,
                  "signed char": 1, "unsigned char": 1, "bool": 1, "short int": 2}


# ---- resident memory -------------------------------------------------------------------------------------------
def _status_kib(key: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def rss_bytes() -> int:
    kib = _status_kib("VmRSS")
    if kib is not None:
        return kib * 1024
    import psutil

    return psutil.Process().memory_info().rss


def rss_peak_bytes() -> int | None:
    """The kernel's peak RSS since process start or the last ``reset_rss_peak()`` (None where not available)."""
    kib = _status_kib("VmHWM")
    return None if kib is None else kib * 1024


def reset_rss_peak() -> bool:
    """See [Note: two peak-RSS figures]. False where the kernel does not allow it (the figure is then lifetime)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class RssSampler:
    """A daemon thread that keeps the largest RSS, and the largest anonymous RSS, seen since the last ``reset()``.

    Anonymous RSS (``RssAnon``) leaves out file-backed pages, i.e. the shared libraries' code that each process
    pages in as it first runs an operator: it is the memory the data (tensors, buffers, Python objects) takes.
    The kernel keeps no peak for it, hence the sampling.
    """

    def __init__(self, interval_s: float = 0.003):
        self._interval_s = interval_s
        self._peak = self._peak_anon = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def start(self) -> "RssSampler":
        self._thread.start()
        return self

    @staticmethod
    def _read() -> tuple[int, int]:
        rss = _status_kib("VmRSS")
        anon = _status_kib("RssAnon")
        if rss is None:
            import psutil

            return psutil.Process().memory_info().rss, 0
        return rss * 1024, (anon or 0) * 1024

    def _run(self) -> None:
        while not self._stop.is_set():
            rss, anon = self._read()
            self._peak, self._peak_anon = max(self._peak, rss), max(self._peak_anon, anon)
            time.sleep(self._interval_s)

    def reset(self) -> None:
        self._peak, self._peak_anon = self._read()

    @property
    def peak(self) -> int:
        return max(self._peak, self._read()[0])

    @property
    def peak_anon(self) -> int:
        return max(self._peak_anon, self._read()[1])

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=1.0)


# ---- communication ---------------------------------------------------------------------------------------------
def _numel(dims, is_list: bool) -> int:
    """Elements in one profiler 'Input Dims' entry: a shape (``[]`` is a scalar), or for a tensor-list argument a
    (possibly nested) list of shapes."""
    if not is_list:
        return math.prod(dims)
    return sum(math.prod(d) if all(isinstance(n, int) for n in d) else _numel(d, True) for d in dims)


def _kind(op_name: str) -> str | None:
    name = op_name.removeprefix("c10d::").lower()
    if "barrier" in name or "monitored" in name:
        return None
    if "allgather" in name or "all_gather" in name:
        return "all_gather"
    if "reduce_scatter" in name:
        return "reduce_scatter"
    if "allreduce" in name or "all_reduce" in name:
        return "all_reduce"
    if "broadcast" in name:
        return "broadcast"
    if "alltoall" in name or "all_to_all" in name:
        return "all_to_all"
    return "other"


def _range_of(ranges: dict, event: dict) -> tuple | None:
    """The (start, end) of the range in ``ranges`` (by thread) that holds ``event``, or None."""
    start = event.get("ts", 0)
    return next(((lo, hi) for lo, hi in ranges.get(event.get("tid"), ()) if lo <= start < hi), None)


def _split_sizes(args: dict, index: int) -> list[int]:
    """An all-to-all's split sizes (argument ``index``) as the trace's "Concrete Inputs" spell them ("[0, 6]"); []
    when equal (not given)."""
    concrete = args.get("Concrete Inputs", [])
    text = concrete[index] if len(concrete) > index else ""
    return [int(n) for n in text.strip("[]").split(",") if n.strip()] if text.startswith("[") else []


# zero_engine's collectives as its communicator names their profiler ranges ("zero3::<kind> <name>"), which on gloo
# may run as another collective (comm/_backend.py's Notes)
_RANGED_KINDS = ("all_gather", "reduce_scatter")


def collectives_from_trace(trace: dict, default_element_bytes: int) -> dict[str, dict[str, int]]:
    """{"all_gather": {"calls", "bytes"}, ...} from a chrome trace; see [Note: counting communication ...]. On gloo
    zero_engine runs an all-gather as an all-to-all, and a reduce-scatter as an all-to-all or an all-reduce in place
    (comm/_backend.py's Notes): a collective inside its "zero3::all_gather ..." or "zero3::reduce_scatter ..." range
    is counted as the collective it is (an all-gather's output bytes, a reduce-scatter's input bytes). At world 2
    those all-to-alls send nothing to the rank itself (split sizes [0, n] or [n, 0]): the logical size is then n
    times the number of ranks. Above world 2 a gather may run as a send and a receive per peer ([Note: gloo's gathers
    as sends and receives]): the range is then one all-gather, whose bytes are its receives' and as much again for
    this rank's own row (each receive is one row); its sends add nothing."""
    counts: dict[str, dict[str, int]] = {}
    peer_gathers: set = set()  # (thread, range) of the all-gathers run as sends and receives, counted once
    ranges: dict[str, dict] = {kind: {} for kind in _RANGED_KINDS}
    for e in trace.get("traceEvents", []):
        kind = e.get("name", "").split(" ", 1)[0].removeprefix("zero3::")  # "zero3::all_gather <its name>"
        if kind in ranges:
            start = e.get("ts", 0)
            ranges[kind].setdefault(e.get("tid"), []).append((start, start + e.get("dur", 0)))
    events = sorted((e for e in trace.get("traceEvents", []) if e.get("name", "").startswith("c10d::")),
                    key=lambda e: (e.get("tid"), e.get("ts", 0)))
    open_until: dict = {}  # tid -> end of the last counted op: a c10d op nested inside another is not a new one
    for event in events:
        name = event["name"]
        start, end = event.get("ts", 0), event.get("ts", 0) + event.get("dur", 0)
        if start < open_until.get(event.get("tid"), float("-inf")):
            continue
        op = _kind(name)
        if op is None:
            continue
        kind, held_by = op, None
        for ranged in _RANGED_KINDS:
            held_by = _range_of(ranges[ranged], event)
            if held_by is not None:
                kind = ranged
                break
        point_to_point = kind == "all_gather" and name in ("c10d::send", "c10d::recv_")
        if point_to_point and name == "c10d::send":
            continue
        args = event.get("args", {})
        dims = args.get("Input Dims", [])
        types = args.get("Input type", [])
        # all-gather is counted by its output (arg 0), reduce-scatter and all-to-all by their input (arg 1), the
        # rest by arg 0 (an all-reduce's tensor: a reduce-scatter's input when it runs one). An all-to-all that
        # runs an all-gather has the gathered size as its input (the shard repeated) or, at world 2, the shard.
        index = 1 if op in ("reduce_scatter", "all_to_all") else 0
        if len(dims) <= index:
            continue
        arg_type = types[index] if len(types) > index else ""
        # Tensor lists carry no dtype in the trace: count them at the run's element size.
        element_bytes = _ELEMENT_BYTES.get(arg_type, default_element_bytes)
        numel = _numel(dims[index], is_list=arg_type.endswith("List"))
        splits = _split_sizes(args, 4) if op == "all_to_all" and kind != op else []
        if splits:  # world 2's: this rank's chunk was not sent
            numel = max(splits) * len(splits)
        open_until[event.get("tid")] = end
        entry = counts.setdefault(kind, {"calls": 0, "bytes": 0})
        if point_to_point:  # one receive of the gather: a peer's row
            if (event.get("tid"), held_by) not in peer_gathers:  # its first: the call, and this rank's own row
                peer_gathers.add((event.get("tid"), held_by))
                entry["calls"] += 1
                entry["bytes"] += numel * element_bytes
            entry["bytes"] += numel * element_bytes
            continue
        entry["calls"] += 1
        entry["bytes"] += numel * element_bytes
    return counts


def profile_collectives(run_step, default_element_bytes: int):
    """Run ``run_step()`` under the torch profiler; return (its result, the collectives it issued)."""
    import torch

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        result = run_step()
    fd, path = tempfile.mkstemp(suffix=".json", prefix="bench-trace-")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    finally:
        os.unlink(path)
    return result, collectives_from_trace(trace, default_element_bytes)
