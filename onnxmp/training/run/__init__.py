"""Training runs: the loop (:class:`~onnxmp.training.run.trainer.Trainer`), its loss scaler and
schedules, the engines that run the artifacts' graphs, data-parallel collectives and saving.
It reads artifacts through :mod:`onnxmp.training.contract` and never imports
:mod:`onnxmp.training.build` (tests/test_imports.py checks it)."""
