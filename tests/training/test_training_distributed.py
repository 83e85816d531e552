"""Data-parallel training on real MPI ranks (`mpiexec -n W`) against one process accumulating W times as much.

Each launch runs tests/training/dp_worker.py under mpiexec with a timeout, so a
hang fails the test instead of the run.  The one-process references train in
this process, from the same data, seed and shuffling.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import pytest

from onnxmp.training.run import distributed
from onnxmp.training.run.distributed import contiguous_shard, launched_world_size, shard

HERE = Path(__file__).parent
ROOT = HERE.parent.parent
WORKER = HERE / "dp_worker.py"
sys.path.insert(0, str(HERE))
import dp_worker  # noqa: E402

TIMEOUT = 120


def _mpiexec() -> str | None:
    # The launcher of the mpich wheel sits beside this Python; it must be the MPI mpi4py loads.
    return shutil.which("mpiexec", path=os.pathsep.join([str(Path(sys.executable).parent),
                                                         os.environ.get("PATH", "")]))


def _have_mpi() -> bool:
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return False
    return _mpiexec() is not None


needs_mpi = pytest.mark.skipif(not _have_mpi(), reason='needs mpi4py and mpiexec: pip install -e ".[train-cpu]"')


def _launch(ranks: int, *args: str, timeout: float = TIMEOUT) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    for name in ("PMI_RANK", "PMI_SIZE", "PMI_FD", "OMPI_COMM_WORLD_SIZE"):  # not nested in another job
        env.pop(name, None)
    # A session of its own: on a timeout the launcher and every rank it started go, not only mpiexec.
    process = subprocess.Popen([_mpiexec(), "-n", str(ranks), sys.executable, *args], cwd=ROOT, env=env,
                               stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        pytest.fail(f"{ranks} ranks still ran after {timeout} s (a hang): {stderr[-2000:]}")
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def _run_ranks(tmp_path: Path, ranks: int, configs: list[dict]) -> list[list[dict]]:
    """Train every config on ``ranks`` ranks; ``results[config][rank]``."""
    path = tmp_path / "configs.json"
    path.write_text(json.dumps(configs))
    done = _launch(ranks, str(WORKER), "api", str(path), str(tmp_path / "out"))
    assert done.returncode == 0, done.stderr[-3000:]
    return [[dict(np.load(tmp_path / f"out.{i}.{r}.npz")) for r in range(ranks)] for i in range(len(configs))]


def _reference(tmp_path: Path, config: dict) -> dict:
    folder = tmp_path / f"reference-{len(list(tmp_path.iterdir()))}"
    folder.mkdir()
    return dp_worker.run(config, None, folder)


def _assert_identical(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == b[key].dtype and np.array_equal(a[key], b[key], equal_nan=a[key].dtype.kind == "f"), key


def _params(result: dict) -> dict:
    return {k: v for k, v in result.items() if k.startswith("param.")}


# --- without ranks --------------------------------------------------------------------


@pytest.mark.parametrize("count", [1, 5, 6, 7, 13])
@pytest.mark.parametrize("size,per_rank", [(1, 1), (2, 1), (2, 3), (3, 2)])
def test_shards_interleave_back_to_the_global_order(count, size, per_rank):
    items = list(range(count))
    shards = [shard(items, r, size, per_rank) for r in range(size)]
    assert len({len(s) for s in shards}) == 1  # equal micro-step counts on every rank
    group = size * per_rank
    rebuilt = []
    for g in range(len(shards[0]) // per_rank):
        for r in range(size):
            rebuilt += shards[r][g * per_rank:(g + 1) * per_rank]
    assert [i for i in rebuilt if i is not None] == items  # nothing dropped, same order
    assert rebuilt.count(None) == (-count) % group  # only the last group is padded


@pytest.mark.parametrize("count,size", [(0, 2), (5, 2), (7, 3), (2, 3)])
def test_contiguous_shards_are_blocks_in_rank_order(count, size):
    blocks = [contiguous_shard(list(range(count)), r, size) for r in range(size)]
    assert sum(blocks, []) == list(range(count))
    assert max(map(len, blocks)) - min(map(len, blocks)) <= 1


def test_shard_rejects_a_rank_outside_the_world():
    with pytest.raises(Exception, match="no shard 2 of 2"):
        shard([1, 2], 2, 2, 1)


@pytest.mark.parametrize("environ,size", [({}, 1), ({"PMI_SIZE": "4"}, 4), ({"OMPI_COMM_WORLD_SIZE": "3"}, 3),
                                          ({"PMI_SIZE": ""}, 1), ({"PMI_SIZE": "1"}, 1)])
def test_launched_world_size_reads_the_launchers_variables(environ, size):
    assert launched_world_size(environ) == size


def test_alone_nothing_of_mpi_is_imported():
    code = ("import sys; from onnxmp.training.run import distributed as d; "
            "assert d.from_environment() is None and d.from_environment('none') is None; "
            "assert 'mpi4py' not in sys.modules")
    env = {k: v for k, v in os.environ.items() if k not in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE")}
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, check=True, timeout=60)


def test_a_world_of_one_trains_as_alone(tmp_path, fp16_artifacts, batches):
    from onnxmp.training import Trainer

    class One(distributed.Communicator):
        rank, size = 0, 1

        def allreduce_sum(self, a): raise AssertionError("a world of one needs no collective")
        allreduce_min = allreduce_max = broadcast = allreduce_sum

        def barrier(self): raise AssertionError("a world of one needs no collective")

        def abort(self, code=1): raise AssertionError

    alone, one = Trainer(fp16_artifacts, grad_accum_steps=2), Trainer(fp16_artifacts, grad_accum_steps=2,
                                                                      communicator=One())
    assert one.comm is None
    for trainer in (alone, one):
        trainer.fit(batches, 1, progress=False)
    _assert_identical(alone.parameters(), one.parameters())


# --- on ranks -------------------------------------------------------------------------


@needs_mpi
def test_two_ranks_equal_one_process_accumulating_two(tmp_path):
    """Bit for bit: fp32; emulated fp16 with a batch of rank 1 that overflows (both ranks
    skip, same scale history), with AdamW and SGD; fp32 with clipping (on the reduced gradients)
    and an lr schedule; emulated bfloat16."""
    # 13 batches: the last effective batch (one micro-batch) leaves rank 1 padding.
    # Batch 3 (rank 1's in the 2nd effective batch of epoch 0's order) overflows in float16.
    order = np.random.default_rng([0, 0]).permutation(13)
    poison = int(order[3])
    configs = [dict(precision="float32", k=1, batches=13, epochs=2),
               dict(precision="float16", k=1, batches=13, epochs=2, poison=poison),
               dict(precision="float32", k=1, batches=13, epochs=2, clip=0.05, schedule=True),
               dict(precision="float16", k=1, batches=13, epochs=2, poison=poison, optimizer="sgd"),
               dict(precision="bfloat16", k=1, batches=13, epochs=2)]
    results = _run_ranks(tmp_path, 2, configs)
    for config, (rank0, rank1) in zip(configs, results):
        _assert_identical(rank0, rank1)  # the ranks agree on everything
        reference = _reference(tmp_path, {**config, "k": 2})
        _assert_identical(rank0, reference)
    fp16 = results[1][0]
    assert fp16["step_skipped"].sum() >= 1 and fp16["counters"][1] >= 1  # the overflow was skipped
    assert len(set(fp16["step_loss_scale"].tolist())) >= 3  # the scale both grew and backed off
    assert json.loads(str(fp16["epochs"]))[0]["eval_accuracy"] > 0


@needs_mpi
def test_two_ranks_on_the_portable_engine_equal_one_process(tmp_path):
    """The portable engine through the same communicator: gradients all-reduced before the
    step, the finite flag all-reduced (emulated fp16 with an overflowing batch on rank 1), and
    clipping on the reduced gradients."""
    order = np.random.default_rng([0, 0]).permutation(13)
    configs = [dict(precision="float16", k=1, batches=13, epochs=2, poison=int(order[3]), optimizer="sgd",
                    engine="portable"),
               dict(precision="float32", k=1, batches=13, epochs=1, clip=0.05, engine="portable")]
    results = _run_ranks(tmp_path, 2, configs)
    for config, (rank0, rank1) in zip(configs, results):
        _assert_identical(rank0, rank1)
        _assert_identical(rank0, _reference(tmp_path, {**config, "k": 2}))
    assert results[0][0]["step_skipped"].sum() >= 1


@needs_mpi
def test_three_ranks_two_micro_batches_match_within_float_rounding(tmp_path):
    # 14 batches in effective batches of 6: the last has 2, so ranks 1 and 2 pad it entirely.
    order = np.random.default_rng([0, 1]).permutation(14)
    config = dict(precision="float16", k=2, batches=14, epochs=2, poison=int(order[9]))
    (ranks,) = _run_ranks(tmp_path, 3, [config])
    _assert_identical(ranks[0], ranks[1])
    _assert_identical(ranks[0], ranks[2])
    reference = _reference(tmp_path, {**config, "k": 6})
    # Same decisions: skips, scale history, counters.
    for key in ("step_skipped", "step_loss_scale", "counters", "loss_scale"):
        assert np.array_equal(ranks[0][key], reference[key]), key
    assert ranks[0]["counters"][1] >= 1
    # Three partial sums are added in another order than one process's running sum.
    for key, value in _params(reference).items():
        np.testing.assert_allclose(ranks[0][key], value, rtol=1e-6, atol=1e-7, err_msg=key)
    np.testing.assert_allclose(ranks[0]["step_loss"], reference["step_loss"], rtol=1e-5)


@needs_mpi
def test_parameters_come_from_rank_0(tmp_path):
    (ranks,) = _run_ranks(tmp_path, 2, [dict(precision="float32", k=1, batches=2, epochs=1, seed_on_rank_1=7,
                                             initial_only=True)])
    _assert_identical(ranks[0], ranks[1])
    alone = _reference(tmp_path, dict(precision="float32", k=1, batches=2, epochs=1, initial_only=True))
    _assert_identical(ranks[0], alone)


@needs_mpi
def test_resume_is_bit_exact_and_another_world_size_keeps_the_effective_batch(tmp_path):
    state = tmp_path / "state"
    base = dict(precision="float16", k=1, batches=9, poison=4)
    full, part = _run_ranks(tmp_path, 2, [dict(base, epochs=3), dict(base, epochs=1, save=str(state))])
    # Resume on 2 ranks and, with 2 micro-batches, in one process: both continue exactly.
    (resumed,) = _run_ranks(tmp_path, 2, [dict(base, epochs=3, resume=str(state))])
    alone = _reference(tmp_path, dict(base, epochs=3, resume=str(state)))
    for result in (resumed[0], resumed[1], alone):
        _assert_identical(_params(result), _params(full[0]))
        assert np.array_equal(result["counters"], full[0]["counters"])
        assert result["loss_scale"] == full[0]["loss_scale"]
    # An effective batch of 2 does not split over 3 ranks: refused, on every rank alike.
    path = tmp_path / "refused.json"
    path.write_text(json.dumps([dict(base, epochs=3, resume=str(state))]))
    done = _launch(3, str(WORKER), "api", str(path), str(tmp_path / "refused"))
    assert done.returncode != 0
    assert "which 3 ranks cannot split evenly" in done.stderr


@needs_mpi
def test_unequal_micro_batch_counts_fail_on_every_rank_without_hanging(tmp_path):
    path = tmp_path / "configs.json"
    path.write_text(json.dumps([dict(precision="float32", k=1, batches=6, epochs=1, drop_one_on_rank_1=True)]))
    done = _launch(2, str(WORKER), "api", str(path), str(tmp_path / "out"), timeout=60)
    assert done.returncode != 0
    assert "the ranks ran different numbers of micro-batches" in done.stderr


# --- the CLI --------------------------------------------------------------------------


@pytest.fixture()
def cli_files(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(300, 64)).astype(np.float32)
    y = rng.integers(0, 10, size=300)
    x[40] *= 1e5  # overflows float16: one skipped step
    np.savez(tmp_path / "d.npz", x=x, y=y)
    np.savez(tmp_path / "e.npz", x=x[:100] / 1e5, y=y[:100])
    return tmp_path


def _cli_args(files: Path, out: Path, *extra: str) -> list[str]:
    return [str(ROOT / "models" / "mlp.onnx"), "--data", str(files / "d.npz"), "--eval", str(files / "e.npz"),
            "--inputs", "x", "--labels", "y", "--batch-size", "32", "--epochs", "2", "--precision", "float16",
            "--out", str(out), "--no-progress", *extra]


@needs_mpi
def test_mpiexec_train_writes_the_model_of_one_process_accumulating(cli_files, capsys):
    from onnxmp.cli import main

    assert main(["train", *_cli_args(cli_files, cli_files / "one", "--grad-accum-steps", "2")]) == 0
    done = _launch(2, str(WORKER), "cli", "none", "--", *_cli_args(cli_files, cli_files / "two"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("data-parallel on 2 ranks") == 1  # rank 0 alone prints
    for name in ("model.onnx", "model.float16.onnx"):
        assert (cli_files / "one" / name).read_bytes() == (cli_files / "two" / name).read_bytes(), name
    one, two = (json.loads((cli_files / d / "history.json").read_text()) for d in ("one", "two"))
    assert two.pop("world_size") == 2 and two.pop("grad_accum_steps_per_rank") == 1
    assert one == two  # losses, eval metrics, skipped steps and the final loss scale
    assert one["skipped_steps"] >= 1
    onnx.checker.check_model(str(cli_files / "two" / "model.onnx"))


@needs_mpi
def test_an_exception_on_one_rank_ends_the_job_with_its_error(cli_files):
    start = time.monotonic()
    done = _launch(2, str(WORKER), "cli", "raise", "--", *_cli_args(cli_files, cli_files / "out"), timeout=60)
    assert done.returncode == 1
    assert "onnxmp train (rank 1 of 2): error: ValueError: injected failure on rank 1" in done.stderr
    assert "Traceback" not in done.stderr
    assert not (cli_files / "out").exists()
    assert time.monotonic() - start < 60


@needs_mpi
def test_a_killed_rank_ends_the_job_and_leaves_only_the_last_state(cli_files):
    from onnxmp.training import Trainer

    done = _launch(2, str(WORKER), "cli", "kill", "--", *_cli_args(cli_files, cli_files / "out"), timeout=60)
    assert done.returncode != 0
    # rank 0's folder is renamed into place only at the end; the per-epoch state is at its final path.
    assert sorted(p.name for p in (cli_files / "out").iterdir()) == ["state"]
    assert Trainer.resume(cli_files / "out" / "state").epoch == 1


@needs_mpi
def test_cli_resumes_a_two_rank_run_alone_exactly(cli_files):
    from onnxmp.cli import main

    done = _launch(2, str(WORKER), "cli", "none", "--", *_cli_args(cli_files, cli_files / "two"))
    assert done.returncode == 0, done.stderr[-3000:]
    args = _cli_args(cli_files, cli_files / "part")
    part = _launch(2, str(WORKER), "cli", "none", "--", *[("1" if a == "2" and args[i - 1] == "--epochs" else a)
                                                          for i, a in enumerate(args)])
    assert part.returncode == 0, part.stderr[-3000:]
    # Alone, the effective batch of 2 ranks x 1 becomes 2 micro-batches per update.
    assert main(["train", *_cli_args(cli_files, cli_files / "part", "--resume", str(cli_files / "part"))]) == 0
    for name in ("model.onnx", "model.float16.onnx"):
        assert (cli_files / "two" / name).read_bytes() == (cli_files / "part" / name).read_bytes(), name
