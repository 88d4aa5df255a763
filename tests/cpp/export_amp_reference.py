"""Runs torch.amp.GradScaler (CPU) over a fixed sequence of gradients, with
infs and NaNs injected at chosen steps, and writes what it did -- each
step's gradients as fed, the unscaled gradients, whether each optimizer
stepped, the scale and growth tracker after update(), the parameters, the
final state_dict -- for test_grad_scaler.cpp, which runs ddpx::GradScaler
on the same gradients and must match it bit for bit.

    python export_amp_reference.py OUT.pt

Growth and backoff factors that are not powers of two (3.0, 0.25) and an
initial scale of 1000 make unscaling round, so the unscaled gradients test
the inverse scale's arithmetic too; growth_interval 3 grows within the run.
"""
import sys

import torch

SETTINGS = {"init_scale": 1000.0, "growth_factor": 3.0, "backoff_factor": 0.25,
            "growth_interval": 3}
STEPS = 14
# step -> what happens (besides the plain step and update()).
EVENTS = {2: "inf_w", 5: "nan_v", 6: "unscale_first", 8: "inf_b_v", 10: "new_scale",
          12: "no_grad_b"}

gen = torch.Generator().manual_seed(63)
init = [torch.randn(5, 3, generator=gen), torch.randn(3, generator=gen),
        torch.randn(17, generator=gen)]
params = [t.clone().requires_grad_() for t in init]
w, b, v = params
opt_a = torch.optim.SGD([w, b], lr=0.1, momentum=0.9, foreach=False)
opt_b = torch.optim.SGD([v], lr=0.05, foreach=False)
scaler = torch.amp.GradScaler("cpu", **SETTINGS)
scaler.scale(torch.ones(()))  # makes the scale, on the CPU

rec = {"settings": SETTINGS, "init": init, "events": [], "grads": [], "unscaled": [],
       "stepped_a": [], "stepped_b": [], "scale": [], "tracker": [], "params": []}
for t in range(STEPS):
    event = EVENTS.get(t, "")
    grads = [torch.randn(p.shape, generator=gen) * scaler.get_scale() for p in params]
    if event == "inf_w":
        grads[0][1, 2] = float("inf")
    elif event == "nan_v":
        grads[2][4] = float("nan")
    elif event == "inf_b_v":
        grads[1][0] = float("-inf")
        grads[2][16] = float("inf")
    elif event == "no_grad_b":
        grads[1] = None
    for p, g in zip(params, grads):
        p.grad = None if g is None else g.clone()
    if event == "unscale_first":
        scaler.unscale_(opt_a)
    scaler.step(opt_a)
    scaler.step(opt_b)
    found_a = sum(f.item() for f in scaler._found_inf_per_device(opt_a).values())
    found_b = sum(f.item() for f in scaler._found_inf_per_device(opt_b).values())
    rec["events"].append(event)
    rec["grads"].append(grads)
    rec["unscaled"].append([None if p.grad is None else p.grad.clone() for p in params])
    rec["stepped_a"].append(found_a == 0)
    rec["stepped_b"].append(found_b == 0)
    if event == "new_scale":
        scaler.update(512.0)
    else:
        scaler.update()
    rec["scale"].append(scaler.get_scale())
    rec["tracker"].append(scaler._get_growth_tracker())
    rec["params"].append([p.detach().clone() for p in params])
rec["state_dict"] = scaler.state_dict()
torch.save(rec, sys.argv[1])
