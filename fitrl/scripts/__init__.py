"""The programs: one module per stage, named as the stage (`eval_dpo` runs `eval`'s), and the tools.

`fitrl <stage>` runs `python -m fitrl.scripts.<stage>` (training stages under `accelerate launch`), and
so does the pipeline; `scripts/<stage>.py` in a checkout is a thin entry to the same `main`. Each reads
as its stage's story: a short `main` of named phases (preflight, build, train, finish), the shared
machinery in the package beside it.
"""
