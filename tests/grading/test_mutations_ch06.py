"""Chapter 06: plausible wrong answers its checks must reject (see ``_mutations.py``).

Every edge the exercises name — growing exactly to the float32 maximum, every parameter group and a
parameter without gradient, a micro-batch that overflows, 2 exponent bits and 1 mantissa bit — is in
the visible checks, so the wrong answers that miss one are VISIBLE (issue 38). The hidden checks add
sizes and randomness only (longer runs and growth intervals, parameters in random orders, more
micro-batches, up to 52 mantissa bits); their wrong answers are fitted to the visible checks' sizes.
"""

from _mutations import chapter_tests

SCALE = """\
if found_inf:
    return scale * backoff_factor, {after_inf}
growth_tracker += 1
if growth_tracker {reached} growth_interval:
    grown = scale * growth_factor
    if {cap}:
        scale = grown
    return scale, {after_growth}
return scale, growth_tracker
"""
RIGHT_SCALE = {"after_inf": "0", "reached": "==", "cap": "grown <= torch.finfo(torch.float32).max",
               "after_growth": "0"}

UNSCALE = """\
finite = True
with torch.no_grad():
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is None:
                continue
            finite &= bool(torch.isfinite(p.grad).all())
            {unscale}
if {step_when}:
    optimizer.step()
return {returned}
"""
RIGHT_UNSCALE = {"unscale": "p.grad.mul_(1.0 / scale)", "step_when": "finite", "returned": "finite"}

STEP = """\
optimizer.zero_grad()
for x, y in micro_batches:
    with torch.autocast("cpu", dtype={dtype}):
        loss = F.mse_loss(model(x), y){divide}
    scaler.scale(loss).backward()
scaler.unscale_(optimizer)
norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
{step}
scaler.update()
return float(norm)
"""
RIGHT_STEP = {"dtype": "torch.float16", "divide": " / len(micro_batches)", "step": "scaler.step(optimizer)"}

LIMITS = """\
bias = {bias}
largest = ({finite_max}) if finite else (2.0 - 2.0 ** -m) * 2.0 ** bias
return {{"max": {largest}, "smallest_normal": 2.0 ** (1 - bias),
        "smallest_subnormal": {subnormal}, "eps": {eps}}}
"""
RIGHT_LIMITS = {"bias": "2 ** (e - 1) - 1", "finite_max": "(2.0 - 2.0 ** (1 - m)) * 2.0 ** (2 ** e - 1 - bias)",
                "largest": "largest", "subnormal": "2.0 ** (1 - bias - m)", "eps": "2.0 ** -m"}

VISIBLE = {
    "06.1": {
        "the tracker kept after a growth": SCALE.format(**{**RIGHT_SCALE, "after_growth": "growth_tracker"}),
        "grows one clean step late": SCALE.format(**{**RIGHT_SCALE, "reached": ">"}),
        "the tracker kept after an overflow": SCALE.format(**{**RIGHT_SCALE, "after_inf": "growth_tracker"}),
        "no float32 cap": SCALE.format(**{**RIGHT_SCALE, "cap": "True"}),
        "the overflow step counted as clean": """\
growth_tracker += 1
if found_inf:
    return scale * backoff_factor, growth_tracker
if growth_tracker >= growth_interval:
    grown = scale * growth_factor
    if grown <= torch.finfo(torch.float32).max:
        scale = grown
    return scale, 0
return scale, growth_tracker
""",
        "the scale as a tensor": """\
if found_inf:
    return torch.as_tensor(scale) * backoff_factor, 0
growth_tracker += 1
if growth_tracker == growth_interval:
    grown = torch.as_tensor(scale, dtype=torch.float32) * growth_factor
    if torch.isfinite(grown):
        scale = grown
    return scale, 0
return scale, growth_tracker
""",
        "calls the forbidden helper": "return gc.update_scale(scale, growth_tracker, found_inf, "
                                      "growth_factor=growth_factor, backoff_factor=backoff_factor, "
                                      "growth_interval=growth_interval)",
        # ported from test_hidden_checks.py WRONG_ANSWERS["06.1"]: the float32 maximum itself is finite
        "off by one at the float32 maximum": SCALE.format(**{**RIGHT_SCALE, "cap": "grown < torch.finfo(torch.float32).max"}),
    },
    "06.2": {
        "never skips": UNSCALE.format(**{**RIGHT_UNSCALE, "step_when": "True"}),
        "not unscaled": UNSCALE.format(**{**RIGHT_UNSCALE, "unscale": "pass"}),
        "a new tensor, not in place": UNSCALE.format(**{**RIGHT_UNSCALE, "unscale": "p.grad = p.grad / scale"}),
        "a tensor, not a bool": """\
finite = torch.tensor(True)
with torch.no_grad():
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is None:
                continue
            finite &= torch.isfinite(p.grad).all()
            p.grad.mul_(1.0 / scale)
if finite:
    optimizer.step()
return finite
""",
        "infinities only, NaN missed": UNSCALE.format(**RIGHT_UNSCALE).replace(
            "bool(torch.isfinite(p.grad).all())", "not bool(torch.isinf(p.grad).any())"),
        "unscaled only when finite": """\
grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
finite = all(bool(torch.isfinite(g).all()) for g in grads)
if not finite:
    return False                                # "nothing to do": leaves the gradients scaled
with torch.no_grad():
    for g in grads:
        g.mul_(1.0 / scale)
optimizer.step()
return True
""",
        # ported from test_hidden_checks.py WRONG_ANSWERS["06.2"]: only the first parameter group
        "only the first parameter group": """\
finite = True
with torch.no_grad():
    for p in optimizer.param_groups[0]["params"]:
        finite &= bool(torch.isfinite(p.grad).all())
        p.grad.mul_(1.0 / scale)
if finite:
    optimizer.step()
return finite
""",
    },
    "06.3": {
        # ported from test_classic_mistakes.py CLASSIC_MISTAKES["06.3"]
        "clip before unscale": """\
optimizer.zero_grad()
for x, y in micro_batches:
    with torch.autocast("cpu", dtype=torch.float16):
        loss = F.mse_loss(model(x), y) / len(micro_batches)
    scaler.scale(loss).backward()
norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)   # clips the scaled gradients
scaler.step(optimizer)
scaler.update()
return float(norm)
""",
        # ported from test_classic_mistakes.py CLASSIC_MISTAKES["06.3"]
        "bf16": STEP.format(**{**RIGHT_STEP, "dtype": "torch.bfloat16"}),
        # ported from test_classic_mistakes.py CLASSIC_MISTAKES["06.3"]
        "constant": "return 0.0",
        "the losses summed, not averaged": STEP.format(**{**RIGHT_STEP, "divide": ""}),
        "a step per micro-batch": """\
for x, y in micro_batches:
    optimizer.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = F.mse_loss(model(x), y) / len(micro_batches)
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    scaler.step(optimizer)
    scaler.update()
return float(norm)
""",
        "zero_grad per micro-batch": """\
for x, y in micro_batches:
    optimizer.zero_grad()                       # throws the earlier micro-batches away
    with torch.autocast("cpu", dtype=torch.float16):
        loss = F.mse_loss(model(x), y) / len(micro_batches)
    scaler.scale(loss).backward()
scaler.unscale_(optimizer)
norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
scaler.step(optimizer)
scaler.update()
return float(norm)
""",
        "unscale_ per micro-batch": """\
optimizer.zero_grad()
for x, y in micro_batches:
    with torch.autocast("cpu", dtype=torch.float16):
        loss = F.mse_loss(model(x), y) / len(micro_batches)
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
scaler.step(optimizer)
scaler.update()
return float(norm)
""",
        "no update": STEP.format(**RIGHT_STEP).replace("scaler.update()\n", ""),
        "the norm as a tensor": STEP.format(**RIGHT_STEP).replace("return float(norm)", "return norm"),
        # ported from test_hidden_checks.py WRONG_ANSWERS["06.3"]: unscaled, so "step directly"
        "optimizer.step() directly": STEP.format(**{**RIGHT_STEP, "step": "optimizer.step()"}),
    },
    "06.4": {
        "no mantissa in the maximum": LIMITS.format(**{**RIGHT_LIMITS, "largest": "2.0 ** bias"}),
        "bias off by one": LIMITS.format(**{**RIGHT_LIMITS, "bias": "2 ** (e - 1)"}),
        "no subnormals": LIMITS.format(**{**RIGHT_LIMITS, "subnormal": "2.0 ** (1 - bias)"}),
        "eps as half an ulp": LIMITS.format(**{**RIGHT_LIMITS, "eps": "2.0 ** -(m + 1)"}),
        "finite formats read as IEEE": LIMITS.format(**{**RIGHT_LIMITS, "finite_max": "(2.0 - 2.0 ** -m) * 2.0 ** bias"}),
        "the NaN pattern counted as a number": LIMITS.format(**{
            **RIGHT_LIMITS, "finite_max": "(2.0 - 2.0 ** -m) * 2.0 ** (2 ** e - 1 - bias)"}),
        # gc.FloatFormat's __init__ is made by dataclasses (a closure): the grader flags the name in the
        # answer cell; here it fails on the finite formats, which FloatFormat does not know
        "gc.FloatFormat for every format": """\
f = gc.FloatFormat("x", e, m)
return {"max": f.max, "smallest_normal": f.smallest_normal, "smallest_subnormal": f.smallest_subnormal,
        "eps": f.eps}
""",
        # ported from test_hidden_checks.py WRONG_ANSWERS["06.4"]: ints where the exponent is >= 0
        "ints from integer powers": """\
bias = 2 ** (e - 1) - 1
top = 2 ** e - 1 - bias if finite else bias
largest = (2 - 2 ** ((1 if finite else 0) - m)) * 2 ** top
return {"max": largest, "smallest_normal": 2 ** (1 - bias), "smallest_subnormal": 2 ** (1 - bias - m),
        "eps": 2 ** -m}
""",
    },
}

HIDDEN = {
    "06.1": {
        "growth_interval capped at 5 (the check's largest)": SCALE.format(**RIGHT_SCALE).replace(
            "growth_tracker == growth_interval", "growth_tracker == min(growth_interval, 5)"),
    },
    "06.2": {
        "stops at the first parameter without a gradient": UNSCALE.format(**RIGHT_UNSCALE).replace(
            "continue", "break"),
    },
    "06.3": {
        "the loss divided by at most 4 micro-batches (the check's most)": STEP.format(
            **{**RIGHT_STEP, "divide": " / min(len(micro_batches), 4)"}),
    },
    "06.4": {
        "mantissa bits capped at 40 (the check's most)": "m = min(m, 40)\n" + LIMITS.format(**RIGHT_LIMITS),
    },
}

(test_visible_check_rejects, test_hidden_check_rejects, test_solution_passes_and_mutations_are_kept,
 test_trivial_answers_fail) = chapter_tests("06", VISIBLE, HIDDEN)
