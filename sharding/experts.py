"""Expert parallelism: the experts of a mixture-of-experts block split over the `expert` mesh axis, each device's
per-expert token buffers sent to the experts' devices by one all-to-all (dispatch) and the outputs brought back by
another (combine), inside a `shard_map` manual over `expert` only (data, fsdp, tensor stay automatic)."""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

AXIS = "expert"


def dispatch_combine(mesh: jax.sharding.Mesh, x_BxExCxD: jax.Array, experts: Any, expert_fn: Callable) -> jax.Array:
    """models.contract.Hooks.moe_experts over the `expert` axis: rows of the batch and experts are both split
    over it, so each device holds [B/e, E, C, D] buffers of its rows and the weights of E/e experts."""
    def local(x_bxExCxD, w):
        # Dispatch: the slice of experts e goes to device e, which receives every device's rows for its experts.
        x_BxexCxD = jax.lax.all_to_all(x_bxExCxD, AXIS, split_axis=1, concat_axis=0, tiled=True)
        B, e, C, D = x_BxexCxD.shape
        y = expert_fn(w, jnp.swapaxes(x_BxexCxD, 0, 1).reshape(e, B * C, D))
        y_BxexCxD = jnp.swapaxes(y.reshape(e, B, C, -1), 0, 1)
        # Combine: the inverse all-to-all returns each row's outputs to the device holding that row.
        return jax.lax.all_to_all(y_BxexCxD, AXIS, split_axis=0, concat_axis=1, tiled=True)

    weight_specs = jax.tree.map(lambda _: P(AXIS), experts)
    return jax.shard_map(local, mesh=mesh, in_specs=(P(AXIS), weight_specs), out_specs=P(AXIS),
                         axis_names={AXIS}, check_vma=True)(x_BxExCxD, experts)
