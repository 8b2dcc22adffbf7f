"""Continuous alignment (`dlrl align`): the controller and its parts, a package of its own.

No core trainer module imports this package; it builds on them (trainer.run, trainer.loop,
trainer.infra.fleet). Each module is one part of the controller:

    cli.py         `dlrl align` / `dlrl versions`: the command lines, the rollback of the replicas
    config.py      AlignConfig (section `align`) and the sections `dlrl align` reads
    controller.py  Aligner + align_loop: train -> gate -> canary -> promote, one step at a time
    data.py        feedback records and prompt pools mixed into the trainer's batches
    gate.py        the held-out gate a candidate version must pass before it is served
    promote.py     canary and promotion of a passed candidate onto the serving replicas
    replicas.py    ServingPool: the serving replicas (receive only promoted versions) and their live stats
    bank.py        WeightBank: promoted weights kept on disk for rollback
    metrics.py     AlignMetrics: the controller's Prometheus metrics
    report.py      event lines and the serving plot
    console.py     the align console (one web page, static/ holds its files)

The local end-to-end demo (`make align`: simulated users, all processes on one machine) lives
in examples/align/.
"""
