"""Every example runs at a small size, rejects unknown flags, says whether it is real or simulated,
and ends equal to the same steps run unsharded; real runs print no deprecation warnings."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from examples import _cli, custom_specs, demo, einops_model, hf_gpt2, train_gpt, train_mlp
from examples.models import gpt, mlp
from shardspec import optim
from tests._torchrun import torchrun

ROOT = Path(__file__).resolve().parents[1]


def _run(main: Any, argv: list[str]) -> tuple[Any, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        result = main(argv)
    return result, out.getvalue()


@pytest.mark.parametrize("main", [demo.main, train_mlp.main, train_gpt.main, hf_gpt2.main, einops_model.main])
def test_unknown_flags_are_rejected(main: Any, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--bogus"])
    assert exc.value.code == 2 and "unrecognized arguments: --bogus" in capsys.readouterr().err


def test_mesh_argument_is_checked(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        demo.main(["--mesh", "dp2"])
    assert "name=size pairs" in capsys.readouterr().err


def test_demo_shows_mesh_specs_plan_steps_and_confirms_equivalence() -> None:
    _, text = _run(demo.main, ["--steps", "2", "--layers", "1"])
    assert "mode: simulated (dp=2 x tp=4: 8 virtual devices" in text
    assert "parameter" in text and "P('tp')" in text  # the shardings table
    assert "step 1/2: loss" in text and "step 2/2: loss" in text
    assert text.rstrip().splitlines()[-1].startswith("equivalent: after 2 steps every parameter equals")


def test_demo_pipelined_dp_pp_tp_prints_stages_schedule_and_confirms_equivalence() -> None:
    """A pp axis pipelines the GPT (1F1B, 2 microbatches); the demo prints the stages with their
    balance and each position's action list, and ends equal to the unpipelined eager step."""
    argv = ["--mesh", "dp=2,pp=2,tp=2", "--steps", "1", "--microbatches", "2"]
    _, text = _run(demo.main, argv)
    assert "mode: simulated (dp=2 x pp=2 x tp=2: 8 virtual devices" in text
    assert "2 stage(s) on 2 position(s), schedule 1f1b, 2 microbatch(es)" in text and "balance" in text
    assert "stage 0 on position 0" in text and "stage 1 on position 1" in text
    assert "send over pp" in text  # the boundary's activations and their gradients
    lists = dict(line.split(": ", 1) for line in text.splitlines() if line.startswith("position "))
    assert sorted(lists["position 0"].split()) == ["B0.0", "B0.1", "F0.0", "F0.1"]
    assert sorted(lists["position 1"].split()) == ["B1.0", "B1.1", "F1.0", "F1.1"]
    assert text.rstrip().splitlines()[-1].startswith("equivalent: after 1 steps every parameter equals")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--steps", "0"], "argument --steps: '0' is not a positive integer"),
        (["--mesh", "dp=2,dp=2"], "names axis 'dp' twice"),
        (["--mesh", "x=2"], "blocks over pp; not ['x']"),
        (["--microbatches", "2"], "--microbatches needs a pp axis in --mesh"),
        (["--mesh", "pp=2", "--microbatches", "3"], "--microbatches 3 does not split the batch of 8"),
    ],
)
def test_demo_usage_mistakes_are_usage_errors(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A flag that would be ignored, or fail deep inside the run, is refused before anything runs."""
    with pytest.raises(SystemExit) as exc:
        demo.main(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize(("strategy", "mesh"), [("zero3", "tp=2"), ("tp", "dp=2"), ("zero3-tp", "tp=4")])
def test_train_gpt_refuses_a_strategy_whose_axis_the_mesh_lacks(
    strategy: str, mesh: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without its axis a strategy would silently run as another (zero3 on tp=2: all replicated)."""
    with pytest.raises(SystemExit) as exc:
        train_gpt.main(["--strategy", strategy, "--mesh", mesh])
    assert exc.value.code == 2 and f"the mesh {mesh} has none" in capsys.readouterr().err


def test_a_library_error_reads_as_a_usage_error(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--real` outside torchrun: the ShardingError's message and fix, as argparse prints errors
    (exit status 2), without the library's traceback."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(sys, "argv", ["demo.py", "--real"])
    with pytest.raises(SystemExit) as exc:
        _cli.run(demo.main)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.startswith("demo.py: error: Mesh(") and "Fix: launch with" in err
    assert "Traceback" not in err


def test_every_example_runs_as_a_script_from_anywhere() -> None:
    """`python examples/<name>.py` (not only `python -m examples.<name>` from the repository root)
    finds the examples package: each example's --help, run as a script from /."""
    names = ["demo", "train_gpt", "train_mlp", "hf_gpt2", "einops_model", "custom_specs"]
    code = (
        "import runpy, sys\n"
        f"for name in {names!r}:\n"
        f"    path = {str(ROOT / 'examples')!r} + '/' + name + '.py'\n"
        "    sys.argv = [path, '--help']\n"
        "    try:\n"
        "        runpy.run_path(path, run_name='__main__')\n"
        "    except SystemExit as exc:\n"
        "        assert exc.code == 0, (name, exc.code)\n"
        "    sys.modules.pop('examples', None)\n"
        "    print('ok', name)\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "PYTHONPATH")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/", env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert [line.split()[1] for line in out.stdout.splitlines() if line.startswith("ok ")] == names


def test_demo_too_few_layers_for_the_stages_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        demo.main(["--mesh", "pp=2", "--schedule", "interleaved", "--layers", "2"])
    assert exc.value.code == 2 and "needs 4 stages: pass --layers 3" in capsys.readouterr().err


def test_demo_runs_as_a_script() -> None:
    """`python examples/demo.py` (the README's command) works from any directory."""
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples" / "demo.py"),
            "--steps",
            "1",
            "--layers",
            "1",
            "--mesh",
            "dp=2,tp=2",
        ],
        capture_output=True,
        text=True,
        cwd="/",
        timeout=600,
        env={k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "PYTHONPATH")},
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.rstrip().splitlines()[-1].startswith("equivalent:")


@pytest.mark.parametrize("strategy", ["dp", "megatron", "zero3"])
def test_train_mlp_equals_unsharded(strategy: str) -> None:
    result, text = _run(train_mlp.main, ["--strategy", strategy, "--steps", "2"])
    assert "mode: simulated" in text
    opt = optim.adamw(lr=1e-2, weight_decay=0.1)
    params, state = mlp.init(8, 16, 4), None
    state = opt.init(params)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)
    for _ in range(2):
        params, state, _loss = mlp.make_step(opt)(params, state, x, y)
    torch.testing.assert_close(result["params"], params, rtol=1e-5, atol=1e-6)


def test_train_mlp_megatron_splits_over_tp() -> None:
    _, text = _run(train_mlp.main, ["--strategy", "megatron", "--steps", "1"])
    assert "all_reduce over tp" in text  # the tensor-parallel partial sum is reduced over tp, not dp


@pytest.mark.parametrize("strategy", train_gpt.STRATEGIES)
def test_train_gpt_every_strategy_equals_unsharded(strategy: str, tmp_path: Path) -> None:
    out = tmp_path / "params.pt"
    _, text = _run(
        train_gpt.main, ["--strategy", strategy, "--steps", "1", "--layers", "1", "--out", str(out)]
    )
    assert f"strategy: {strategy}" in text and "mode: simulated" in text
    cfg = gpt.Config(layers=1)
    params = gpt.init(cfg)
    params, _state, _loss = train_gpt.make_step(cfg)(
        params, train_gpt.OPT.init(params), *train_gpt.batch(0, cfg)
    )
    torch.testing.assert_close(torch.load(out), params, rtol=1e-4, atol=1e-5)


def test_train_gpt_with_dropout_equals_unsharded(tmp_path: Path) -> None:
    out = tmp_path / "params.pt"
    argv = ["--strategy", "zero3-tp", "--steps", "2", "--layers", "1", "--dropout", "0.1", "--out", str(out)]
    _run(train_gpt.main, argv)
    cfg = gpt.Config(layers=1)
    params = gpt.init(cfg)
    state, step = train_gpt.OPT.init(params), train_gpt.make_dropout_step(cfg, 0.1)
    for i in range(2):
        params, state, _loss = step(params, state, *train_gpt.batch(i, cfg), train_gpt.step_key(i))
    torch.testing.assert_close(torch.load(out), params, rtol=1e-4, atol=1e-5)


def test_hf_gpt2_matches_unsharded_module() -> None:
    pytest.importorskip("transformers", reason="the hf extra is not installed (pip install -e '.[hf]')")
    result, text = _run(hf_gpt2.main, ["--steps", "1", "--layers", "1"])
    assert "equivalent: the sharded GPT2LMHeadModel matches" in text
    torch.testing.assert_close(result["params"], result["reference"], rtol=1e-4, atol=1e-5)


def test_hf_gpt2_with_dropout_matches_unsharded_module() -> None:
    pytest.importorskip("transformers", reason="the hf extra is not installed (pip install -e '.[hf]')")
    result, _ = _run(
        hf_gpt2.main, ["--steps", "2", "--layers", "1", "--dropout", "0.1", "--mesh", "dp=2,tp=2"]
    )
    torch.testing.assert_close(result["params"], result["reference"], rtol=1e-4, atol=1e-5)
    plain, _ = _run(hf_gpt2.main, ["--steps", "2", "--layers", "1"])
    assert abs(result["loss"] - plain["loss"]) > 1e-4  # dropout was on


def test_einops_model_matches_unsharded() -> None:
    result, text = _run(einops_model.main, ["--steps", "1"])
    assert "equivalent" in text
    torch.testing.assert_close(result["params"], result["reference"], rtol=1e-4, atol=1e-5)


def test_custom_specs_by_pattern() -> None:
    result, text = _run(custom_specs.main, ["--fsdp", "--steps", "1"])
    assert "without default=: match_specs: no rule matches 'h.0.attn.proj.bias'" in text
    specs = result["specs"]
    assert specs["h.0.mlp.fc.weight"] == train_gpt.P("tp", "dp") and specs["ln_f.weight"] == train_gpt.P()


# warnings as a user sees them with every deprecation shown, from the library and the example alike
ALL_DEPRECATIONS = {"PYTHONWARNINGS": "always::DeprecationWarning,always::FutureWarning"}


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("module", "world", "argv"),
    [
        ("examples.train_mlp", 4, ["--steps", "1"]),
        ("examples.train_gpt", 2, ["--strategy", "zero3", "--steps", "1", "--layers", "1"]),  # mesh dp=2
    ],
)
def test_real_runs_print_no_deprecation_warnings(module: str, world: int, argv: list[str]) -> None:
    """Under torchrun, as a newcomer starts them: real mode, and nothing on stderr warns."""
    out, err = torchrun(world, ["-m", module, *argv], timeout=300, env=ALL_DEPRECATIONS)
    assert out.count("mode: real") == 1, out  # rank 0 says it, the others print nothing
    warned = [line for line in err.splitlines() if "DeprecationWarning" in line or "FutureWarning" in line]
    assert warned == [], err[-4000:]


@pytest.mark.multiprocess
def test_demo_pipelined_on_real_processes_confirms_equivalence() -> None:
    """The demo's pp mode for real, as the README runs it (torchrun, 2 gloo processes, pp=2): each
    result lives on the sub-mesh of the stage that computed it, the loss on the last stage's, and
    rank 0 (stage 0) still prints it and the check; the other rank prints nothing."""
    argv = ["--mesh", "pp=2", "--steps", "1", "--layers", "1", "--microbatches", "2"]
    out, _ = torchrun(2, [str(ROOT / "examples" / "demo.py"), *argv], timeout=300)
    assert "mode: real (pp=2: 2 processes, gloo)" in out and "step 1/1: loss" in out, out
    assert out.count("mode: real") == 1 and out.count("step 1/1: loss") == 1, out  # rank 0 alone prints
    assert out.rstrip().splitlines()[-1].startswith("equivalent: after 1 steps every parameter"), out
