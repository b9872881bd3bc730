"""The TensorFlow examples run end to end at np=2 through the real launcher."""

import importlib.util
import re

import pytest

from tests.torch_integration.conftest import REPO, launch

if importlib.util.find_spec("tensorflow") is None:
    pytest.skip(
        "tensorflow is not importable (pip install 'hvdlite[tensorflow]', or make install)",
        allow_module_level=True,
    )

ENV = {"TF_CPP_MIN_LOG_LEVEL": "2"}


@pytest.mark.timeout(150)
def test_keras_mnist_converges():
    rc, out = launch(
        REPO / "examples" / "tensorflow2_keras_mnist.py", ["--epochs", "3"], timeout_s=140, env=ENV
    )
    assert rc == 0, out[-4000:]
    m = re.search(r"FINAL_ACCURACY ([0-9.]+)", out)
    assert m, out[-4000:]
    assert float(m.group(1)) > 0.5, f"accuracy {m.group(1)} (chance is 0.1)\n{out[-3000:]}"
    assert "finished gradual learning rate warmup" in out


@pytest.mark.timeout(120)
def test_tf_synthetic_benchmark_runs():
    rc, out = launch(
        REPO / "examples" / "tensorflow2_synthetic_benchmark.py",
        [
            "--batch-size",
            "4",
            "--image-size",
            "32",
            "--width",
            "8",
            "--num-warmup-batches",
            "1",
            "--num-batches-per-iter",
            "1",
            "--num-iters",
            "2",
            "--fp16-allreduce",
        ],
        timeout_s=110,
        env=ENV,
    )
    assert rc == 0, out[-4000:]
    assert re.search(r"Total img/sec on 2 rank\(s\): [0-9.]+", out), out[-3000:]
