"""The production train step of six built-in layouts lowers to the same StableHLO text as the one recorded in
tests/fixtures/step_text.json: refactors of the code around the step may not change what a user runs. The
text depends on the JAX version, so a record is kept per version; `python -m tests.sharding.test_step_text` prints
the hashes of the installed one to add to the file after a JAX upgrade (never after a refactor of ours; only
after a deliberate change of a model's program, named in its commit)."""
from __future__ import annotations

import hashlib
import json
import pathlib

import jax
import pytest

from tests.helpers import tiny_config
from train.trainer import Trainer

FIXTURE = pathlib.Path(__file__).parents[1] / "fixtures" / "step_text.json"
LAYOUTS = {  # name -> (mesh, other settings)
    "data8": ({"data": 8}, {}),
    "fsdp4_tensor2": ({"fsdp": 4, "tensor": 2}, {"sharding.shard_opt_state": True}),
    "pipeline2_data4_1f1b": ({"pipeline": 2, "data": 4}, {}),
    "pipeline2_interleaved_tensor2": ({"pipeline": 2, "data": 2, "tensor": 2},
                                      {"pipeline.schedule": "interleaved", "pipeline.virtual_stages": 2}),
    "context2_llama": ({"context": 2, "data": 4}, {"model.preset": "llama3-tiny"}),
    "expert4_moe": ({"expert": 4, "data": 2}, {"model.preset": "moe-tiny"}),
}


def step_text_hash(name: str) -> str:
    mesh, settings = LAYOUTS[name]
    config = tiny_config(**mesh)
    for key, value in settings.items():
        section, field = key.split(".")
        config[section][field] = value
    trainer = Trainer.build(config)
    lowered = trainer.train_step.lower(trainer.layout.abstract_state, trainer.abstract_batch())
    return hashlib.sha256(lowered.as_text().encode()).hexdigest()


def recorded() -> dict[str, str]:
    return json.loads(FIXTURE.read_text()).get(jax.__version__, {}) if FIXTURE.is_file() else {}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_production_step_lowers_to_the_recorded_text(name):
    expected = recorded()
    if name not in expected:
        pytest.skip(f"no step text recorded for jax {jax.__version__}: run python -m tests.sharding.test_step_text")
    assert step_text_hash(name) == expected[name]


if __name__ == "__main__":
    import tests.conftest  # noqa: F401  (8 virtual CPU devices, as the tests see them)
    print(json.dumps({jax.__version__: {name: step_text_hash(name) for name in sorted(LAYOUTS)}}, indent=1))
