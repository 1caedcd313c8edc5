"""Running measurements: the runner (`runner.py`: with the decoding sweep, where the decoders and the
meters meet, as `bench` is the only package that imports both; its measurement windows
`phase_windows.py`, what a configuration asks for `work_units.py`), the sweeps (`batch_sweep.py`
forward-only and the identifying design, `decode_batch.py` decoders across batch sizes,
`scaleout.py` submitit workers), the prompts and quality scores, the random-weight shapes, the
memory-bandwidth floor and the calibration procedure (`calibrate.py`; the GPU it measures,
`gpu_probe.py`)."""
