"""zero_engine.schedulers against DeepSpeed's own schedules.

[Note: how REFERENCE was produced]
REFERENCE holds the learning rates DeepSpeed 0.19.8 itself gives (deepspeed.runtime.lr_schedules, CPU torch 2.13.0,
installed with DS_BUILD_OPS=0 into a throwaway venv, never a dependency of this project). For each entry of CASES,
with the same param groups and params: build the DeepSpeed scheduler on torch.optim.SGD, record every group's lr,
then 30 times call scheduler.step() and record again; stored per param group, as repr() of the floats:

    groups = [{"params": [torch.nn.Parameter(torch.zeros(1))], "lr": lr} for lr in group_lrs]
    opt = torch.optim.SGD(groups, lr=group_lrs[0])
    sched = Cls(opt, **params)          # Cls from deepspeed.runtime.lr_schedules
    seq = [[g["lr"] for g in opt.param_groups]]
    for _ in range(30):
        sched.step()
        seq.append([g["lr"] for g in opt.param_groups])

Index k of a sequence is the lr after k step() calls (k = 0: at construction), i.e. DeepSpeed's
last_batch_iteration = k - 1. The cases run past warmup_num_steps and total_num_steps so every branch is covered.
"""

import io
import logging
import math

import pytest
import torch

from zero_engine.errors import ConfigError
from zero_engine.schedulers import WarmupCosineLR, WarmupDecayLR, WarmupLR, build_scheduler

NUM_STEPS = 30

# name: (ds_config scheduler type, lr of each param group, scheduler params)
CASES = {
    "warmup_log": ("WarmupLR", [0.5],
                   dict(warmup_min_lr=0.001, warmup_max_lr=0.01, warmup_num_steps=10, warmup_type="log")),
    "warmup_linear": ("WarmupLR", [0.5],
                      dict(warmup_min_lr=0.001, warmup_max_lr=0.01, warmup_num_steps=10, warmup_type="linear")),
    # No warmup_max_lr: each group warms up to its own lr; one warmup_min_lr per group.
    "warmup_groups": ("WarmupLR", [0.1, 0.02],
                      dict(warmup_min_lr=[0.0, 0.002], warmup_num_steps=7, warmup_type="linear")),
    # warmup_num_steps=1 acts as 2 (ln 1 = 0 would divide by zero).
    "warmup_one_step": ("WarmupLR", [0.5],
                        dict(warmup_min_lr=0.0, warmup_max_lr=0.01, warmup_num_steps=1, warmup_type="log")),
    "decay_log": ("WarmupDecayLR", [0.5],
                  dict(total_num_steps=25, warmup_min_lr=0.001, warmup_max_lr=0.01, warmup_num_steps=8,
                       warmup_type="log")),
    "decay_linear": ("WarmupDecayLR", [0.5],
                     dict(total_num_steps=25, warmup_min_lr=0.001, warmup_max_lr=0.01, warmup_num_steps=8,
                          warmup_type="linear")),
    # DeepSpeed's WarmupDecayLR defaults warmup_max_lr to 0.001, not to the optimizer's lr.
    "decay_default_max": ("WarmupDecayLR", [0.5], dict(total_num_steps=20, warmup_num_steps=5)),
    "cosine_log": ("WarmupCosineLR", [0.1, 0.03],
                   dict(total_num_steps=25, warmup_min_ratio=0.1, warmup_num_steps=8, cos_min_ratio=0.05,
                        warmup_type="log")),
    "cosine_linear": ("WarmupCosineLR", [0.1, 0.03],
                      dict(total_num_steps=25, warmup_min_ratio=0.1, warmup_num_steps=8, cos_min_ratio=0.05,
                           warmup_type="linear")),
    "cosine_defaults": ("WarmupCosineLR", [0.2], dict(total_num_steps=30, warmup_num_steps=6)),
}

REFERENCE = {
    "warmup_log": [
        [0.001, 0.001, 0.0037092699609758304, 0.005294091292476962, 0.006418539921951661, 0.007290730039024168,
         0.008003361253452792, 0.008605882360128311, 0.009127809882927492, 0.009588182584953923, 0.009999999999999998,
         0.010000000000000002, 0.010000000000000002, 0.010000000000000002, 0.010000000000000002, 0.010000000000000002,
         0.010000000000000002, 0.010000000000000002, 0.010000000000000002, 0.010000000000000002, 0.010000000000000002,
         0.010000000000000002, 0.010000000000000002, 0.010000000000000002, 0.010000000000000002, 0.010000000000000002,
         0.010000000000000002, 0.010000000000000002, 0.010000000000000002, 0.010000000000000002,
         0.010000000000000002],
    ],
    "warmup_linear": [
        [0.001, 0.001, 0.0019000000000000002, 0.0028000000000000004, 0.0037, 0.004600000000000001,
         0.0055000000000000005, 0.0064, 0.0073, 0.008200000000000002, 0.0091, 0.010000000000000002,
         0.010000000000000002, 0.010000000000000002, 0.010000000000000002, 0.010000000000000002, 0.010000000000000002,
         0.010000000000000002, 0.010000000000000002, 0.010000000000000002, 0.010000000000000002, 0.010000000000000002,
         0.010000000000000002, 0.010000000000000002, 0.010000000000000002, 0.010000000000000002, 0.010000000000000002,
         0.010000000000000002, 0.010000000000000002, 0.010000000000000002, 0.010000000000000002],
    ],
    "warmup_groups": [
        [0.0, 0.0, 0.014285714285714285, 0.02857142857142857, 0.04285714285714286, 0.05714285714285714,
         0.07142857142857144, 0.08571428571428572, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1,
         0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1],
        [0.002, 0.002, 0.004571428571428572, 0.0071428571428571435, 0.009714285714285715, 0.012285714285714287,
         0.014857142857142859, 0.017428571428571432, 0.020000000000000004, 0.020000000000000004, 0.020000000000000004,
         0.020000000000000004, 0.020000000000000004, 0.020000000000000004, 0.020000000000000004, 0.020000000000000004,
         0.020000000000000004, 0.020000000000000004, 0.020000000000000004, 0.020000000000000004, 0.020000000000000004,
         0.020000000000000004, 0.020000000000000004, 0.020000000000000004, 0.020000000000000004, 0.020000000000000004,
         0.020000000000000004, 0.020000000000000004, 0.020000000000000004, 0.020000000000000004,
         0.020000000000000004],
    ],
    "warmup_one_step": [
        [0.0, 0.0, 0.01, 0.01, 0.01, 0.01, 0.01, 0.01, 0.01, 0.01, 0.01, 0.01, 0.01, 0.01, 0.01, 0.01, 0.01, 0.01,
         0.01, 0.01, 0.01, 0.01, 0.01, 0.01, 0.01, 0.01, 0.01, 0.01, 0.01, 0.01, 0.01],
    ],
    "decay_log": [
        [0.001, 0.001, 0.004, 0.00575488750216347, 0.007000000000000001, 0.007965784284662087, 0.00875488750216347,
         0.009422064766172814, 0.010000000000000002, 0.010000000000000002, 0.00947058823529412, 0.008941176470588237,
         0.008411764705882355, 0.00788235294117647, 0.007352941176470589, 0.006823529411764707, 0.006294117647058824,
         0.005764705882352942, 0.005235294117647059, 0.004705882352941177, 0.0041764705882352945,
         0.003647058823529412, 0.0031176470588235297, 0.0025882352941176473, 0.002058823529411765,
         0.0015294117647058824, 0.001, 0.001, 0.001, 0.001, 0.001],
    ],
    "decay_linear": [
        [0.001, 0.001, 0.002125, 0.0032500000000000003, 0.004375, 0.0055000000000000005, 0.006625000000000001,
         0.007750000000000001, 0.008875000000000001, 0.010000000000000002, 0.00947058823529412, 0.008941176470588237,
         0.008411764705882355, 0.00788235294117647, 0.007352941176470589, 0.006823529411764707, 0.006294117647058824,
         0.005764705882352942, 0.005235294117647059, 0.004705882352941177, 0.0041764705882352945,
         0.003647058823529412, 0.0031176470588235297, 0.0025882352941176473, 0.002058823529411765,
         0.0015294117647058824, 0.001, 0.001, 0.001, 0.001, 0.001],
    ],
    "decay_default_max": [
        [0.0, 0.0, 0.00043067655807339306, 0.0006826061944859854, 0.0008613531161467861, 0.001, 0.001,
         0.0009333333333333333, 0.0008666666666666667, 0.0008, 0.0007333333333333333, 0.0006666666666666666, 0.0006,
         0.0005333333333333334, 0.00046666666666666666, 0.0004, 0.0003333333333333333, 0.0002666666666666667, 0.0002,
         0.00013333333333333334, 6.666666666666667e-05, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
    ],
    "cosine_log": [
        [0.0, 0.010000000000000002, 0.04000000000000001, 0.05754887502163469, 0.07, 0.07965784284662086,
         0.08754887502163469, 0.09422064766172812, 0.1, 0.09919122223498535, 0.0967924308967069, 0.09288531394715668,
         0.08760292356798131, 0.08112514522801469, 0.07367257189938557, 0.06549899202842395, 0.05688274707450685,
         0.048117252925493154, 0.03950100797157607, 0.03132742810061444, 0.023874854771985327, 0.0173970764320187,
         0.012114686052843335, 0.008207569103293106, 0.0058087777650146655, 0.005000000000000001,
         0.005000000000000001, 0.005000000000000001, 0.005000000000000001, 0.005000000000000001,
         0.005000000000000001],
        [0.0, 0.003, 0.012, 0.01726466250649041, 0.021, 0.023897352853986257, 0.026264662506490406,
         0.028266194298518434, 0.03, 0.0297573666704956, 0.029037729269012068, 0.027865594184147004,
         0.02628087707039439, 0.024337543568404403, 0.022101771569815673, 0.01964969760852718, 0.01706482412235205,
         0.014435175877647945, 0.011850302391472818, 0.00939822843018433, 0.007162456431595598, 0.005219122929605609,
         0.0036344058158530004, 0.0024622707309879316, 0.0017426333295043994, 0.0015, 0.0015, 0.0015, 0.0015, 0.0015,
         0.0015],
    ],
    "cosine_linear": [
        [0.0, 0.010000000000000002, 0.021250000000000005, 0.0325, 0.043750000000000004, 0.05500000000000001, 0.06625,
         0.07750000000000001, 0.08875, 0.09919122223498535, 0.0967924308967069, 0.09288531394715668,
         0.08760292356798131, 0.08112514522801469, 0.07367257189938557, 0.06549899202842395, 0.05688274707450685,
         0.048117252925493154, 0.03950100797157607, 0.03132742810061444, 0.023874854771985327, 0.0173970764320187,
         0.012114686052843335, 0.008207569103293106, 0.0058087777650146655, 0.005000000000000001,
         0.005000000000000001, 0.005000000000000001, 0.005000000000000001, 0.005000000000000001,
         0.005000000000000001],
        [0.0, 0.003, 0.0063750000000000005, 0.00975, 0.013125, 0.0165, 0.019875, 0.02325, 0.026625,
         0.0297573666704956, 0.029037729269012068, 0.027865594184147004, 0.02628087707039439, 0.024337543568404403,
         0.022101771569815673, 0.01964969760852718, 0.01706482412235205, 0.014435175877647945, 0.011850302391472818,
         0.00939822843018433, 0.007162456431595598, 0.005219122929605609, 0.0036344058158530004,
         0.0024622707309879316, 0.0017426333295043994, 0.0015, 0.0015, 0.0015, 0.0015, 0.0015, 0.0015],
    ],
    "cosine_defaults": [
        [0.0, 0.0, 0.0773705614469083, 0.12262943855309168, 0.1547411228938166, 0.1796488803407854,
         0.19999999999999998, 0.1991445716887673, 0.19659292337064393, 0.19238871445580358, 0.18660388012440604,
         0.1793374004957206, 0.1707136070508429, 0.160880055286582, 0.150005, 0.13827451640218533,
         0.12588931631980105, 0.113061313960083, 0.10001, 0.08695868603991708, 0.07413068368019894,
         0.06174548359781468, 0.050015000000000025, 0.03913994471341802, 0.029306392949157118, 0.02068259950427941,
         0.013416119875593975, 0.0076312855441964395, 0.0034270766293560706, 0.0008754283112327, 2e-05],
    ],
}

# Our code does the same float64 operations in the same order as DeepSpeed, so the values agree to the last bit on
# this machine; the tolerance only leaves room for another libm's last-ulp rounding of log/cos. Any formula or
# off-by-one-step error is many orders of magnitude larger.
REL_TOL = 1e-13


def make_optimizer(group_lrs):
    groups = [{"params": [torch.nn.Parameter(torch.zeros(2))], "lr": lr} for lr in group_lrs]
    return torch.optim.SGD(groups, lr=group_lrs[0])


def group_lrs(optimizer):
    return [group["lr"] for group in optimizer.param_groups]


def step(optimizer, scheduler, times=1):
    for _ in range(times):
        optimizer.step()  # as in training: optimizer first, so torch does not warn about the order
        scheduler.step()


def lr_sequence(optimizer, scheduler, num_steps=NUM_STEPS):
    """Per param group: the lr now, then after each of num_steps step() calls."""
    rows = [group_lrs(optimizer)]
    for _ in range(num_steps):
        step(optimizer, scheduler)
        rows.append(group_lrs(optimizer))
    return [list(column) for column in zip(*rows)]


def assert_lrs_close(actual, expected, what):
    assert len(actual) == len(expected), what
    for index, (a, e) in enumerate(zip(actual, expected)):
        assert math.isclose(a, e, rel_tol=REL_TOL, abs_tol=1e-300), f"{what}[{index}]: {a!r} != DeepSpeed {e!r}"


def reference_at(name, num_steps):
    """Each group's DeepSpeed lr after num_steps step() calls."""
    return [per_group[num_steps] for per_group in REFERENCE[name]]


def build_case(name):
    type_name, lrs, params = CASES[name]
    optimizer = make_optimizer(lrs)
    return optimizer, build_scheduler(type_name, params, optimizer)


@pytest.mark.parametrize("name", sorted(CASES))
def test_lr_sequence_matches_deepspeed(name):
    optimizer, scheduler = build_case(name)
    actual = lr_sequence(optimizer, scheduler)
    for group, (got, want) in enumerate(zip(actual, REFERENCE[name], strict=True)):
        assert_lrs_close(got, want, f"{name} group {group}")
    assert scheduler.get_last_lr() == group_lrs(optimizer)
    assert scheduler.last_batch_iteration == NUM_STEPS - 1


def test_reference_cases_reach_every_phase():
    # Guards the reference itself: warmup rises, decay falls to the minimum, cosine ends at cos_min_ratio.
    assert REFERENCE["warmup_log"][0][1] < REFERENCE["warmup_log"][0][5] < REFERENCE["warmup_log"][0][-1]
    assert REFERENCE["decay_linear"][0][-1] == pytest.approx(0.001)
    assert REFERENCE["cosine_log"][0][-1] == pytest.approx(0.1 * 0.05)
    assert REFERENCE["cosine_log"][1][-1] == pytest.approx(0.03 * 0.05)


def test_classes_match_build_scheduler():
    optimizer = make_optimizer([0.1, 0.03])
    direct = WarmupCosineLR(optimizer, 25, warmup_min_ratio=0.1, warmup_num_steps=8, cos_min_ratio=0.05,
                            warmup_type="linear")
    for got, want in zip(lr_sequence(optimizer, direct), REFERENCE["cosine_linear"], strict=True):
        assert_lrs_close(got, want, "WarmupCosineLR")
    assert isinstance(direct, torch.optim.lr_scheduler.LRScheduler)


def test_deepspeed_stepping_convention():
    optimizer = make_optimizer([0.5])
    scheduler = WarmupLR(optimizer, warmup_min_lr=0.001, warmup_max_lr=0.01, warmup_num_steps=10,
                         warmup_type="linear")
    # At construction DeepSpeed is at last_batch_iteration -1 and has already set warmup_min_lr.
    assert scheduler.last_batch_iteration == -1
    assert group_lrs(optimizer) == scheduler.get_last_lr() == [0.001]
    step(optimizer, scheduler)
    assert scheduler.last_batch_iteration == 0
    assert group_lrs(optimizer) == [0.001]  # i = 0 is the start of warmup, so the minimum again
    step(optimizer, scheduler)
    assert group_lrs(optimizer) == [pytest.approx(0.001 + 0.009 / 10)]

    cosine_optimizer = make_optimizer([0.2])
    cosine = WarmupCosineLR(cosine_optimizer, total_num_steps=30, warmup_min_ratio=0.5, warmup_num_steps=6)
    assert group_lrs(cosine_optimizer) == [0.0]  # DeepSpeed: ratio 0 before the first step
    assert cosine.base_lrs == [0.2]  # ... while the group's own lr is kept as the peak
    step(cosine_optimizer, cosine)
    assert group_lrs(cosine_optimizer) == [pytest.approx(0.1)]


def test_step_can_jump_to_an_iteration():
    optimizer, scheduler = build_case("decay_log")
    optimizer.step()
    scheduler.step(last_batch_iteration=19)  # DeepSpeed's optional argument
    assert scheduler.last_batch_iteration == 19
    assert_lrs_close(group_lrs(optimizer), reference_at("decay_log", 20), "after jump")
    step(optimizer, scheduler)
    assert_lrs_close(group_lrs(optimizer), reference_at("decay_log", 21), "after jump + 1")


@pytest.mark.parametrize("name", ["warmup_groups", "decay_log", "cosine_log"])
def test_state_dict_round_trip_mid_schedule(name):
    optimizer, scheduler = build_case(name)
    step(optimizer, scheduler, 12)
    buffer = io.BytesIO()
    torch.save(scheduler.state_dict(), buffer)  # what a checkpoint does
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=False)
    assert saved["last_batch_iteration"] == 11  # DeepSpeed's key, for tools that read its checkpoints

    resumed_optimizer, resumed = build_case(name)
    resumed.load_state_dict(saved)
    assert resumed.last_batch_iteration == 11
    assert resumed.get_last_lr() == scheduler.get_last_lr()
    resumed_lrs = lr_sequence(resumed_optimizer, resumed, num_steps=10)
    for group, (got, want) in enumerate(zip(resumed_lrs, REFERENCE[name], strict=True)):
        assert_lrs_close(got[1:], want[13:23], f"{name} group {group} after resume")


def test_load_deepspeed_format_state():
    optimizer, scheduler = build_case("cosine_log")
    scheduler.load_state_dict({"last_batch_iteration": 11})  # what DeepSpeed's scheduler saves
    assert scheduler.last_batch_iteration == 11
    step(optimizer, scheduler)
    assert_lrs_close(group_lrs(optimizer), reference_at("cosine_log", 13), "after DeepSpeed-format load")


def test_load_keeps_configured_schedule_and_logs_difference(caplog):
    optimizer = make_optimizer([0.5])
    old = WarmupDecayLR(optimizer, total_num_steps=25, warmup_min_lr=0.001, warmup_max_lr=0.01, warmup_num_steps=8)
    step(optimizer, old, 12)
    new_optimizer = make_optimizer([0.5])
    extended = WarmupDecayLR(new_optimizer, total_num_steps=50, warmup_min_lr=0.001, warmup_max_lr=0.01,
                             warmup_num_steps=8)
    with caplog.at_level(logging.WARNING, logger="zero_engine.schedulers"):
        extended.load_state_dict(old.state_dict())
    assert extended.total_num_steps == 50  # the config the job restarted with wins, as in DeepSpeed
    assert extended.last_batch_iteration == 11
    assert "total_num_steps=25" in caplog.text and "50" in caplog.text
    step(new_optimizer, extended)  # i = 12: (50 - 12) / (50 - 8) of the way from min to max
    assert group_lrs(new_optimizer) == [pytest.approx(0.001 + 0.009 * 38 / 42)]


def test_load_rejects_foreign_state():
    _, scheduler = build_case("warmup_log")
    with pytest.raises(ValueError, match="last_batch_iteration"):
        scheduler.load_state_dict({"step": 3})


def test_resume_through_constructor():
    optimizer, first = build_case("decay_linear")
    step(optimizer, first, 12)
    # The optimizer's groups now hold initial_lr, as after loading optimizer state from a checkpoint.
    _, _, params = CASES["decay_linear"]
    resumed = WarmupDecayLR(optimizer, last_batch_iteration=11, **params)
    assert resumed.last_batch_iteration == 11
    assert_lrs_close(group_lrs(optimizer), reference_at("decay_linear", 12), "resumed at construction")
    step(optimizer, resumed)
    assert_lrs_close(group_lrs(optimizer), reference_at("decay_linear", 13), "resumed + 1")

    with pytest.raises(ValueError, match=r"initial_lr.*last_batch_iteration=-1"):
        WarmupLR(make_optimizer([0.5]), last_batch_iteration=3)


def test_groups_with_different_base_lrs_scale_separately():
    optimizer = make_optimizer([0.1, 0.001, 0.04])
    scheduler = build_scheduler("WarmupCosineLR", {"total_num_steps": 20, "warmup_num_steps": 4}, optimizer)
    for _ in range(NUM_STEPS):
        step(optimizer, scheduler)
        lrs = group_lrs(optimizer)
        assert lrs[1] == pytest.approx(lrs[0] * 0.01) and lrs[2] == pytest.approx(lrs[0] * 0.4)

    optimizer = make_optimizer([0.1, 0.02])
    with pytest.raises(ValueError, match=r"warmup_max_lr has 3 values but the optimizer has 2 param groups"):
        WarmupLR(optimizer, warmup_max_lr=[0.1, 0.2, 0.3])


@pytest.mark.parametrize("type_name", ["warmuplr", "WARMUPLR", "WarmupLR", "warmupLR"])
def test_type_name_is_case_insensitive(type_name):
    scheduler = build_scheduler(type_name, {"warmup_max_lr": 0.01}, make_optimizer([0.5]))
    assert type(scheduler) is WarmupLR


@pytest.mark.parametrize("type_name, pattern", [
    ("WarmupLinearLR", r"'WarmupLinearLR' is not a known scheduler; supported: WarmupLR, WarmupDecayLR, "
                       r"WarmupCosineLR"),
    ("WarmupCosinLR", r"did you mean 'WarmupCosineLR'"),
    ("OneCycle", r"'OneCycle' is not supported yet; supported: WarmupLR, WarmupDecayLR, WarmupCosineLR"),
    ("StepLR", r"'StepLR' \(a torch.optim.lr_scheduler class.*not supported yet"),
    (None, r"scheduler.type must be a string"),
])
def test_unknown_type_names_it_and_lists_supported(type_name, pattern):
    with pytest.raises(ConfigError, match=pattern):
        build_scheduler(type_name, {}, make_optimizer([0.5]))


@pytest.mark.parametrize("type_name, params, pattern", [
    ("WarmupDecayLR", {"warmup_num_steps": 10}, r"scheduler.params.total_num_steps is required for WarmupDecayLR"),
    ("WarmupCosineLR", {}, r"scheduler.params.total_num_steps is required for WarmupCosineLR"),
    # DeepSpeed 0.19.8 requires warmup_num_steps > 0 for WarmupLR, WarmupDecayLR and WarmupCosineLR.
    ("WarmupLR", {"warmup_num_steps": 0}, r"warmup_num_steps must be a positive integer, got 0"),
    ("WarmupDecayLR", {"total_num_steps": 9, "warmup_num_steps": -5}, r"warmup_num_steps must be a positive"),
    ("WarmupCosineLR", {"total_num_steps": 1000, "warmup_num_steps": 0, "cos_min_ratio": 0.01},
     r"warmup_num_steps must be a positive integer, got 0"),
    ("WarmupLR", {"warmup_num_steps": 1.5}, r"warmup_num_steps must be a positive integer, got 1.5 \(float\)"),
    ("WarmupLR", {"warmup_num_steps": True}, r"warmup_num_steps must be a positive integer"),
    ("WarmupLR", {"warmup_num_steps": "auto"}, r"warmup_num_steps.*'auto' must be resolved"),
    ("WarmupDecayLR", {"total_num_steps": 0}, r"total_num_steps must be a positive integer, got 0"),
    ("WarmupLR", {"warmup_max_lr": "auto"}, r"warmup_max_lr must be a number.*'auto' must be resolved"),
    ("WarmupLR", {"warmup_min_lr": [0.0, "x"]}, r"warmup_min_lr has 2 values but the optimizer has 1"),
    ("WarmupLR", {"warmup_type": "cosine"}, r"warmup_type must be one of \['log', 'linear'\], got 'cosine'"),
    ("WarmupCosineLR", {"total_num_steps": 10, "cos_min_ratio": None}, r"cos_min_ratio must be a number"),
    ("WarmupLR", {"warmup_max_lrr": 0.01}, r"scheduler.params.warmup_max_lrr is not a parameter of WarmupLR; "
                                           r"did you mean 'warmup_max_lr'\?"),
    ("WarmupCosineLR", {"total_num_steps": 10, "warmup_max_lr": 0.1}, r"warmup_max_lr is not a parameter of "
                                                                      r"WarmupCosineLR"),
    ("WarmupLR", [("warmup_max_lr", 0.1)], r"scheduler.params must be a JSON object"),
    ("WarmupLR", {"last_batch_iteration": -2}, r"last_batch_iteration must be -1"),
])
def test_bad_params_name_the_key(type_name, params, pattern):
    with pytest.raises(ConfigError, match=pattern) as raised:
        build_scheduler(type_name, params, make_optimizer([0.5]))
    assert isinstance(raised.value, ValueError)


def test_no_decay_window_is_logged(caplog):
    with caplog.at_level(logging.WARNING, logger="zero_engine.schedulers"):
        build_scheduler("WarmupDecayLR", {"total_num_steps": 5, "warmup_num_steps": 10}, make_optimizer([0.5]))
    assert "total_num_steps 5 is less than warmup_num_steps 10" in caplog.text
