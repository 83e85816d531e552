"""The parity side: does the mixed-precision model compute what the float32 one does?

:mod:`~onnxmp.parity.emulate` runs float16/bfloat16 numerics on the CPU (every low-precision
tensor rounded, every computation as the target's kernel does it); :mod:`~onnxmp.parity.validate`
runs a reference and a candidate on the same inputs and judges every output;
:mod:`~onnxmp.parity.metrics` holds the error measures calibration and validation share.
See ``docs/parity.md``.
"""
