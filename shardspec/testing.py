"""Testing helpers: ``run_distributed`` (N local processes joined by torch.distributed, with a hard
deadline) and a property-testing kit for users' own models (``meshes()``, ``specs_for(shape, mesh)``
hypothesis strategies and ``assert_sharding_equivalent``). hypothesis is imported only when a
strategy is asked for.

Multi-process tests must fail, not hang: if any rank raises, the others are killed at once (they may
be blocked in a collective waiting for it); if the deadline passes, every rank still running is
killed and the error names them. Results come back in rank order.
"""

from __future__ import annotations

import contextlib
import math
import os
import pickle
import queue
import socket
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch.multiprocessing as mp


class DistributedTestError(RuntimeError):
    """A rank failed, or the run passed its deadline."""


def free_port() -> int:
    """A TCP port that was free a moment ago on the loopback interface (another process may take it
    before it is used: ``run_distributed`` does not rely on it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _agent_store(world_size: int) -> Any:
    """A TCPStore server bound here to a port the OS picks and held for the whole run, as torchrun's
    agent holds its store. The workers join it as clients (``TORCHELASTIC_USE_AGENT_STORE``), so no
    worker has to bind a port that was free a moment ago (which another process can take meanwhile:
    the 'address already in use' race)."""
    import datetime

    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    return TCPStore(
        "127.0.0.1",
        0,
        world_size,
        is_master=True,
        timeout=datetime.timedelta(seconds=60),
        wait_for_workers=False,
    )


def _worker(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    args: Sequence[Any],
    backend: str | None,
    init_file: str,
    env: Mapping[str, str],
    results: Any,
    timeout: float,
) -> None:
    os.environ.update(env)
    os.environ.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size),
        }
    )
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    _dump_stacks_on_request(os.path.join(os.path.dirname(init_file), f"stacks-{rank}"))
    try:
        if backend is not None:
            dist.init_process_group(
                backend,
                init_method=f"file://{init_file}",
                rank=rank,
                world_size=world_size,
                timeout=datetime.timedelta(seconds=timeout),
            )
            # gloo's connection handshake is one-sided: a rank whose fn returns at once would destroy
            # its group while a slower peer is still connecting to it ('Gloo connectFullMesh failed
            # ... Connection closed by peer'). After a barrier every pair is connected.
            dist.barrier()
        value = fn(rank, world_size, *args)
        try:
            payload = pickle.dumps(value)
        except Exception as exc:
            results.put((rank, "error", f"result of rank {rank} is not picklable: {exc!r}"))
        else:
            results.put((rank, "ok", payload))
        if dist.is_initialized():
            # no rank tears its sockets down while a peer still reads from them; a peer that
            # never arrives is named by the parent at its deadline, not reported from here
            with contextlib.suppress(RuntimeError):
                dist.barrier()
            dist.destroy_process_group()
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
        raise SystemExit(1) from None


def _dump_stacks_on_request(path: str) -> None:
    """On SIGUSR1, write every thread's Python stack to ``path``: the parent asks a rank that passed
    its deadline, so the error says where it hung."""
    import faulthandler
    import signal

    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, file=open(path, "w"), all_threads=True)  # noqa: SIM115


def _late_stacks(procs: list[Any], late: list[int], folder: str) -> str:
    """The Python stacks of the late ranks (asked for by SIGUSR1, given a second to write)."""
    import signal

    if not hasattr(signal, "SIGUSR1"):
        return ""
    for r in late:
        with contextlib.suppress(OSError):
            os.kill(procs[r].pid, signal.SIGUSR1)
    time.sleep(1.0)
    parts = []
    for r in late:
        with contextlib.suppress(OSError), open(os.path.join(folder, f"stacks-{r}")) as f:
            text = f.read().strip()
            if text:
                parts.append(f"rank {r} was at (innermost call first):\n{text[:3000]}")
    return "\n".join(parts)


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *,
    args: Sequence[Any] = (),
    timeout: float = 120.0,
    backend: str | None = "gloo",
    env: Mapping[str, str] | None = None,
    start_method: str | None = None,
) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` processes; return results by rank.

    ``start_method`` defaults to ``fork`` where the platform has it (a 4-rank start costs ~0.1 s
    instead of ~5 s of re-importing torch; each worker pins torch to one thread, so no OpenMP pool
    is inherited in use); with ``spawn``, ``fn`` must be a module-level function. With ``backend``
    set, the default process group is initialized (every pair connected) before ``fn`` runs; with
    ``backend=None`` only the torchrun environment variables (RANK, WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT, LOCAL_RANK) are set, so ``fn`` can exercise code that initializes torch.distributed
    itself (and must pass a barrier or collective before destroying the group it made: a rank that
    tears down while a peer is still connecting makes that peer fail in gloo's connectFullMesh). Raises
    DistributedTestError with the failing rank's traceback, or naming the ranks still running at
    the deadline.
    """
    if start_method is None:
        start_method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    ctx: Any = mp.get_context(start_method)
    results = ctx.Queue()
    store = None if backend is not None or "MASTER_PORT" in (env or {}) else _agent_store(world_size)
    base_env = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(store.port if store is not None else free_port()),
        "OMP_NUM_THREADS": "1",
        **({"TORCHELASTIC_USE_AGENT_STORE": "True"} if store is not None else {}),
        **(env or {}),
    }
    with tempfile.TemporaryDirectory(prefix="shardspec-dist-") as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [
            ctx.Process(
                target=_worker,
                daemon=True,
                args=(
                    fn,
                    r,
                    world_size,
                    tuple(args),
                    backend,
                    init_file,
                    base_env,
                    results,
                    timeout,
                ),
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        try:
            return _collect(procs, results, world_size, timeout, tmp)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
            for p in procs:
                p.join(timeout=10)


def _collect(procs: list[Any], results: Any, world_size: int, timeout: float, folder: str) -> list[Any]:
    deadline = time.monotonic() + timeout
    done: dict[int, Any] = {}
    while len(done) < world_size:
        try:
            rank, status, payload = results.get(timeout=0.05)
        except queue.Empty:
            for rank, p in enumerate(procs):
                if rank not in done and p.exitcode is not None and p.exitcode != 0:
                    _drain_error(results)
                    raise DistributedTestError(
                        f"rank {rank} exited with code {p.exitcode} before returning a result "
                        "(killed, crashed, or failed while starting)"
                    ) from None
            if time.monotonic() > deadline:
                late = [r for r in range(world_size) if r not in done]
                stacks = _late_stacks(procs, late, folder)
                raise DistributedTestError(
                    f"ranks {late} still running after the {timeout:.0f} s deadline (hung, e.g. "
                    "waiting in a collective that another rank never entered); all killed"
                    + (f"\n{stacks}" if stacks else "")
                ) from None
            continue
        if status == "error":
            raise DistributedTestError(_all_errors(results, {rank: payload}))
        done[rank] = pickle.loads(payload)
    return [done[r] for r in range(world_size)]


def _all_errors(results: Any, errors: dict[int, str]) -> str:
    """Every traceback the ranks send within a second: the first one to arrive is often only a
    peer's 'connection closed', the root cause comes from another rank."""
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        try:
            rank, status, payload = results.get(timeout=0.1)
        except queue.Empty:
            continue
        if status == "error":
            errors.setdefault(rank, payload)

    def weight(item: tuple[int, str]) -> tuple[bool, int]:
        return ("Connection closed" in item[1] or "Connection reset" in item[1], item[0])

    ordered = sorted(errors.items(), key=weight)
    return "\n".join(f"rank {r} raised:\n{tb}" for r, tb in ordered)


def _drain_error(results: Any) -> None:
    """Raise the traceback a dying rank managed to send, if any."""
    try:
        while True:
            rank, status, payload = results.get(timeout=0.5)
            if status == "error":
                raise DistributedTestError(f"rank {rank} raised:\n{payload}")
    except queue.Empty:
        return


# --- property-testing kit for users: random meshes and specs, and the equivalence check ---------


def _hypothesis() -> Any:
    try:
        from hypothesis import strategies
    except ImportError:
        raise ImportError(
            "shardspec.testing.meshes/specs_for are hypothesis strategies, and hypothesis is not "
            "installed. Fix: pip install hypothesis (or pip install -e '.[test]')."
        ) from None
    return strategies


def meshes(max_devices: int = 8, axis_names: Sequence[str] = ("dp", "tp", "sp"), *, min_axes: int = 1) -> Any:
    """A hypothesis strategy of simulated meshes: ``min_axes``..``len(axis_names)`` axes named in
    order, sizes 1..4 (size-1 axes included: they must cost nothing), at most ``max_devices`` devices.

    Example::

        @given(mesh=meshes(max_devices=4), data=st.data())
        def test_my_layer(mesh, data): ...
    """
    from shardspec.mesh import Mesh

    st = _hypothesis()

    @st.composite  # type: ignore[untyped-decorator]
    def draw_mesh(draw: Any) -> Mesh:
        n_axes = draw(st.integers(min_axes, len(axis_names)))
        sizes: list[int] = []
        for _ in range(n_axes):
            budget = max_devices // math.prod(sizes)
            sizes.append(draw(st.integers(1, max(1, min(4, budget)))))
        return Mesh(dict(zip(axis_names, sizes)), simulate=True)

    return draw_mesh()


def specs_for(shape: Sequence[int], mesh: Any, *, even: bool = False) -> Any:
    """A hypothesis strategy of every kind of valid ``P`` for a tensor of ``shape`` on ``mesh``:
    each mesh axis used at most once, a dim split over one axis or a tuple of axes, or replicated.
    ``even=True`` only splits a dim whose length the axes' product divides.

    Example::

        spec = data.draw(specs_for((8, 16), mesh))  # e.g. P(None, ("dp", "tp"))
    """
    from shardspec.spec import P

    st = _hypothesis()

    @st.composite  # type: ignore[untyped-decorator]
    def draw_spec(draw: Any) -> P:
        free = list(mesh.axis_names)
        entries: list[Any] = []
        for length in shape:
            k = draw(st.integers(0, len(free)))  # a tuple of any of the free axes
            chosen = tuple(draw(st.permutations(free))[:k])
            if even and chosen and length % math.prod(mesh.shape[a] for a in chosen):
                chosen = ()
            for name in chosen:
                free.remove(name)
            entries.append(None if not chosen else chosen[0] if len(chosen) == 1 else chosen)
        return P(*entries)

    return draw_spec()


def assert_sharding_equivalent(
    fn: Callable[..., Any],
    args: Sequence[Any],
    *,
    mesh: Any,
    in_specs: Any,
    out_specs: Any,
    rtol: float | None = None,
    atol: float | None = None,
    **sharded_options: Any,
) -> Any:
    """Check that ``sharded(fn, mesh=mesh, in_specs=..., out_specs=...)(*args)`` equals ``fn(*args)``
    run unsharded, leaf by leaf (``torch.testing.assert_close``: float tolerances by dtype, or
    ``rtol``/``atol``; integers exactly). Returns the sharded result. A mismatch names the result's
    path, the mesh and the specs, so a failing hypothesis example reads as a sharding bug report.

    Example::

        assert_sharding_equivalent(loss_fn, (params, x), mesh=Mesh({"dp": 2}, simulate=True),
                                   in_specs=(P(), P("dp")), out_specs=P())
    """
    import optree
    import torch

    from compiler import sharded

    expected = fn(*args)
    step = sharded(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, **sharded_options)
    actual = step(*args)
    want_paths, want, want_def = optree.tree_flatten_with_path(expected, none_is_leaf=False)
    got, got_def = optree.tree_flatten(actual, none_is_leaf=False)
    if want_def != got_def:
        raise AssertionError(f"sharded result tree {got_def} differs from the unsharded {want_def}")
    for path, w, g in zip(want_paths, want, got):
        if not isinstance(w, torch.Tensor):
            continue
        try:
            torch.testing.assert_close(g, w, rtol=rtol, atol=atol)
        except AssertionError as exc:
            where = "result" + "".join(f"[{key!r}]" for key in path)
            raise AssertionError(
                f"{where} differs between the sharded and unsharded run on {mesh!r} with "
                f"in_specs={in_specs!r}, out_specs={out_specs!r}:\n{exc}"
            ) from None
    return actual
