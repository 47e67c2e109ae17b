"""Expert parallelism: the experts of a mixture-of-experts block split over the `expert` mesh axis, each device's
per-expert token buffers sent to the experts' devices by one all-to-all (dispatch) and the outputs brought back by
another (combine), inside a `shard_map` manual over the axes that split the rows: the batch axes, and `context` when
it splits them (tensor stays automatic).

Every batch axis is manual, not `expert` alone: the rows are split over (data, fsdp, expert) with `expert`
innermost, and a region manual over `expert` only would need them expert-major, a permutation of the batch."""
from __future__ import annotations

from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

AXIS = "expert"


def batch_axes(rules: Mapping[str, tuple[str, ...]], sizes: Mapping[str, int]) -> tuple[str, ...]:
    return tuple(a for a in rules.get("batch", ()) if sizes.get(a, 1) > 1)


def dispatch_combine(mesh: jax.sharding.Mesh, manual: tuple[str, ...], x_BxExCxD: jax.Array, experts: Any,
                     expert_fn: Callable) -> jax.Array:
    """models.contract.Hooks.moe_experts over the `expert` axis: each device holds [B/ways, E, C, D] buffers of
    its rows (`manual`: the axes that split them, the batch axes and under context parallelism `context`, in the
    rows' order) and the weights of E/e experts (replicated over the other `manual` axes, so their gradients
    are summed over those axes in the backward pass, as data parallelism does)."""
    others = tuple(a for a in manual if a != AXIS)

    def local(x_bxExCxD, w):
        w = jax.tree.map(lambda a: jax.lax.pcast(a, others, to="varying"), w) if others else w
        return exchange(x_bxExCxD, w, expert_fn)

    rows = P(manual if len(manual) > 1 else manual[0])
    weight_specs = jax.tree.map(lambda _: P(AXIS), experts)
    return jax.shard_map(local, mesh=mesh, in_specs=(rows, weight_specs), out_specs=rows,
                         axis_names=set(manual), check_vma=True)(x_BxExCxD, experts)


def exchange(x_bxExCxD: jax.Array, w: Any, expert_fn: Callable) -> jax.Array:
    """Inside a region manual over `expert` (this device's rows' buffers for all E experts, the weights of its E/e):
    dispatch, run the local experts on every device's rows for them, combine."""
    # Dispatch: the slice of experts e goes to device e, which receives every device's rows for its experts.
    x_BxexCxD = jax.lax.all_to_all(x_bxExCxD, AXIS, split_axis=1, concat_axis=0, tiled=True)
    B, e, C, D = x_BxexCxD.shape
    y = expert_fn(w, jnp.swapaxes(x_BxexCxD, 0, 1).reshape(e, B * C, D))
    y_BxexCxD = jnp.swapaxes(y.reshape(e, B, C, -1), 0, 1)
    # Combine: the inverse all-to-all returns each row's outputs to the device holding that row.
    return jax.lax.all_to_all(y_BxexCxD, AXIS, split_axis=0, concat_axis=1, tiled=True)
