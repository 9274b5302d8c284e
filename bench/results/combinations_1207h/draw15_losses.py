"""Round thirteen's draw 15 again, printing its worst loss against stage 0's (a record, not a maintained tool).

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python bench/results/combinations_1207h/draw15_losses.py
    -> worst relative, loss, stage 0's: (0.013888888888888888, 4.4375, 4.5)
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))

if __name__ == "__main__":  # the rank pool starts its processes by forkserver: the main module must be importable
    sys.path.insert(0, os.path.join(HERE, "..", ".."))
    import combinations

    judged = combinations.largest_relative_difference

    def printed(losses, reference):
        pairs = [(a, b) for mine, theirs in zip(losses, reference) for a, b in zip(mine, theirs)]
        worst = max((abs(a - b) / abs(b), a, b) for a, b in pairs)
        print("worst relative, loss, stage 0's:", worst, flush=True)
        return judged(losses, reference)

    combinations.largest_relative_difference = printed
    with open(os.path.join(HERE, "draw15.json")) as f:
        sys.argv = ["combinations.py", "--draw", f.read()]
    sys.exit(combinations.main())
