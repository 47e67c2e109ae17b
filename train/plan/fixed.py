"""`plan.fixed`: pin any dimension the planner searches, e.g. `tensor:8,pipeline:16,remat:full,schedule:interleaved,
virtual_stages:2,microbatch_size:1,shard_opt_state:false,grad_accum_steps:1`, to reproduce a published layout or
to search around a choice already made. Mesh axes are sizes; the rest pin the layout's knobs."""
from __future__ import annotations

import math
from typing import Any, Mapping

from mesh.layout import AXES
from sharding import schedules
from train.config.experiment import ConfigError
from train.plan.candidate import REMATS, Candidate

# Knob: (what it accepts, for the error line).
KNOBS = {"remat": "|".join(REMATS), "schedule": "|".join(("none",) + schedules.NAMES),
         "virtual_stages": "a positive integer", "microbatches": "a positive integer",
         "microbatch_size": "a positive integer (rows of one microbatch per replica)",
         "shard_opt_state": "true|false", "grad_accum_steps": "a positive integer"}
EXAMPLE = "tensor:8,pipeline:4,remat:full"


class PlanError(ConfigError):
    """A planning request the user can fix; one line naming the setting."""


def parse(text: str, num_devices: int) -> dict[str, Any]:
    """`plan.fixed` -> {name: value}: mesh axes as sizes that divide the devices, knobs as typed values."""
    fixed: dict[str, Any] = {}
    for item in filter(None, (x.strip() for x in str(text or "").split(","))):
        name, sep, value = (part.strip() for part in item.partition(":"))
        if not sep or not value:
            raise PlanError(f"plan.fixed={text!r}: {item!r} is not NAME:VALUE; write e.g. {EXAMPLE}")
        if name not in AXES and name not in KNOBS:
            raise PlanError(f"plan.fixed={text!r}: {name!r} is not a searched dimension; use a mesh axis "
                            f"({', '.join(AXES)}) or {', '.join(KNOBS)}")
        fixed[name] = _value(text, name, value)
        if name in AXES and num_devices % fixed[name]:
            raise PlanError(f"plan.fixed={text!r}: {name}={fixed[name]} does not divide the {num_devices} devices")
    sizes = [fixed[a] for a in AXES if a in fixed]
    if num_devices % math.prod(sizes or [1]):
        raise PlanError(f"plan.fixed={text!r}: the fixed sizes multiply to {math.prod(sizes)}, which does "
                        f"not divide the {num_devices} devices")
    return fixed


def _value(text: str, name: str, value: str) -> Any:
    accepted = KNOBS.get(name, "a positive integer")
    if name in ("remat", "schedule"):
        if value not in accepted.split("|"):
            raise PlanError(f"plan.fixed={text!r}: {name}:{value} is not one of {accepted}")
        return value
    if name == "shard_opt_state":
        if value.lower() not in ("true", "false"):
            raise PlanError(f"plan.fixed={text!r}: {name}:{value} is not one of {accepted}")
        return value.lower() == "true"
    try:
        number = int(value)
    except ValueError:
        number = 0
    if number < 1:
        raise PlanError(f"plan.fixed={text!r}: {name}:{value} is not {accepted}")
    return number


def allows(fixed: Mapping[str, Any], c: Candidate, replica_rows: int) -> bool:
    """Whether candidate `c` (with `replica_rows` rows per replica and update) keeps every pinned knob."""
    values = {"remat": c.remat, "schedule": c.schedule, "virtual_stages": c.virtual_stages,
              "microbatches": c.microbatches, "shard_opt_state": c.shard_opt_state,
              "grad_accum_steps": c.grad_accum_steps,
              "microbatch_size": replica_rows // (c.grad_accum_steps * c.microbatches)}
    return all(fixed[name] == value for name, value in values.items() if name in fixed)
