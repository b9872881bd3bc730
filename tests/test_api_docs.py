"""The API reference (docs/api) builds with Sphinx, warnings being errors, and documents the
key entry points of every package (what ``make docs`` runs, into a temporary folder)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

pytest.importorskip(
    "sphinx",
    reason="sphinx is not installed (requirements.txt pins it; "
    "make install brings it): the API reference cannot build",
)

#: page -> anchors (the documented objects' full names) it must hold
EXPECTED = {
    "torch.html": [
        "hvdlite.torch.allreduce",
        "hvdlite.torch.allreduce_async_",
        "hvdlite.torch.grouped_allreduce",
        "hvdlite.torch.broadcast_",
        "hvdlite.torch.DistributedOptimizer",
        "hvdlite.torch.broadcast_parameters",
        "hvdlite.torch.SyncBatchNorm",
        "hvdlite.torch.elastic.TorchState",
    ],
    "tensorflow.html": [
        "hvdlite.tensorflow.allreduce",
        "hvdlite.tensorflow.DistributedGradientTape",
        "hvdlite.tensorflow.broadcast_variables",
    ],
    "tensorflow_keras.html": [
        "hvdlite.tensorflow.keras.DistributedOptimizer",
        "hvdlite.tensorflow.keras.callbacks.MetricAverageCallback",
    ],
    "ray.html": ["hvdlite.ray.RayExecutor", "hvdlite.ray.RayExecutor.run"],
    "spark.html": ["hvdlite.spark.run", "hvdlite.spark.run_elastic"],
    "run.html": ["hvdlite.run"],
}


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_api_reference_builds_without_warnings(tmp_path):
    out = tmp_path / "html"
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    )
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "sphinx",
            "-W",
            "--keep-going",
            "-q",
            "-b",
            "html",
            "-d",
            str(tmp_path / "doctrees"),
            str(REPO / "docs" / "api"),
            str(out),
        ],
        cwd=str(REPO),
        env=env,
        capture_output=True,
        text=True,
        timeout=220,
    )
    assert proc.returncode == 0, (
        f"sphinx-build -W failed (exit {proc.returncode}):\n{proc.stderr[-6000:]}"
    )
    for page, anchors in EXPECTED.items():
        html = (out / page).read_text(encoding="utf-8")
        missing = [a for a in anchors if f'id="{a}"' not in html]
        assert not missing, f"{page} does not document {missing}"
