"""One rank of the data-parallel tests (tests/training/test_training_distributed.py).

Run as ``mpiexec -n W python dp_worker.py api CONFIGS.json OUT`` (each config
trained in turn, one ``OUT.<i>.<rank>.npz`` per config and rank) or as
``mpiexec -n W python dp_worker.py cli FAULT -- <onnxmp train arguments>``
(the real CLI, with FAULT injected on rank 1).  The tests import :func:`run`
to train the one-process reference in their own process.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))

SIZES = (8, 16, 4)
ROWS = 16


def batches(count: int, poison: int | None = None) -> list[tuple[np.ndarray, np.ndarray]]:
    """``count`` batches of 16 rows; batch ``poison`` has inputs that overflow float16 (inf/NaN gradients)."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=(count * ROWS, SIZES[0])).astype(np.float32)
    y = x[:, :SIZES[-1]].argmax(axis=1).astype(np.int64)
    if poison is not None:
        x[poison * ROWS:(poison + 1) * ROWS] *= 1e6
    return [(x[i:i + ROWS], y[i:i + ROWS]) for i in range(0, len(x), ROWS)]


def run(config: dict, comm, folder: Path) -> dict[str, np.ndarray]:
    """Train as ``config`` says on this rank (``comm`` None: alone); the results as arrays."""
    from onnxmp.training import DynamicLossScaler, Trainer, build_artifacts
    from onnxmp.training.run import distributed
    from onnxmp.training.models import mlp, trainable

    rank, size = (0, 1) if comm is None else (comm.rank, comm.size)
    k = config["k"]
    data = batches(config["batches"], config.get("poison"))
    evaluation = batches(5)

    def shard(epoch: int):
        order = np.random.default_rng([0, epoch]).permutation(len(data))
        ordered = [data[i] for i in order]
        if comm is None:
            return ordered
        mine = distributed.shard(ordered, rank, size, k)
        # A rank given one micro-batch less than the others (a broken sharding of the user's).
        return mine[:-1] if config.get("drop_one_on_rank_1") and rank == 1 else mine

    eval_shard = distributed.contiguous_shard(evaluation, rank, size) if comm is not None else evaluation
    # A small growth interval, so the scale both grows and backs off within a few steps.
    scaler = lambda: (DynamicLossScaler(2.0**10, growth_steps=3) if config["precision"] == "float16"  # noqa: E731
                      else DynamicLossScaler.static(1.0))
    if config.get("resume"):
        trainer = Trainer.resume(config["resume"], communicator=comm, **config.get("overrides", {}))
    else:
        model = mlp(SIZES, seed=config.get("seed_on_rank_1", 0) if rank == 1 else 0)
        engine = config.get("engine", "auto")
        artifacts = build_artifacts(model, requires_grad=trainable(model), out_dir=folder / f"artifacts{rank}",
                                    precision=config["precision"], target="cpu",
                                    optimizer=config.get("optimizer", "adamw"))
        trainer = Trainer(artifacts, grad_accum_steps=k, communicator=comm, scaler=scaler(),
                          clip_global_norm=config.get("clip"), engine=engine,
                          lr_schedule=None if not config.get("schedule") else lambda step: 1e-2 / (1 + step))
    if config.get("initial_only"):
        return {f"param.{name}": value for name, value in trainer.parameters().items()}
    history = trainer.fit(shard, config["epochs"], eval_shard, ["accuracy"], progress=False)
    if config.get("save"):
        trainer.save(config["save"])
    result = {f"param.{name}": value for name, value in trainer.parameters().items()}
    result.update({
        "step_loss": np.array(history.step_loss), "step_loss_scale": np.array(history.step_loss_scale),
        "step_skipped": np.array(history.step_skipped),
        "epochs": np.array(json.dumps(history.epochs)),
        "counters": np.array([trainer.optimizer_steps, trainer.skipped_steps, trainer.micro_steps, trainer.epoch]),
        "loss_scale": np.array(trainer.scaler.scale),
    })
    return result


def _api(configs_path: str, out: str) -> None:
    from onnxmp.training.run import distributed

    comm = distributed.from_environment()
    configs = json.loads(Path(configs_path).read_text())
    with distributed.abort_on_error(comm), tempfile.TemporaryDirectory() as folder:
        for i, config in enumerate(configs):
            np.savez(f"{out}.{i}.{comm.rank}.npz", **run(config, comm, Path(folder)))


def _cli(fault: str, argv: list[str]) -> int:
    """The real ``onnxmp train``; on rank 1, ``raise`` fails the 5th micro-step with an
    exception, ``kill`` kills the process there in the second epoch (after the first save)."""
    from onnxmp.cli import main
    from onnxmp.training.run import trainer as trainer_module

    rank = int(os.environ.get("PMI_RANK", "0"))
    if rank == 1 and fault != "none":
        original = trainer_module.Trainer.train_step
        calls = []

        def faulty(self, *arrays):
            calls.append(1)
            if fault == "raise" and len(calls) == 5:
                raise ValueError("injected failure on rank 1")
            if fault == "kill" and self.epoch == 1:  # epoch 2 runs: epoch 1's state was saved
                os.kill(os.getpid(), signal.SIGKILL)
            return original(self, *arrays)

        trainer_module.Trainer.train_step = faulty
    return main(["train", *argv])


if __name__ == "__main__":
    if sys.argv[1] == "api":
        _api(sys.argv[2], sys.argv[3])
    else:
        assert sys.argv[3] == "--"
        sys.exit(_cli(sys.argv[2], sys.argv[4:]))
