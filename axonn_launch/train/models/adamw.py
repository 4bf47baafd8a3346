"""AdamW (Loshchilov and Hutter, arXiv 1711.05101: Adam with decoupled weight decay),
without ``torch.optim``.

``torch.optim``'s optimizers import ``torch._dynamo`` when one is built and at every step
(about 210 modules more: 0.4-0.5 CPU-seconds of every rank process here, and at start-up
every rank of a 32,768-rank job reads them from the shared file system). This one does
the arithmetic of ``torch.optim.AdamW`` with its defaults (no amsgrad, not maximize, not
capturable): the same elementwise operations, as ``torch._foreach`` calls over each
group's parameters (torch's default on GPUs; on CPU torch loops over the parameters, and
the result is the same to the bit: ``tests/train/models/test_adamw.py``).

Its state is ``torch.optim``'s: ``state[param]`` holds ``step`` (a float32 scalar on the
CPU), ``exp_avg`` and ``exp_avg_sq``; ``param_groups`` holds each group's settings and
``params``; ``state_dict`` and ``load_state_dict`` read and write ``torch.optim``'s
layout (the per-rank checkpoints of ``checkpoint/legacy.py`` hold it).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

import torch

MOMENTS = ("exp_avg", "exp_avg_sq")
PROFILE_NAME = "Optimizer.step#AdamW.step"  # torch.optim's label: traces compare across both


class AdamW:
    """AdamW over parameter groups (each a dict with ``params`` and any setting to override)."""

    def __init__(
        self,
        groups: Iterable[dict],
        *,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
    ) -> None:
        self.defaults = {"lr": lr, "betas": tuple(betas), "eps": eps,
                         "weight_decay": weight_decay}  # fmt: skip
        self.param_groups = [
            {**self.defaults, **group, "params": list(group["params"])} for group in groups
        ]
        self.state: defaultdict[torch.Tensor, dict] = defaultdict(dict)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for group in self.param_groups:
            for param in group["params"]:
                if set_to_none:
                    param.grad = None
                elif param.grad is not None:
                    param.grad.detach_().zero_()

    @torch.no_grad()
    def step(self) -> None:
        """One update of every parameter that has a gradient; a profiler trace shows it as
        ``torch.optim`` names its steps (``PROFILE_NAME``)."""
        with torch.profiler.record_function(PROFILE_NAME):
            for group in self.param_groups:
                params = [p for p in group["params"] if p.grad is not None]
                if params:
                    self._update(group, params)

    def moments(self, param: torch.Tensor) -> dict:
        """The state of ``param``: zero moments and step 0 before its first update."""
        entry = self.state[param]
        if not entry:
            entry["step"] = torch.tensor(0.0)
            for moment in MOMENTS:
                entry[moment] = torch.zeros_like(param, memory_format=torch.preserve_format)
        return entry

    def _update(self, group: dict, params: list[torch.Tensor]) -> None:
        lr, (beta1, beta2) = group["lr"], group["betas"]
        entries = [self.moments(p) for p in params]
        grads = [p.grad for p in params]
        steps = [e["step"] for e in entries]
        exp_avgs = [e["exp_avg"] for e in entries]
        exp_avg_sqs = [e["exp_avg_sq"] for e in entries]
        torch._foreach_add_(steps, 1.0)
        if group["weight_decay"] != 0:
            torch._foreach_mul_(params, 1 - lr * group["weight_decay"])
        torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2)
        counts = [step.item() for step in steps]
        step_sizes = [-(lr / (1 - beta1**n)) for n in counts]
        denominators = torch._foreach_sqrt(exp_avg_sqs)
        torch._foreach_div_(denominators, [(1 - beta2**n) ** 0.5 for n in counts])
        torch._foreach_add_(denominators, group["eps"])
        torch._foreach_addcdiv_(params, exp_avgs, denominators, step_sizes)

    def state_dict(self) -> dict:
        """``torch.optim``'s layout: state by parameter index, groups with their indices."""
        index = {}
        groups = []
        for group in self.param_groups:
            ids = []
            for param in group["params"]:
                ids.append(index.setdefault(id(param), len(index)))
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": ids})
        by_id = {id(p): p for g in self.param_groups for p in g["params"]}
        state = {index[id(p)]: entry for p, entry in self.state.items() if id(p) in by_id}
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        """Take the groups' settings and a copy of each parameter's state (moments in its
        device and dtype; ``step`` where it is, as ``torch.optim`` keeps it)."""
        saved = state_dict["param_groups"]
        if len(saved) != len(self.param_groups) or any(
            len(s["params"]) != len(g["params"]) for s, g in zip(saved, self.param_groups)
        ):
            raise ValueError("the optimizer state has other parameter groups than this model's")
        params = {}
        for group, saved_group in zip(self.param_groups, saved):
            params.update(zip(saved_group["params"], group["params"]))
            group.update({k: v for k, v in saved_group.items() if k != "params"})
        self.state = defaultdict(dict)
        for index, entry in state_dict["state"].items():
            param = params[index]
            self.state[param] = {
                key: value.clone() if key == "step" else value.to(param.device, param.dtype,
                                                                   copy=True)
                for key, value in entry.items()
            }  # fmt: skip
