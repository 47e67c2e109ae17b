"""W&B continues the same run across a run's phases and resumes: the id kept in the workdir (offline mode)."""
import re

import pytest

from train.loop.metrics import WandB


def test_wandb_keeps_one_run_id_over_a_resume(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    workdir = tmp_path / "run"
    workdir.mkdir()
    ids = []
    for step in (3, 6):  # the first attempt, then the resumed one
        logger = WandB(workdir, {"train": {"steps": step}}, {"param_count": 10})
        ids.append(wandb.run.id)
        logger.scalars(step, {"loss": 1.0 / step})
        logger.close()
    assert ids[0] == ids[1] == (workdir / WandB.ID_FILE).read_text().strip()
    runs = sorted(p.name for p in (tmp_path / "wandb").glob("offline-run-*"))
    # offline-run-<time>-<id>, with -1 added when both start within one second
    assert len(runs) == 2 and all(re.fullmatch(rf"offline-run-\d+_\d+-{ids[0]}(-\d+)?", name) for name in runs), runs
