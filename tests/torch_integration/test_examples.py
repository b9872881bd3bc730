"""The examples run end to end at np=2 through the real launcher."""

import re

import pytest

from .conftest import REPO, launch


@pytest.mark.timeout(150)
def test_mnist_converges_and_checkpoints(tmp_path):
    ck = tmp_path / "ck.pt"
    rc, out = launch(
        REPO / "examples" / "pytorch_mnist.py",
        ["--epochs", "2", "--checkpoint", str(ck)],
        timeout_s=140,
    )
    assert rc == 0, out[-4000:]
    m = re.search(r"FINAL_ACCURACY ([0-9.]+)", out)
    assert m, out[-4000:]
    assert float(m.group(1)) > 0.5, f"accuracy {m.group(1)} (chance is 0.1)\n{out[-3000:]}"
    assert ck.exists() and "Checkpoint written" in out


@pytest.mark.timeout(120)
def test_synthetic_benchmark_runs(tmp_path):
    rc, out = launch(
        REPO / "examples" / "pytorch_synthetic_benchmark.py",
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
    )
    assert rc == 0, out[-4000:]
    assert re.search(r"Total img/sec on 2 rank\(s\): [0-9.]+", out), out[-3000:]


@pytest.mark.timeout(120)
def test_synthetic_benchmark_with_adasum(tmp_path):
    rc, out = launch(
        REPO / "examples" / "pytorch_synthetic_benchmark.py",
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
            "--use-adasum",
        ],
        timeout_s=110,
    )
    assert rc == 0, out[-4000:]
    assert re.search(r"Total img/sec on 2 rank\(s\): [0-9.]+", out), out[-3000:]


@pytest.mark.timeout(150)
def test_training_step_benchmark_smoke(tmp_path):
    js = tmp_path / "ts.json"
    rc, out = launch(
        REPO / "benchmarks" / "training_step.py",
        [
            "--rounds",
            "1",
            "--steps",
            "1",
            "--warmup",
            "1",
            "--resnet-width",
            "8",
            "--resnet-batch",
            "4",
            "--tf-batch",
            "2",
            "--json",
            str(js),
        ],
        timeout_s=140,
    )
    assert rc == 0, out[-4000:]
    import json

    data = json.loads(js.read_text())
    for model in ("resnet", "transformer"):
        assert set(data["results"][model]["ms_per_step"]) >= {"local", "hvdlite", "ddp"}


@pytest.mark.timeout(120)
def test_process_sets_example_trains_two_models_at_once():
    rc, out = launch(
        REPO / "examples" / "pytorch_process_sets.py", ["--steps", "60"], np=4, timeout_s=110
    )
    assert rc == 0, out[-4000:]
    first = {int(t): float(v) for t, v in re.findall(r"task (\d) step 0: loss ([0-9.]+)", out)}
    final = {int(t): float(v) for t, v in re.findall(r"FINAL task (\d) loss ([0-9.]+)", out)}
    assert set(first) == set(final) == {0, 1}, out[-3000:]
    for task in (0, 1):  # each half learned its own function
        assert final[task] < 0.5 * first[task], (task, first, final)
