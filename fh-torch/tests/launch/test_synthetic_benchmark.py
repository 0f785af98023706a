"""The synthetic benchmark example: its arguments, VGG-16's shape, and that --hvd-module picks
the module the script runs on (one process, no launcher)."""

import importlib.util
import sys
import types

import pytest
import torch

from conftest import EXAMPLES, PYTHON, run


def load_example():
    spec = importlib.util.spec_from_file_location(
        "pytorch_synthetic_benchmark", EXAMPLES / "pytorch_synthetic_benchmark.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_vgg16_has_torchvisions_parameter_count_at_any_image_size():
    bench = load_example()
    args = bench.parse_args(["--model", "vgg16"])
    assert args.num_classes == 1000
    model = bench.build_model(args)
    # torchvision.models.vgg16(): 138,357,544 parameters.
    assert sum(p.numel() for p in model.parameters()) == 138_357_544
    convs = [m for m in model.modules() if isinstance(m, torch.nn.Conv2d)]
    fcs = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert (len(convs), len(fcs)) == (13, 3)
    model.eval()
    with torch.no_grad():
        for side in (32, 64):
            assert model(torch.randn(1, 3, side, side)).shape == (1, 1000)


def test_arguments_are_checked():
    bench = load_example()
    args = bench.parse_args([])
    assert (args.model, args.num_classes, args.hvd_module) == (
        "resnet-like", 100, "fasthorovod.torch")
    for bad in (["--model", "vgg16", "--image-size", "16"], ["--num-iters", "0"],
                ["--use-ddp", "--fp16-allreduce"], ["--model", "vgg19"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


def test_hvd_module_switches_the_import(monkeypatch):
    bench = load_example()
    fake = types.ModuleType("fake_hvd_for_test")

    def init():
        raise RuntimeError("fake hvd imported")
    fake.init = init
    monkeypatch.setitem(sys.modules, "fake_hvd_for_test", fake)
    with pytest.raises(RuntimeError, match="fake hvd imported"):
        bench.main(["--hvd-module", "fake_hvd_for_test"])
    monkeypatch.setenv("HVD_MODULE", "fake_hvd_for_test")
    assert load_example().parse_args([]).hvd_module == "fake_hvd_for_test"


def test_one_process_on_fasthorovod_prints_the_summary():
    code, out = run([PYTHON, str(EXAMPLES / "pytorch_synthetic_benchmark.py"),
                     "--model-size", "tiny", "--batch-size", "2", "--image-size", "8",
                     "--num-warmup-batches", "1", "--num-batches-per-iter", "1",
                     "--num-iters", "2"], timeout=120)
    assert code == 0, out
    last = out.strip().splitlines()[-1]
    assert '"backend": "fasthorovod"' in last and '"img_sec_total"' in last, out
