"""The config room: what a run is. The schema every YAML file and command-line key lands in (`schema.py`:
TrainConfig and its sections, the model's keys in `model.py`, the hardware profile's in `hardware.py`),
the checks that refuse bad input before any process starts (`validate.py`, `ranges.py`, `feature_keys.py`,
`mix.py`, `ft.py`, `layout_keys.py`), and the resolved values a worker receives instead of the config: `Run`
(`run.py`), `BuildOptions` (`options.py`), the precision (`precision.py`), the planner's `Prediction`
(`prediction.py`). Optional dependencies and their install hints: `extras.py`.

May import: errors, files, flops, compat, layout (the seam holds a Layout; layout/ reads a model's shape
as `flops.ModelShape`, never the config). Never the runtime, the planner or the launchers
(tests/unit/test_imports.py).
"""
