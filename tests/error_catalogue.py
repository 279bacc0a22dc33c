"""The catalogue of bad inputs: each case is a user mistake, the words its error must contain (the
argument path, spec or sizes, and the fix), and the category it belongs to.

``tests/test_error_catalogue.py`` runs every case; ``python -m tests.error_catalogue`` rewrites
``docs/errors.md`` from the messages the cases actually produce, so the page cannot drift from the code.
"""

from __future__ import annotations

import pathlib
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

import collectives
import shardspec
from shardspec import Mesh, P, constrain, optim, shard, sharded, spec_to_placements, unshard
from tests._custom_ops import doubled

SIM = Mesh({"dp": 2, "tp": 2}, simulate=True)
DP = Mesh({"dp": 2}, simulate=True)


@dataclass(frozen=True)
class Case:
    category: str
    title: str
    run: Callable[[], Any]
    says: tuple[str, ...]  # fragments the message must contain (besides the "Fix:" line)


def _backward_inside(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    loss = (x @ w).sum()
    loss.backward()
    return loss


def _step_in_rng_scope() -> Any:
    step = _step(lambda x: x * 2, (P("dp"),), P("dp"))
    with shardspec.random.rng(shardspec.random.key(1)):
        return step(X)


def _shard0() -> Any:
    from torch.distributed.tensor import Shard

    return Shard(0)


def _step(fn: Callable[..., Any], in_specs: Any, out_specs: Any, mesh: Mesh = SIM, **kw: Any) -> Any:
    return sharded(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, **kw)


def _mlp(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    return ((x @ params["w1"]).relu() @ params["w2"]).sum()


PARAMS = {"w1": torch.randn(4, 8), "w2": torch.randn(8, 2)}
X = torch.randn(4, 4)


def _branch(x: torch.Tensor) -> torch.Tensor:
    if x.sum() > 0:
        return x * 2
    return x


def _mutates(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    params["w1"].mul_(0.5)
    return x.sum()


_BUF = torch.zeros(4)


def _closure_write(x: torch.Tensor) -> torch.Tensor:
    _BUF.add_(x)
    return x * 2


_TABLE = {"scale": torch.ones(4)}
_SPARSE = torch.eye(4).to_sparse()


def _rebound_constant() -> Any:
    """A step compiled, then the dict entry it reads a tensor from set to another tensor."""
    table = {"scale": torch.ones(4)}
    _TABLE.update(table)
    step = _step(lambda x: x * _TABLE["scale"], (P("dp"),), P("dp"))
    step(torch.ones(4))
    _TABLE["scale"] = torch.full((4,), 2.0)
    return step(torch.ones(4))


def _damaged_checkpoint() -> Any:
    import tempfile

    from shardspec import checkpoint

    tree = {"w": torch.full((3,), 2.0)}
    with tempfile.TemporaryDirectory() as root:
        saved = checkpoint.save(root, tree, step=1)
        shard = next(saved.glob("*.distcp"))
        data = bytearray(shard.read_bytes())
        data[data.find(bytes(tree["w"].numpy().tobytes()))] ^= 0x10
        shard.write_bytes(bytes(data))
        try:
            return checkpoint.load(root, like=tree)
        except shardspec.ShardingError as exc:  # the temporary path, named in the message, goes
            raise shardspec.ShardingError(str(exc).replace(root, "ckpt")) from None


def _nonzero(x: torch.Tensor) -> torch.Tensor:
    return x[x > 0].sum()


def _random(x: torch.Tensor) -> torch.Tensor:
    return x * torch.randint_like(x, 10)


_REMAT_BUF = torch.zeros(4)


def _writes_buffer(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    _REMAT_BUF.add_(1)
    return x @ w


def _remat_writes(w: torch.Tensor, x: torch.Tensor) -> Any:
    return shardspec.value_and_grad(lambda w, x: shardspec.remat(_writes_buffer)(x, w).sum())(w, x)[0]


def _item(x: torch.Tensor) -> torch.Tensor:
    return x * x.sum().item()


def _returns_float(x: torch.Tensor) -> Any:
    return x.sum(), 1.5


def _no_rule(x: torch.Tensor) -> torch.Tensor:
    return doubled(x).sum()


def _bad_constraint(x: torch.Tensor) -> torch.Tensor:
    return constrain(x * 2, P("sp")).sum()


def _microbatches(w: torch.Tensor, x: torch.Tensor) -> Any:
    loss, g = shardspec.value_and_grad(lambda w, x: (x @ w).sum(), microbatches=3)(w, x)
    return w - g, loss


def _grad_outside() -> Any:
    step = _step(lambda x: (x * x).sum(), (P("dp"),), P())
    return torch.func.grad(step)(torch.ones(4))


def _nested_other_mesh() -> Any:
    inner = _step(lambda y: y, (P(),), P(), mesh=Mesh({"tp": 2}, simulate=True))
    return _step(lambda x: inner(x), (P("dp"),), P("dp"))(torch.ones(4, 2))


CASES: tuple[Case, ...] = (
    # mesh
    Case(
        "mesh",
        "an axis name used twice",
        lambda: Mesh([("dp", 2), ("dp", 4)], simulate=True),
        ("'dp' appears twice",),
    ),
    Case("mesh", "an axis of size 0", lambda: Mesh({"dp": 0}, simulate=True), ("'dp'", "size 0", ">= 1")),
    Case(
        "mesh",
        "a float axis size",
        lambda: Mesh({"dp": 2.0}, simulate=True),
        ("2.0", "float", "positive int"),
    ),
    Case("mesh", "a mesh with no axes", lambda: Mesh({}, simulate=True), ("at least one axis",)),
    Case("mesh", "an empty axis name", lambda: Mesh({"": 2}, simulate=True), ("not a valid name",)),
    Case(
        "mesh",
        "axes that are neither a dict nor pairs",
        lambda: Mesh(4, simulate=True),
        ("dict of name -> size",),
    ),
    Case("mesh", "a rank outside the mesh", lambda: SIM.coords(4), ("rank 4", "0..3")),
    Case("mesh", "simulate that is not a bool", lambda: Mesh({"dp": 2}, simulate="no"), ("simulate='no'",)),
    Case("mesh", "a device coordinate missing an axis", lambda: SIM.rank_of({"dp": 1}), ("['tp']",)),
    Case("mesh", "the rank of a simulated mesh", lambda: DP.rank, ("virtual devices",)),
    Case(
        "mesh",
        "sharded(mesh=...) that is not a Mesh",
        lambda: sharded(_mlp, mesh="dp", in_specs=(), out_specs=()),
        ("needs a shardspec.Mesh", "str"),
    ),
    Case(
        "mesh",
        "a timeout that is not a positive number of seconds",
        lambda: _step(_mlp, (P(), P()), P(), timeout=-1),
        ("timeout=-1", "timeout=600"),
    ),
    # specs
    Case(
        "specs", "an axis used twice in one spec", lambda: P("dp", None, "dp"), ("'dp' twice", "dims 0 and 2")
    ),
    Case("specs", "a spec entry of the wrong type", lambda: P("dp", 2), ("entry 1 is 2 of type int",)),
    Case("specs", "an axis used twice in one dim", lambda: P(("dp", "dp")), ("'dp' twice in dim 0",)),
    Case(
        "specs",
        "the parameters passed where their specs belong",
        lambda: _step(_mlp, (PARAMS, P("dp")), P())(PARAMS, X),
        ("in_specs for params['w1'] is <tensor of shape (4, 8), torch.float32>", "use P(...)"),
    ),
    Case(
        "specs",
        "one placement where a sequence belongs",
        lambda: shardspec.placements_to_spec(_shard0(), DP, 2),
        ("placements is one Shard(dim=0)", "(Shard(dim=0),)"),
    ),
    Case(
        "specs",
        "shard of something that is not a tensor",
        lambda: shard([[1.0, 2.0]], DP, P("dp")),
        ("expected a torch.Tensor, got list", "torch.as_tensor"),
    ),
    Case(
        "specs",
        "a string where a P belongs",
        lambda: shard(X, DP, "dp", name="x"),
        ("x", "expected a partition spec", "P('dp')"),
    ),
    Case(
        "specs",
        "an axis the mesh does not have",
        lambda: shard(X, SIM, P("mp"), name="params['w1']"),
        ("params['w1']", "P('mp')", "['dp', 'tp']"),
    ),
    Case(
        "specs",
        "a spec longer than the tensor's rank",
        lambda: shard(torch.zeros(4), SIM, P("dp", None, "tp"), name="batch"),
        ("batch", "3 entries", "shape (4,)"),
    ),
    Case(
        "specs",
        "an uneven split over two axes that DTensor would place differently",
        lambda: spec_to_placements(P(("dp", "tp")), SIM, (6, 3), name="x"),
        ("x: spec P(('dp', 'tp')) splits dim 0 of size 6 unevenly", "multiple of 4"),
    ),
    Case(
        "specs",
        "a split spec on a Python scalar",
        lambda: _step(lambda x, lr: x * lr, (P(), P("dp")), P())(X, 0.5),
        ("lr is a Python float (0.5)", "P('dp')", "use P() for lr"),
    ),
    Case(
        "specs",
        "a result spec longer than the result's rank",
        lambda: _step(_mlp, (P(), P()), P("dp"))(PARAMS, X),
        ("result", "P('dp')", "P() for a scalar"),
    ),
    Case(
        "specs",
        "a reversed axis tuple DTensor cannot hold",
        lambda: spec_to_placements(P(("tp", "dp")), SIM, name="w"),
        ("w:", "('tp', 'dp')", "('dp', 'tp')"),
    ),
    Case(
        "specs",
        "an unknown axis in a constraint",
        lambda: _step(_bad_constraint, (P("dp"),), P())(X),
        ("constrain at", 'P("sp")', "'sp'"),
    ),
    # pytrees
    Case(
        "pytrees",
        "spec keys that differ from the argument's keys",
        lambda: _step(_mlp, ({"W1": P(), "w2": P()}, P()), P())(PARAMS, X),
        ("params", "['W1']", "['w1']"),
    ),
    Case(
        "pytrees",
        "a wrong number of argument specs",
        lambda: _step(_mlp, (P(), P(), P()), P())(PARAMS, X),
        ("in_specs has 3 entries", "2 arguments", "params, x"),
    ),
    Case(
        "pytrees",
        "in_specs that is a single P",
        lambda: _step(_mlp, P(), P())(PARAMS, X),
        ("in_specs is a P", "2 arguments"),
    ),
    Case(
        "pytrees",
        "a result spec tree that does not match the results",
        lambda: _step(_mlp, (P(), P()), (P(), P()))(PARAMS, X),
        ("out_specs does not match", "result"),
    ),
    Case(
        "pytrees",
        "a leaf that is neither a tensor nor a scalar",
        lambda: _step(lambda x, o: x, (P(), P()), P())(X, object()),
        ("o: a leaf of type object",),
    ),
    Case(
        "pytrees",
        "a result that is not a tensor",
        lambda: _step(_returns_float, (P(),), (P(), P()))(X),
        ("result[1]", "float"),
    ),
    Case(
        "pytrees",
        "None as a spec",
        lambda: _step(_mlp, ({"w1": P(), "w2": None}, P()), P())(PARAMS, X),
        ("params['w2']", "the spec is None", "P()"),
    ),
    Case(
        "pytrees",
        "a step called with keyword arguments",
        lambda: _step(_mlp, (P(), P()), P())(PARAMS, x=X),
        ("keyword arguments (x)", "_mlp(params, x)"),
    ),
    Case(
        "pytrees",
        "lower() called with keyword arguments",
        lambda: _step(_mlp, (P(), P()), P()).lower(PARAMS, x=X),
        ("keyword arguments (x)", "_mlp.lower(params, x)"),
    ),
    Case(
        "pytrees",
        "a piece count that does not match the mesh",
        lambda: unshard([torch.zeros(2)] * 3, SIM, P("dp")),
        ("3 pieces", "4 devices"),
    ),
    Case(
        "pytrees",
        "pieces that tile no torch.chunk layout",
        lambda: unshard([torch.zeros(2, 2), torch.zeros(2, 3)], DP, P(None, "dp")),
        ("rank 0 holds shape (2, 2)", "(2, 5)"),
    ),
    Case(
        "pytrees",
        "a sparse tensor argument",
        lambda: _step(lambda x: x * 2, (P(),), P())(torch.eye(4).to_sparse()),
        ("x: a torch.sparse_coo tensor of shape (4, 4)", "x.to_dense()"),
    ),
    # function purity
    Case(
        "purity",
        "a branch on a tensor's value",
        lambda: _step(_branch, (P("dp"),), P("dp"))(X),
        ("if x.sum() > 0:", "torch.where"),
    ),
    Case(
        "purity",
        "an argument modified in place",
        lambda: _step(_mutates, (P(), P()), P())(PARAMS, X),
        ("params['w1'] is modified in place", "mul_(0.5)"),
    ),
    Case(
        "purity",
        "a closed-over tensor modified in place",
        lambda: _step(_closure_write, (P("dp"),), P("dp"))(torch.ones(4)),
        ("closes over", "_BUF.add_(x)", "argument"),
    ),
    Case(
        "purity",
        "a closed-over sparse tensor",
        lambda: _step(lambda x: torch.sparse.mm(_SPARSE, x), (P("dp"),), P("dp"))(torch.ones(4, 2)),
        ("closes over a torch.sparse_coo tensor of shape (4, 4)", ".to_dense()"),
    ),
    Case(
        "purity",
        "a closed-over tensor rebound after compiling",
        _rebound_constant,
        ("_TABLE['scale'] was set to another tensor", "arguments"),
    ),
    Case(
        "purity",
        "a value-dependent shape (boolean indexing)",
        lambda: _step(_nonzero, (P("dp"),), P())(X),
        ("depends on tensor values", "torch.where"),
    ),
    Case(
        "purity",
        "random numbers inside the step",
        lambda: _step(_random, (P("dp"),), P("dp"))(X),
        ("randint_like", "pass it in as an argument"),
    ),
    Case(
        "purity",
        "one of shardspec's collectives inside a step",
        lambda: _step(lambda x: collectives.all_reduce(x, axis="dp", mesh=DP), (P("dp"),), P(), mesh=DP)(X),
        ("shardspec's own collectives", "constrain(x, P())"),
    ),
    Case(
        "specs",
        "a report of a rank the mesh does not have",
        lambda: _step(lambda x: x * 2, (P("dp"),), P("dp"), mesh=DP).lower(X).launches(5),
        ("rank 5 is not a device of dp=2", "0 to 1"),
    ),
    Case(
        "purity",
        "a step called inside an rng scope",
        _step_in_rng_scope,
        ("called inside shardspec.random.rng(key)", "pass the key to the step"),
    ),
    Case(
        "purity",
        "a JAX-style two-element random key",
        lambda: shardspec.random.fold_in(torch.tensor([0, 1]), 3),
        ("torch.int64 tensor of shape (2,)", "random.key(seed)"),
    ),
    Case(
        "purity",
        "torch.bernoulli inside the step",
        lambda: _step(lambda x: torch.bernoulli(torch.sigmoid(x)), (P("dp"),), P("dp"))(X),
        ("aten.bernoulli", "(torch.rand_like(probs) < probs).to(probs.dtype)", "(torch.rand_like(x) < p)"),
    ),
    Case(
        "purity",
        ".item() inside the step",
        lambda: _step(_item, (P("dp"),), P("dp"))(X),
        (".item()", "x.sum().item()", "keep it a tensor"),
    ),
    # autograd
    Case(
        "autograd",
        "value_and_grad of a loss that is not a scalar",
        lambda: _step(shardspec.value_and_grad(lambda w, x: x @ w), (P(), P("dp")), P())(torch.ones(4, 2), X),
        ("needs a floating-point scalar loss", "shape (4, 2)", ".mean()"),
    ),
    Case(
        "autograd",
        "value_and_grad with respect to an integer tensor",
        lambda: _step(shardspec.value_and_grad(lambda p, x: (x * p["s"]).sum()), (P(), P()), P())(
            {"s": torch.tensor(2)}, X
        ),
        ("argument 0['s'] is a torch.int64 tensor", "only floating-point tensors", "another argument"),
    ),
    Case(
        "autograd",
        "value_and_grad(has_aux=True) of a loss function that returns the loss alone",
        lambda: _step(
            shardspec.value_and_grad(lambda w, x: (x @ w).sum(), has_aux=True), (P(), P("dp")), P()
        )(torch.ones(4, 2), X),
        ("to return a pair (loss, aux)", "a torch.float32 tensor of shape ()", "leave has_aux off"),
    ),
    Case(
        "autograd",
        "value_and_grad(has_aux=True) with a Python number in aux",
        lambda: _step(
            shardspec.value_and_grad(lambda w, x: ((x @ w).sum(), {"n": 3}), has_aux=True),
            (P(), P("dp")),
            P(),
        )(torch.ones(4, 2), X),
        ("aux['n'] is a int", "tensors only", "torch.as_tensor"),
    ),
    Case(
        "autograd",
        "loss.backward() inside the step",
        lambda: _step(_backward_inside, (P(), P("dp")), P())(torch.ones(4, 2), X),
        ("backward() at", "loss.backward()", "shardspec.value_and_grad(loss_fn)"),
    ),
    Case(
        "autograd",
        "torch.func.grad through a sharded step",
        _grad_outside,
        ("torch.func transform", "value_and_grad"),
    ),
    Case(
        "autograd",
        "a Python number among the differentiated leaves",
        lambda: _step(
            lambda p, x: shardspec.value_and_grad(lambda p, x: (x @ p["w1"]).sum() * p["scale"])(p, x)[0],
            (P(), P("dp")),
            P(),
        )({"w1": PARAMS["w1"], "scale": 0.5}, X),
        ("argument 0['scale'] is a float", "torch.tensor(x)"),
    ),
    Case(
        "autograd",
        "an argument that requires grad",
        lambda: _step(lambda x: x.sum(), (P("dp"),), P())(torch.ones(4, requires_grad=True)),
        ("x requires grad", "(4,)", "value_and_grad"),
    ),
    Case(
        "autograd",
        "microbatches that do not divide the batch",
        lambda: _step(_microbatches, (P(), P("dp")), (P(), P()))(torch.randn(4, 2), X),
        ("(4, 4)", "3 microbatches"),
    ),
    # unsupported ops and options
    Case(
        "ops",
        "an op without a sharding rule",
        lambda: _step(_no_rule, (P("dp"),), P())(X),
        ("no sharding rule for shardspec_tests.doubled", "doubled(x).sum()", "unsupported='replicate'"),
    ),
    Case(
        "ops",
        "an unknown unsupported= option",
        lambda: sharded(_mlp, mesh=SIM, in_specs=(), out_specs=(), unsupported="gather"),
        ("unsupported='gather'",),
    ),
    Case("ops", "a sharded step nested in one on another mesh", _nested_other_mesh, ("another mesh", "tp=2")),
    Case(
        "ops",
        "a DTensor-only helper on a simulated mesh",
        lambda: shardspec.from_local(torch.ones(2), P("dp"), DP),
        ("from_local needs a real mesh",),
    ),
    # optimizers
    Case(
        "optim",
        "an AdamW hyper-parameter out of range",
        lambda: optim.adamw(lr=-1.0),
        ("adamw(lr=-1.0", "lr > 0"),
    ),
    Case(
        "optim",
        "an SGD hyper-parameter out of range",
        lambda: optim.sgd(lr=0.1, momentum=-1.0),
        ("momentum=-1.0", "momentum >= 0"),
    ),
    Case(
        "optim",
        "a hyperparameter that is not a number",
        lambda: optim.adamw(lr="3e-4"),
        ("lr='3e-4' is not a number", "adamw(lr=3e-4"),
    ),
    Case(
        "optim",
        "another optimizer's state",
        lambda: optim.adamw().update(PARAMS, optim.sgd(0.1, momentum=0.9).init(PARAMS), PARAMS),
        ("holds ['momentum']", "['m', 'step', 'v']", "this optimizer's init(params)"),
    ),
    # memory
    Case(
        "memory",
        "a donated argument the step returns unchanged",
        lambda: _step(lambda w, x: (w, x.sum()), (P(), P("dp")), (P(), P()), mesh=DP, donate=(0,))(
            torch.ones(2), torch.ones(4)
        ),
        ("w is donated", "returns it", "do not donate the argument holding w"),
    ),
    Case(
        "memory",
        "remat around a function with side effects",
        lambda: _step(_remat_writes, (P(), P("dp")), P(), mesh=DP)(torch.randn(4, 4), X),
        ("remat(_writes_buffer) writes in place", "add_", "(4,)", "make _writes_buffer pure"),
    ),
    Case(
        "memory",
        "an unknown remat policy",
        lambda: shardspec.remat(_mlp, policy="save_everything"),
        ("policy='save_everything'", "save_matmuls"),
    ),
    Case(
        "memory",
        "a bucket size that is not a number of bytes",
        lambda: _step(_mlp, (P(), P("dp")), P(), passes={"bucket_bytes": "1MB"})(PARAMS, X),
        ("'bucket_bytes': '1MB'", "not a number of bytes", "25 * 2**20"),
    ),
    Case(
        "memory",
        "a gradient reduction dtype that is not floating",
        lambda: _step(_mlp, (P(), P("dp")), P(), passes={"reduce_dtype": torch.int32}),
        ("reduce_dtype", "torch.int32", "torch.bfloat16"),
    ),
    Case(
        "memory",
        "a gradient reduction dtype with the cast pass off",
        lambda: _step(_mlp, (P(), P("dp")), P(), passes={"reduce_dtype": torch.bfloat16, "cast": False}),
        ("reduce_dtype with the cast pass off", "leave 'cast' on"),
    ),
    Case(
        "checkpoints",
        "a damaged shard file",
        _damaged_checkpoint,
        ("ckpt/step-00000001 is damaged", "__0_0.distcp (CRC-32", "verify=False"),
    ),
)

# Real-mode cases run on 2 gloo processes (tests/_contract_fns.py); listed here for the catalogue.
REAL_CASES: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("ddp_habit", "each rank passes its own slice of the batch as a plain tensor", ("x", "from_local")),
    ("seeds", "replicated parameters initialised differently on each rank", ("w", "[[0], [1]]")),
    ("scalar", "a rank-dependent Python scalar (e.g. lr)", ("different arguments", "[[0], [1]]")),
    ("grid", "a DTensor on another device grid with the same dim names", ("DeviceMesh [1, 0]", "[0, 1]")),
    ("shape", "one rank alone changes an argument's shape on a later call", ("different arguments",)),
    ("steps", "ranks calling different steps with the same argument shapes", ("different sharded steps",)),
    ("replica", "from_local blocks that differ across the ranks meant to hold the same block", ("[0, 1]",)),
    ("later_plain", "plain tensors that differ across ranks after a first call with DTensors", ("x",)),
    ("closure", "a tensor the step closes over that differs across ranks", ("closes over",)),
    ("absent", "a rank that never calls the step", ("did not complete within 2 s", "did not call it")),
)


def message(run: Callable[[], Any]) -> str:
    """The ShardingError text ``run`` raises ('' when it raises nothing)."""
    try:
        run()
    except shardspec.ShardingError as exc:
        return str(exc)
    return ""


def render(real: dict[str, str]) -> str:
    """docs/errors.md from the messages the cases produce now (paths relative to the repository)."""
    root = str(pathlib.Path(__file__).resolve().parent.parent) + "/"
    lines = [
        "# Errors",
        "",
        "Every user mistake below raises `shardspec.ShardingError` (a `ValueError`) whose first line names",
        "what is wrong (argument path, spec, sizes, source line) and whose last line says how to fix it. No",
        "message prints tensor values. The messages are the ones the code produces today: this page is",
        "generated by `python -m tests.error_catalogue`, and `tests/test_error_catalogue.py` checks every",
        "case and that this page is current.",
        "",
    ]
    current = ""
    for case in CASES:
        if case.category != current:
            current = case.category
            lines += [f"## {current}", ""]
        lines += [f"### {case.title}", "", "```text", message(case.run).replace(root, ""), "```", ""]
    lines += ["## real meshes (2 gloo processes)", ""]
    for key, title, _ in REAL_CASES:
        lines += [f"### {title}", "", "```text", real.get(key, ""), "```", ""]
    return "\n".join(lines)


def real_messages() -> dict[str, str]:
    from shardspec.testing import run_distributed
    from tests import _contract_fns

    results = run_distributed(_contract_fns.contract_checks, 2, timeout=120)
    return {key: str(results[0][key]) for key, _, _ in REAL_CASES}


if __name__ == "__main__":
    text = render(real_messages())
    out = sys.argv[1] if len(sys.argv) > 1 else "docs/errors.md"
    with open(out, "w") as f:
        f.write(text)
    print(f"wrote {out}: {len(CASES) + len(REAL_CASES)} cases")
