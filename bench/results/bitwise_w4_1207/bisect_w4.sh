#!/bin/bash
# exit 0 if the commit checked out in /work/wtb gives 37c9629's world-4 demo losses (16 steps), 1 otherwise
cd /work/wtb || exit 125
PYTHONPATH=/work/wtb OMP_NUM_THREADS=1 timeout 900 .venv/bin/python -m torch.distributed.run --standalone \
  --nproc_per_node 4 examples/train_gpt.py --config examples/configs/zero3.json --steps 16 \
  --losses /tmp/bitwise/bisect.json > /tmp/bitwise/bisect.log 2>&1 || exit 125
cmp -s /tmp/bitwise/bisect.json /tmp/bitwise/ref16.json
