"""Every collective on the simulated backend, list mode and SPMD threads, against full-tensor references."""

import pytest
import torch

import collectives as C
from shardspec import Mesh
from tests.collective_cases import Case, call, cases, expected, inputs

MESHES = [
    Mesh({"x": 2}, simulate=True),
    Mesh({"dp": 2, "tp": 2}, simulate=True),
    Mesh({"a": 3}, simulate=True),
]
ALL = [(m, c) for m in MESHES for c in cases(m)]


def _same(got, want, case: Case) -> None:
    assert got.dtype == want.dtype, case.name
    assert got.shape == want.shape, (case.name, got.shape, want.shape)
    assert torch.equal(got, want), case.name


@pytest.mark.parametrize("mesh,case", ALL, ids=[f"{m.describe()}-{c.name}" for m, c in ALL])
def test_list_mode_matches_reference(mesh, case):
    got = call(case, mesh, inputs(case, mesh))
    for g, w in zip(got, expected(case, mesh), strict=True):
        _same(g, w, case)


def _spmd_all(rank, mesh, batch):
    return [call(case, mesh, inputs(case, mesh)[rank]) for case in batch]


@pytest.mark.parametrize("mesh", MESHES, ids=lambda m: m.describe())
def test_spmd_threads_match_list_mode(mesh):
    batch = cases(mesh)
    per_rank = C.run_simulated(_spmd_all, mesh, mesh, batch)
    for i, case in enumerate(batch):
        want = expected(case, mesh)
        for rank in range(mesh.size):
            _same(per_rank[rank][i], want[rank], case)


def test_send_recv_between_virtual_devices():
    mesh = Mesh({"pp": 3}, simulate=True)

    def stage(rank):
        x = torch.full((2,), float(rank))
        if rank > 0:
            x = x + C.recv((2,), torch.float32, axis="pp", src=rank - 1, mesh=mesh)
        if rank < 2:
            C.send(x, axis="pp", dst=rank + 1, mesh=mesh)
        return x

    assert [t.tolist() for t in C.run_simulated(stage, mesh)] == [[0, 0], [1, 1], [3, 3]]
