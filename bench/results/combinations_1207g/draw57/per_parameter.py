"""seed 97 draw 57: the L2 distance per parameter of save_16bit_model's file against stage 0's (docs/benchmarks.md,
combinations round twelve)."""
import sys
sys.path.insert(0, "bench")
import combinations as c
draw = c.given_draw(open(sys.argv[1]).read())
if __name__ == "__main__":
    ref = c.stage_0_of(draw)
    steps = 5
    world = c.reshard_world(draw)
    _, _, w16 = c.run_resharded(draw, steps, world)
    _, _, r16 = c.run_resharded(ref, steps, world // c.TP if draw["tp"] else world)
    rows = []
    for n in r16:
        a, b = w16[n].float(), r16[n].float()
        d = (a - b).pow(2).sum().sqrt().item()
        rows.append((d, n, tuple(b.shape), b.norm().item(), (a - b).abs().max().item(), (a != b).sum().item()))
    rows.sort(reverse=True)
    tot = sum(r16[n].float().pow(2).sum() for n in r16).sqrt().item()
    print("total ref norm", tot)
    for r in rows[:12]:
        print("%.3e %s %s norm %.3e maxabs %.3e ndiff %d" % r)
    torch = c.torch
    n = "blocks.0.attn.qkv.bias"
    a, b = w16[n].float(), r16[n].float()
    torch.set_printoptions(precision=6, linewidth=150, sci_mode=True)
    for part, sl in (("q", slice(0, 33)), ("k", slice(33, 66)), ("v", slice(66, 99))):
        print(part, "ours", a[sl][:8])
        print(part, "ref ", b[sl][:8])
        print(part, "ndiff", (a[sl] != b[sl]).sum().item())
