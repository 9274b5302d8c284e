"""Read and write bandwidth of the NVMe offload store against `dd` on the same directory, in one run.

    python bench/offload_io.py                                   # /tmp, 256 MiB, 1 MiB blocks, 3 repeats (< 1 min)
    python bench/offload_io.py --dir /local_nvme --mib 1024 --block-kib 1024 --threads 1 2 4
    python bench/offload_io.py --checksum both                   # the cost of aio.checksum: stores with it on and off

For each repeat, interleaved so that the disk's and the machine's state hit both alike:
- `dd if=/dev/zero of=F bs=<block> count=<n> oflag=direct` then `dd if=F of=/dev/null bs=<block> iflag=direct`
  (O_DIRECT both ways, as the store; dd's own report is not parsed: the whole command is timed);
- ``NvmeStore.write`` of a tensor of the same size from an aligned buffer, ``wait()``, then ``read`` into an aligned
  buffer, ``wait()`` (``block_size`` = the same block, ``thread_count`` as given).
Prints the median MiB/s of each and the ratio store ÷ dd (issue 13's goal: >= 0.7). The page cache is bypassed by
both when the file system accepts O_DIRECT (the store says so in `direct`); on tmpfs both are memory copies.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from zero_engine.offload.nvme import NvmeStore  # noqa: E402

MIB = 1 << 20


def dd_pass(directory: str, nbytes: int, block: int) -> tuple[float, float]:
    path = os.path.join(directory, f"dd-bench-{os.getpid()}")
    count = nbytes // block
    try:
        start = time.perf_counter()
        subprocess.run(["dd", "if=/dev/zero", f"of={path}", f"bs={block}", f"count={count}", "oflag=direct"],
                       check=True, capture_output=True)
        write = time.perf_counter() - start
        start = time.perf_counter()
        subprocess.run(["dd", f"if={path}", "of=/dev/null", f"bs={block}", "iflag=direct"], check=True,
                       capture_output=True)
        read = time.perf_counter() - start
    finally:
        if os.path.exists(path):
            os.unlink(path)
    return nbytes / write / MIB, nbytes / read / MIB


def store_pass(store: NvmeStore, nbytes: int) -> tuple[float, float]:
    data = store.aligned_empty(nbytes // 4, torch.float32)
    data.uniform_()  # touched before timing: the page faults are not the disk's
    back = store.aligned_empty(nbytes // 4, torch.float32)
    back.zero_()
    start = time.perf_counter()
    store.write("bench", data).wait()
    write = time.perf_counter() - start
    start = time.perf_counter()
    store.read("bench", back).wait()
    read = time.perf_counter() - start
    assert torch.equal(back, data), "read back differs from what was written"
    return nbytes / write / MIB, nbytes / read / MIB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="directory to test (default: %(default)s)")
    parser.add_argument("--mib", type=int, default=256, help="bytes per transfer, MiB")
    parser.add_argument("--block-kib", type=int, default=1024, help="block size, KiB (dd bs= and aio block_size)")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="store thread_count values")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--checksum", choices=["on", "off", "both"], default="on",
                        help="aio.checksum of the stores (both: a store of each, interleaved)")
    args = parser.parse_args()
    nbytes, block = args.mib * MIB, args.block_kib * 1024
    checksums = {"on": [True], "off": [False], "both": [False, True]}[args.checksum]
    stores = {f"store t{t}" + ("" if args.checksum != "both" else f", checksum {'on' if c else 'off'}"):
              NvmeStore(args.dir, rank=0, purpose=f"bench-t{t}-{c}", block_size=block, thread_count=t, checksum=c)
              for t in args.threads for c in checksums}
    results: dict[str, list[tuple[float, float]]] = {"dd": [], **{name: [] for name in stores}}
    for _ in range(args.repeats):
        results["dd"].append(dd_pass(args.dir, nbytes, block))
        for name, store in stores.items():
            results[name].append(store_pass(store, nbytes))
    direct = next(iter(stores.values())).direct
    for store in stores.values():
        store.close()
    dd_write = statistics.median(w for w, _ in results["dd"])
    dd_read = statistics.median(r for _, r in results["dd"])
    print(f"{args.dir}: {args.mib} MiB per transfer, {args.block_kib} KiB blocks, {args.repeats} repeats, "
          f"O_DIRECT {'on' if direct else 'off (file system refuses it)'}; medians\n")
    print("| path | write MiB/s | read MiB/s | write ÷ dd | read ÷ dd |")
    print("|---|---|---|---|---|")
    for name, runs in results.items():
        write = statistics.median(w for w, _ in runs)
        read = statistics.median(r for _, r in runs)
        print(f"| {name} | {write:,.0f} | {read:,.0f} | {write / dd_write:.2f} | {read / dd_read:.2f} |")


if __name__ == "__main__":
    main()
